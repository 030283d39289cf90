"""Deadlock detection: refuse a wait that would close a cycle of tasks waiting on each other.

A task about to wait for some keys closes a cycle if the holders of those keys, in the end,
wait for it. "Wait for" has two kinds of edges:

* a task waiting for a key waits for the key's holder (the queue's records, and for a
  wait on a plain future the frame that awaits it: see "What a waiting call waits for");
* a task blocked in ``await`` waits for what it awaits — a task, or through ``gather``,
  ``TaskGroup``, ``wait``, ``shield`` or ``wait_for`` the tasks behind them
  (``keyserial._asyncio_internals`` reads those off asyncio's objects).

``asyncio.wait`` with ``FIRST_COMPLETED`` or ``FIRST_EXCEPTION`` waits for *any* of its
futures, so it is on a cycle only if every one still pending is. A wait with a timeout is
treated like any other: the cycle is certain, and failing now says why.

Only calls that must wait pay for the walk, and it stops at once when every holder is
running. A long chain of blocked holders would make every call queued behind it walk the
whole chain, so the walk is bounded: past a few nodes the check asks instead whether
anything could lead back to the waiting task at all (`unreachable`) — usually nothing
holds a key and awaits it, which a short backward walk shows — and walks in full only when
something might. A holder in the middle of a step (a task created with ``eager_task_factory``
registers while its creator still runs) cannot be judged yet: the caller re-checks once the
creator has suspended, see `check_later`.

The common wait is behind a holder blocked on something that is none of these (I/O, an
event, a sleep): it leads nowhere, and the answer stays the same for every call queued
behind it until the holder resumes. The last such holder and the future it waits on are
remembered (weakly), so a burst of calls behind it does not read its coroutines each time.

What a waiting call waits for
-----------------------------

What a waiting call waits for: the keys, the share that holds them, and since when.

A ``run``, ``call`` or ``lock`` without a timeout waits on an exact ``asyncio.Future``.
asyncio's C task takes its fast path only for an exact future: awaiting a subclass costs it
an attribute lookup, a method call and a bound method more, on every contended call
(benchmarks: contended-100). An exact future carries nothing, so what
it waits for is read where it already is: in the locals of the frame that awaits it, the
registering coroutine of the queue (``key``, the share, and ``since``, the time of the
registration). A frame is registered here with `register_waiting_code`.

Every other wait carries the same facts itself, as a ``Waiter``: one with a timeout (its
timer is a slot of it), one that ``submit`` registers before its task exists (no frame
awaits it yet), and one for several keys.

Reading a frame costs microseconds, but only the deadlock check (when the holder it looks
at is blocked) and ``stats()`` read them, never a hand-off. A burst of calls queued behind
one blocked holder would read the same frame again and again, so the last answer is
remembered (weakly) with the future it was read for: a task still blocked on that future
still waits for the same keys.

What cannot lead back to a task
-------------------------------

Showing, without walking a chain of holders, that no wait can lead back to a task.

The deadlock check walks forward from the holders a task is about to wait for, looking for
the task. Behind a long chain of blocked holders that walk is long, and every call queued
behind the chain would repeat it. The backward question is usually short instead: who could
a path end at? A path into a task ends either with a key it holds (or that a task awaiting
it holds), or with plain waits from a holder that awaits it. So if neither the task nor
anything awaiting it holds a key or is one of the holders, no path exists.

"Holds a key" must never be missed, so it is read conservatively and the answer is only
ever "surely not" or "unsure": a keyserial turn or registration on a task's await chain
(registered code objects), a lock block the task is in (recorded per task: a block has no
frame of its own, and may even be kept open by a suspended async generator), an await chain
that cannot be read to its end, or a task in the middle of a step.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import weakref
from collections.abc import Callable, Hashable, Sequence
from types import CodeType, FrameType
from typing import Any, NamedTuple

from ._asyncio_internals import (
    MAX_DEPTH,
    WaitsOn,
    coroutine_chain,
    frame_of,
    fut_waiter,
    is_running,
    is_task,
    may_start_eagerly,
    tasks_waiting_for,
    waits_of_future,
    waits_of_task,
    woken_by,
)
from ._errors import DeadlockError
from ._records import KeyHolders, MultiWaiter, TimedWaiter, Waiter

#: id of a registering coroutine's code -> the name of its local that holds the share.
_waiting_codes: dict[int, str] = {}
#: The registered code objects, kept so that their ids stay theirs.
_kept_codes: list[CodeType] = []


class TurnWait(NamedTuple):
    """What a blocked call waits for (a node of the deadlock check's walk, like a waiter)."""

    share: KeyHolders
    keys: tuple[Hashable, ...]
    since: float  # when the call registered, on the loop's clock


def register_waiting_code(code: CodeType, share_local: str) -> None:
    """Declare that a frame running ``code`` may await an exact future for a turn.

    Such a frame must have the locals ``waiter`` (the future), ``key``, ``since`` and
    ``share_local`` (the share), all set before it awaits ``waiter``.
    """
    _kept_codes.append(code)
    _waiting_codes[id(code)] = share_local


#: The last answer read off a frame: the task, the future it awaited, and what it waits for.
_last: tuple[weakref.ref[Any], weakref.ref[Any], TurnWait] | None = None


def turn_wait_of_task(task: asyncio.Task[Any]) -> TurnWait | None:
    """What ``task`` waits for, if it is blocked waiting for a turn; else None."""
    awaited: Any = fut_waiter(task)
    if awaited is None:
        return None
    global _last
    last = _last
    if last is not None and last[1]() is awaited and last[0]() is task:
        return last[2]  # asked first: a burst of calls behind one holder asks this
    kind: object = awaited.__class__
    if kind is Waiter or kind is TimedWaiter:
        return TurnWait(awaited.share, (awaited.key,), awaited.since)
    if kind is MultiWaiter:
        return TurnWait(awaited.share, awaited.keys, awaited.since)
    if kind is not asyncio.Future:
        return None
    found = _read_frames(task, awaited)
    if found is not None:
        with contextlib.suppress(TypeError):  # a task type without weak references
            _last = (weakref.ref(task), weakref.ref(awaited), found)
    return found


def waited_since(waiter: asyncio.Future[Any]) -> float | None:
    """When the call waiting on ``waiter`` registered; None if no frame says so."""
    if isinstance(waiter, Waiter):
        return waiter.since
    for task in tasks_waiting_for(waiter):
        found = _read_frames(task, waiter)
        if found is not None:
            return found.since
    return None


def _read_frames(task: asyncio.Task[Any], future: object) -> TurnWait | None:
    """What the innermost registering frame of ``task`` that awaits ``future`` waits for."""
    for coro in reversed(list(coroutine_chain(task))):
        frame = frame_of(coro)
        if frame is None:
            continue
        share_local = _waiting_codes.get(id(frame.f_code))
        if share_local is None:
            continue
        names = frame.f_locals
        if names.get("waiter") is not future:
            return None  # the innermost registering frame waits for something else
        try:
            return TurnWait(names[share_local], (names["key"],), names["since"])
        except KeyError:
            return None
    return None


Task = asyncio.Task[Any]

#: Nodes `unreachable` visits before it gives up (and the forward walk runs in full).
_BACKWARD_BUDGET = 32

_COROUTINE_FLAGS = 0x80 | 0x100 | 0x200  # CO_COROUTINE, CO_ITERABLE_COROUTINE, CO_ASYNC_GENERATOR

#: The ids of the code objects of every keyserial coroutine that registers for keys or holds
#: them while it runs: the entry codes, and the registering ones of lock blocks and multi-key
#: calls. Ids, because hashing a code object hashes its bytecode and constants; the codes
#: themselves are kept in `_kept_codes`, so their ids stay theirs.
_holding_codes: set[int] = set()
#: Tasks inside ``lock()``/``lock_all()`` blocks, with how many: a block has no frame of its
#: own on its task's await chain (it may even belong to a suspended async generator).
_block_holders: dict[Task, int] = {}


def register_holding_code(code: Any) -> None:
    """Declare that a frame running ``code`` registers for keys or holds some."""
    _kept_codes.append(code)
    _holding_codes.add(id(code))


def block_entered(task: Task) -> None:
    """``task`` now holds keys for a lock block."""
    _block_holders[task] = _block_holders.get(task, 0) + 1


def block_left(task: Task) -> None:
    """``task`` left a lock block it entered with `block_entered`."""
    left = _block_holders.pop(task, 1) - 1
    if left:
        _block_holders[task] = left


#: What `unreachable` answers when the running task was started eagerly by a task still in
#: the middle of its step: nothing can be said until that step ends.
LATER = "later"


def unreachable(task: Task, holders: Sequence[Task | None], running: bool) -> bool | str:
    """Whether nothing can lead from ``holders`` back to ``task``: True, False if unsure,
    or LATER.

    A path to ``task`` ends either with a key that ``task``, or a task awaiting it, holds,
    or with waits only, from a holder awaiting it. So when neither ``task`` nor anything
    that awaits it (directly or through asyncio helpers, followed backwards through done
    callbacks) holds a key or is a holder, there is no path, however long the chain of
    holders is. Holding is read conservatively: any keyserial turn or registration on a
    task's await chain (but the one registering now), an open lock block, an await chain
    that cannot be read to its end, or a task in the middle of a step all count as "might
    hold". ``running``: ``task`` is the task registering now, else it is suspended in its
    registration.
    """
    if running:
        own = _stack_holds_nothing(task)
        if own is not True:
            return own
    elif not _suspended_holds_nothing(task, registering=True):
        return False
    targets = {id(holder) for holder in holders if holder is not None}
    seen = {id(task)}
    frontier = list(woken_by(task))
    while frontier:
        node = frontier.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if len(seen) > _BACKWARD_BUDGET or id(node) in targets:
            return False
        if is_task(node) and not _suspended_holds_nothing(node):
            return False
        if asyncio.isfuture(node):
            frontier.extend(woken_by(node))
    return True


def _stack_holds_nothing(task: Task) -> bool | str:
    """Whether the running ``task``, registering now, holds no key: True, False if unsure,
    or LATER if another task is in the middle of the step that started it."""
    if task in _block_holders:
        return False
    outermost = frame_of(task.get_coro())
    registrant_seen = False
    frame: FrameType | None = sys._getframe(1)  # pyright: ignore[reportPrivateUsage]
    while frame is not None:
        if id(frame.f_code) in _holding_codes:
            if registrant_seen:  # the innermost one is the call registering now
                return False
            registrant_seen = True
        if frame is outermost:
            break
        frame = frame.f_back
    if frame is None:
        return False  # the task's own frames are not where they should be: unsure
    # Below a task's frames there is only the loop, unless another task is in the middle
    # of a step that started this one eagerly: its waits are not settled yet. Where no task
    # starts eagerly, the loop's frames (each read makes a frame object) need not be read.
    if not may_start_eagerly(task.get_loop()):
        return True
    frame = frame.f_back
    while frame is not None:
        if frame.f_code.co_flags & _COROUTINE_FLAGS:
            return LATER
        frame = frame.f_back
    return True


def _suspended_holds_nothing(task: Task, registering: bool = False) -> bool:
    """Whether the suspended ``task`` holds no key (False if unsure); ``registering``: it
    waits in a registration of its own, which holds nothing yet."""
    if task.done():
        return True
    if task in _block_holders or is_running(task):
        return False
    allowed = 1 if registering else 0  # holding frames: only the innermost may register
    coro: Any = task.get_coro()
    for _ in range(MAX_DEPTH):
        frame = frame_of(coro)
        if frame is None:
            return False
        if id(frame.f_code) in _holding_codes:
            allowed -= 1
            if allowed < 0:
                return False
        inner = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        if inner is None:
            return True  # suspended at a bare yield: this is the whole chain
        if frame_of(inner) is None:
            # The chain ends awaiting a future; anything else (an async generator's
            # asend, a custom awaitable) may hide frames further in.
            waiter = fut_waiter(task)
            return waiter is not None and type(inner) is type(waiter.__await__())
        coro = inner
    return False


#: Nested any-of waits (``asyncio.wait(..., FIRST_COMPLETED)``) followed at most this deep.
_MAX_ANY_DEPTH = 4

#: Nodes the forward walk visits before the check tries `unreachable` instead. A node costs
#: a fraction of `unreachable`, so walking on rarely pays: a holder that leads nowhere is
#: answered here, anything longer goes backwards (a larger budget made registering behind a
#: long chain dearer; benchmarks: deadlock-chain).
_FORWARD_BUDGET = 1

#: Returned by `find_cycle` when a task on the way is in the middle of a step.
UNDECIDED = "undecided"
#: Returned by `find_cycle` when it visited its budget of nodes without an answer.
EXHAUSTED = "exhausted"

#: Code objects of keyserial's own coroutines that run a caller's function ``fn``; a task
#: running one is named after that function in messages.
_entry_codes: set[Any] = set()


def register_entry_code(code: Any) -> None:
    """Name tasks whose coroutine runs ``code`` after the ``fn`` it calls."""
    _entry_codes.add(code)
    register_holding_code(code)


Label = tuple[str, Any]  # ("key", key) or ("await", how), or ("", None) for no label

#: The last holder found blocked on a future that leads nowhere, and that future. A task
#: blocked on the same pending future has not resumed since, so its waits are unchanged.
_dead_end: tuple[weakref.ref[Any], weakref.ref[Any]] | None = None


def _is_known_dead_end(task: Any) -> bool:
    known = _dead_end
    if known is None or known[0]() is not task:
        return False
    awaited = fut_waiter(task)
    return awaited is not None and known[1]() is awaited


def _remember_dead_end(task: Any, awaited: Any) -> None:
    global _dead_end
    with contextlib.suppress(TypeError):  # a type without weak references: not remembered
        _dead_end = (weakref.ref(task), weakref.ref(awaited))


class _Search:
    """A depth-first search for a path of waits from some task to ``target``."""

    def __init__(self, target: Task, depth: int = 0, budget: int | None = None) -> None:
        self.target = target
        self.depth = depth
        self.undecided = False
        self.budget = budget  # nodes still to visit; None: no bound
        self.exhausted = False

    def path(self, start: Any) -> list[tuple[Any, Label]] | None:
        """``[(node, label of the edge into it), ...]`` from ``start`` to the target, or None."""
        parents: dict[int, tuple[Any, Any, Label]] = {id(start): (start, None, ("", None))}
        stack = [start]
        while stack:
            if self.budget is not None:
                if self.budget <= 0:
                    self.exhausted = True
                    return None
                self.budget -= 1
            node = stack.pop()
            if node is self.target:
                steps: list[tuple[Any, Label]] = []
                current: Any = node
                while current is not None:
                    here, previous, label = parents[id(current)]
                    steps.append((here, label))
                    current = previous
                steps.reverse()
                return steps
            for child, label in self._edges(node):
                if id(child) not in parents:
                    parents[id(child)] = (child, node, label)
                    stack.append(child)
        return None

    def _edges(self, node: Any) -> list[tuple[Any, Label]]:
        if asyncio.isfuture(node) and node.done():
            return []
        if type(node) is TurnWait:
            return _key_edges(node.share, node.keys)
        wait: WaitsOn | None
        if is_task(node):
            turn = turn_wait_of_task(node)
            if turn is not None:
                # A node of its own, as a waiter is: the walk's budget counts it.
                return [(turn, ("", None))]
            if _is_known_dead_end(node):
                return []
            awaited = fut_waiter(node)
            wait = waits_of_task(node)
            if wait is None and awaited is not None:
                _remember_dead_end(node, awaited)
            elif wait is None and node is not self.target and is_running(node):
                self.undecided = True
        else:
            wait = waits_of_future(node)
        if wait is None:
            return []
        return self._follow(wait)

    def _follow(self, wait: WaitsOn) -> list[tuple[Any, Label]]:
        label: Label = ("await", wait.via)
        if wait.every:
            return [(item, label) for item in wait.on]
        pending = [item for item in wait.on if not (hasattr(item, "done") and item.done())]
        if not pending or self.depth >= _MAX_ANY_DEPTH:
            return []
        for item in pending:
            search = _Search(self.target, self.depth + 1, self.budget)
            found = search.path(item) is not None
            self.undecided |= search.undecided
            if search.budget is not None:
                self.budget = search.budget
            if search.exhausted:
                self.exhausted = True
                return []
            if not found:
                return []
        return [(pending[0], label)]


def _key_edges(share: KeyHolders, keys: Sequence[Hashable]) -> list[tuple[Any, Label]]:
    """A call waiting for keys waits for their holders."""
    edges: list[tuple[Any, Label]] = []
    for key in keys:
        holder = share.holding_task(key)
        if holder is not None:
            edges.append((holder, ("key", key)))
    return edges


def find_cycle(
    share: KeyHolders, task: Task, keys: Sequence[Hashable], budget: int | None = None
) -> DeadlockError | str | None:
    """The cycle ``task`` would close by waiting for ``keys``: an error, UNDECIDED, None,
    or EXHAUSTED when ``budget`` nodes were visited without an answer."""
    search = _Search(task, budget=budget)
    for key in keys:
        holder = share.holding_task(key)
        if holder is None:
            continue
        steps = search.path(holder)
        if steps is not None:
            return _describe(task, key, steps)
        if search.exhausted:
            return EXHAUSTED
    return UNDECIDED if search.undecided else None


def may_wait_on_someone(holder: Task) -> bool:
    """Whether ``holder`` is blocked or mid-step; a holder that is neither closes no cycle."""
    return fut_waiter(holder) is not None or is_running(holder)


def check_no_cycle(share: KeyHolders, task: Task, keys: Sequence[Hashable]) -> bool:
    """Raise DeadlockError if ``task`` waiting for ``keys`` would wait on itself.

    Returns True if the answer must wait until the tasks mid-step have suspended (then
    the caller re-checks with `check_later`).
    """
    holders = [share.holding_task(key) for key in keys]
    if not any(
        h is not None and h is not task and may_wait_on_someone(h) and not _is_known_dead_end(h)
        for h in holders
    ):
        return False
    if any(h is not None and turn_wait_of_task(h) is not None for h in holders):
        # A holder waiting for a turn spends the forward walk's budget on itself: the walk
        # could only come back exhausted, so the backward question is asked at once.
        found: DeadlockError | str | None = EXHAUSTED
    else:
        found = find_cycle(share, task, keys, _FORWARD_BUDGET)
    if found == EXHAUSTED:
        answer = unreachable(task, holders, running=True)
        if answer is True:
            return False
        if answer == LATER:
            return True
        found = find_cycle(share, task, keys)
    if isinstance(found, DeadlockError):
        raise found
    return found == UNDECIDED


def check_later(
    share: KeyHolders,
    task: Task,
    keys: Sequence[Hashable],
    waiting: asyncio.Future[Any],
    fail: Callable[[DeadlockError], None],
) -> None:
    """Check again on the next loop iteration, and ``fail`` the wait if it closes a cycle.

    By then every task that was mid-step has finished that step and is blocked where it
    will stay, so the answer is final.
    """

    def recheck() -> None:
        if waiting.done():
            return
        found = find_cycle(share, task, keys, _FORWARD_BUDGET)
        if found == EXHAUSTED:
            holders = [share.holding_task(key) for key in keys]
            if unreachable(task, holders, running=False) is True:
                return
            found = find_cycle(share, task, keys)
        if isinstance(found, DeadlockError):
            fail(found)

    waiting.get_loop().call_soon(recheck)


def describe_task(task: Task) -> str:
    """``function (task 'name')``: what the task runs, by the function the caller wrote."""
    return f"{_function_of(task)} (task {task.get_name()!r})"


def _function_of(task: Task) -> str:
    """The function the task runs now: that of its innermost turn, else its coroutine's."""
    chain = list(coroutine_chain(task))
    for coro in reversed(chain):
        frame = frame_of(coro)
        if frame is not None and frame.f_code in _entry_codes:
            name = getattr(frame.f_locals.get("fn"), "__qualname__", None)
            if isinstance(name, str):
                return name
    return str(getattr(chain[0], "__qualname__", type(chain[0]).__name__)) if chain else "?"


def _describe(task: Task, key: Hashable, steps: list[tuple[Any, Label]]) -> DeadlockError:
    """Name the cycle: ``task`` waits for ``key``, whose holder is ``steps[0]``, back to ``task``.

    Futures between two tasks (a gather's, a shield's, a key's waiter) are folded into the
    edge that crosses them.
    """
    tasks: list[Task] = [task]
    keys: list[Hashable] = [key]
    edges: list[str] = []
    source: Task = task
    edge: Label = ("key", key)
    for node, label in steps:
        if label[0] == "key" or (label[0] == "await" and edge[0] != "key"):
            edge = label
        if not is_task(node):
            continue
        if edge[0] == "key":
            if node is not steps[0][0]:
                keys.append(edge[1])
            text = f"waits for key {edge[1]!r} held by"
        else:
            text = "awaits" if edge[1] in (None, "awaits") else f"awaits, through {edge[1]},"
        edges.append(f"{describe_task(source)} {text} {describe_task(node)}")
        if node is not task:
            tasks.append(node)
        source, edge = node, ("", None)
    return DeadlockError("deadlock: " + "; ".join(edges), keys=keys, tasks=tasks)
