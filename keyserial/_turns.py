"""Which turns each task is in, and what each waiting call waits for: records, not frames.

Two tables, both keyed by asyncio objects and read only on demand:

``RUNNING``: task -> the innermost ``TurnRecord`` of the turns that task is in. A record
    is a plain tuple ``(outer, owner, keys, fn)``: the task's next turn outwards (or None),
    what gives the turn's fence (``owner.fence_of(keys)``), the keys, and the function the
    turn runs (None for a ``lock()`` block). Written only where a turn starts and ends:
    ``KeyedSerialQueue.run`` and its decorator twin (inlined there: see below), and
    `enter_turn` / `leave_turn` for everything else (blocks, multi-key calls, submitted
    tasks, the backends' turns).
``WAITING``: the future a waiting call awaits -> its ``WaitRecord`` ``(share, keys, since,
    fn)``. Written only by the code that makes a call wait (``run`` inline, and
    `LoopShare.await_turn`), right before the ``await`` and removed right after it.

Readers: ``current_fence()`` and ``keyserial.postgres.connection()`` walk a task's records
outwards (`innermost`); the deadlock check asks what a blocked task waits for
(`WAITING`), whether a task holds any turn (`holds_any`) and which function it runs
(`function_of`); ``stats()`` asks since when a call waits.

Why tuples and module-level dicts: every uncontended ``run`` writes one record and removes
it, so the record is the cheapest thing that can be built and dropped (a tuple literal and
two dict operations; see docs/performance.md). A turn that is left out of order (a
``lock()`` block opened in an async generator and closed while a later turn of the same
task still runs) is marked left through its ``BlockTurn`` owner and skipped by readers
until the turns above it end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from typing import Any, Final, Protocol, TypeVar

V = TypeVar("V")
Task = asyncio.Task[Any]


class TurnOwner(Protocol):
    """What a turn record's owner gives: the fence of the turn holding ``keys``, if any."""

    def fence_of(self, keys: tuple[Hashable, ...]) -> int | None: ...


#: ``(outer, owner, keys, fn)``; see the module's docstring. Index with the names below.
TurnRecord = tuple[Any, TurnOwner, tuple[Hashable, ...], Any]
OUTER: Final = 0
OWNER: Final = 1
KEYS: Final = 2
FN: Final = 3

#: ``(share, keys, since, fn)``: what a waiting call waits for, and since when (loop clock).
WaitRecord = tuple[Any, tuple[Hashable, ...], float, Any]

#: task -> the innermost turn it is in.
RUNNING: dict[Task, TurnRecord] = {}
#: the future a waiting call awaits -> what it waits for.
WAITING: dict[asyncio.Future[Any], WaitRecord] = {}


class BlockTurn:
    """The owner of a block's record (``lock()``, ``lock_all()``, a backend's block).

    A block may be left out of order (from an async generator); ``open`` turns False when
    it is left, and readers skip the record from then on.
    """

    __slots__ = ("open", "turn")

    def __init__(self, turn: TurnOwner) -> None:
        self.turn = turn  # the share, or a backend's turn: what gives the fence
        self.open = True

    def fence_of(self, keys: tuple[Hashable, ...]) -> int | None:
        return self.turn.fence_of(keys) if self.open else None


def is_live(record: TurnRecord) -> bool:
    owner = record[OWNER]
    return type(owner) is not BlockTurn or owner.open


def enter_turn(
    task: Task, owner: TurnOwner, keys: tuple[Hashable, ...], fn: Any = None
) -> TurnRecord:
    """Record that ``task`` now runs in a turn of ``keys``; returns the record to leave."""
    record: TurnRecord = (RUNNING.get(task), owner, keys, fn)
    RUNNING[task] = record
    return record


def leave_turn(task: Task, record: TurnRecord) -> None:
    """The turn ``record`` stands for ended (its block was left, its call returned)."""
    owner = record[OWNER]
    if type(owner) is BlockTurn:
        owner.open = False
    if RUNNING.get(task) is record:
        restore(task, record[OUTER])
    # else: left out of order; the record stays, dead, until the turns above it end


def restore(task: Task, outer: TurnRecord | None) -> None:
    """Make ``outer`` (or the nearest live turn outside it) ``task``'s innermost turn again."""
    while outer is not None and not is_live(outer):
        outer = outer[OUTER]
    if outer is None:
        RUNNING.pop(task, None)
    else:
        RUNNING[task] = outer


def innermost(task: Task, pick: Callable[[TurnRecord], V | None]) -> V | None:
    """What ``pick`` gives for the innermost live turn of ``task`` that gives anything."""
    record = RUNNING.get(task)
    while record is not None:
        if is_live(record) and (found := pick(record)) is not None:
            return found
        record = record[OUTER]
    return None


def holds_any(task: Task) -> bool:
    """Whether ``task`` is inside a turn (of any queue, in-process or a backend's)."""
    return innermost(task, lambda _record: True) is not None


def function_of(task: Task, awaited: object) -> Any:
    """The function ``task`` runs, or waits to run (``awaited``: the future it is parked on)."""
    wait = WAITING.get(awaited) if awaited is not None else None  # type: ignore[call-overload]
    if wait is not None and wait[3] is not None:
        return wait[3]
    return innermost(task, lambda record: record[FN])


def fence_of_record(record: TurnRecord) -> int | None:
    return record[OWNER].fence_of(record[KEYS])
