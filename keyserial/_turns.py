"""Which turns each task is in, and what each waiting call waits for: records, not frames.

``RUNNING`` maps a task to the innermost record of the turns it is in (or waits for), each
a plain tuple chained to the task's next record outwards:

* a turn: ``(outer, owner, key, fn)``: what gives the turn's fence (``owner.fence_of(key)``),
  the key (for a multi-key turn, its keys) and the function it runs (None for a block);
* a wait: ``(outer, share, key, fn, waiter, since)``: a single-key call waiting for its turn
  on the future ``waiter`` since ``since`` (the loop's clock). ``run`` keeps it as its turn's
  record once the turn comes: a record whose ``waiter`` is done is a turn.

Written only where a turn or a wait starts and ends: inline in ``KeyedSerialQueue.run``, and
through `enter_turn`, `enter_wait` and `leave_turn` everywhere else (blocks, multi-key
calls, submitted tasks, re-entry, the backends' turns).

Readers: ``current_fence()`` and ``keyserial.postgres.connection()`` walk a task's turns
outwards (`innermost`); the deadlock check asks what a blocked task waits for
(`wait_of`), whether a task holds any turn (`holds_any`) and which function it runs
(`function_of`); ``stats()`` asks since when a call waits.

Why tuples in one module-level dict: every uncontended ``run`` writes one record and removes
it, so the record is the cheapest thing that can be built and dropped (a tuple and three
dict operations; docs/performance.md gives its cost), and a call that waits writes no
other. A block left out of order (a ``lock()`` block opened in an async generator and
closed while a later turn of the same task still runs) is marked left through its
``BlockTurn`` owner: readers skip it, and it is dropped when the turns above it end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from typing import Any, Final, Protocol, TypeVar

V = TypeVar("V")
Task = asyncio.Task[Any]


class TurnOwner(Protocol):
    """What a turn record's owner gives: the fence of the turn of ``key``, if any."""

    def fence_of(self, key: Hashable) -> int | None: ...


#: A turn ``(outer, owner, key, fn)`` or a wait ``(outer, share, key, fn, waiter, since)``;
#: see the module's docstring. Index with the names below.
TurnRecord = tuple[Any, ...]
OUTER: Final = 0
OWNER: Final = 1
KEY: Final = 2
FN: Final = 3
WAITER: Final = 4
SINCE: Final = 5

#: task -> the innermost record of the turns it is in, or waits for.
RUNNING: dict[Task, TurnRecord] = {}


class BlockTurn:
    """The owner of a block's record (``lock()``, ``lock_all()``, a backend's block).

    A block may be left out of order (from an async generator); ``open`` turns False when
    it is left, and readers skip the record from then on.
    """

    __slots__ = ("open", "turn")

    def __init__(self, turn: TurnOwner) -> None:
        self.turn = turn  # the share, or a backend's turn: what gives the fence
        self.open = True

    def fence_of(self, key: Hashable) -> int | None:
        return self.turn.fence_of(key) if self.open else None


def is_waiting(record: TurnRecord) -> bool:
    """Whether ``record`` is a call still waiting for its turn (it holds nothing yet)."""
    return len(record) > WAITER and not record[WAITER].done()


def is_live(record: TurnRecord) -> bool:
    """Whether ``record`` is a turn its task is in (not a block left, not a wait)."""
    owner = record[OWNER]
    return (type(owner) is not BlockTurn or owner.open) and not is_waiting(record)


def enter_turn(task: Task, owner: TurnOwner, key: Hashable, fn: Any = None) -> TurnRecord:
    """Record that ``task`` now runs in a turn of ``key``; returns the record to leave."""
    record: TurnRecord = (RUNNING.get(task), owner, key, fn)
    RUNNING[task] = record
    return record


def enter_wait(
    task: Task, share: Any, key: Hashable, fn: Any, waiter: asyncio.Future[Any], since: float
) -> TurnRecord:
    """Record that ``task`` waits on ``waiter`` for the turn of ``key`` in ``share``."""
    record: TurnRecord = (RUNNING.get(task), share, key, fn, waiter, since)
    RUNNING[task] = record
    return record


def leave_turn(task: Task, record: TurnRecord) -> None:
    """The turn (or wait) ``record`` stands for ended: its block was left, its call returned."""
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


def wait_of(task: Task, awaited: object) -> TurnRecord | None:
    """The wait record of ``task``, if it is parked on ``awaited`` waiting for a turn."""
    record = RUNNING.get(task)
    if record is not None and len(record) > WAITER and record[WAITER] is awaited:
        return record
    return None


def function_of(task: Task) -> Any:
    """The function ``task`` runs, or waits to run: its innermost record's that names one."""
    record = RUNNING.get(task)
    while record is not None:
        if record[FN] is not None and (is_live(record) or is_waiting(record)):
            return record[FN]
        record = record[OUTER]
    return None


def fence_of_record(record: TurnRecord) -> int | None:
    owner: TurnOwner = record[OWNER]
    return owner.fence_of(record[KEY])
