"""Deadlock detection: refuse a wait that would close a cycle of tasks waiting on each other.

A task about to wait for some keys closes a cycle if the holders of those keys, in the end,
wait for it. "Wait for" has two kinds of edges:

* a task waiting for a key waits for the key's holder (the queue's records: see "What a
  waiting call waits for");
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

The deadlock check reads no frame of keyserial's own: only asyncio's helpers are read off
their objects, in ``keyserial._asyncio_internals``.

What a waiting call waits for
-----------------------------

A waiting call's keys, share and registration time are records: ``keyserial._turns.WAITING``
holds them for the exact ``asyncio.Future`` a call without a timeout awaits (asyncio's C
task takes its fast path only for an exact future, which carries nothing), and every other
wait carries them itself as a ``Waiter`` (one with a timeout, one that ``submit`` registers
before its task exists, one for several keys). The check finds a blocked task's record
through the future it is parked on (``_fut_waiter``).

What cannot lead back to a task
-------------------------------

Showing, without walking a chain of holders, that no wait can lead back to a task.

The deadlock check walks forward from the holders a task is about to wait for, looking for
the task. Behind a long chain of blocked holders that walk is long, and every call queued
behind the chain would repeat it. The backward question is usually short instead: who could
a path end at? A path into a task ends either with a key it holds (or that a task awaiting
it holds), or with plain waits from a holder that awaits it. So if neither the task nor
anything awaiting it holds a key or is one of the holders, no path exists.

"Holds a key" must never be missed, so the answer is only ever "surely not" or "unsure":
a task holds a key if it has a turn record (``keyserial._turns.RUNNING``: every turn and
lock block records itself there), waits for a multi-key turn (which may hold some of its
keys already), or is in the middle of a step.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

from ._asyncio_internals import (
    WaitsOn,
    fut_waiter,
    is_running,
    is_task,
    tasks_mid_step,
    tasks_waiting_for,
    waits_of_future,
    waits_of_task,
    woken_by,
)
from ._errors import DeadlockError
from ._records import KeyHolders, MultiWaiter, TimedWaiter, Waiter
from ._turns import KEY, OWNER, SINCE, function_of, holds_any, wait_of


class TurnWait(NamedTuple):
    """What a blocked call waits for (a node of the deadlock check's walk, like a waiter)."""

    share: KeyHolders
    keys: tuple[Hashable, ...]
    since: float  # when the call registered, on the loop's clock


def turn_wait_of_task(task: asyncio.Task[Any]) -> TurnWait | None:
    """What ``task`` waits for, if it is blocked waiting for a turn; else None."""
    awaited: Any = fut_waiter(task)
    if awaited is None:
        return None
    record = wait_of(task, awaited)
    if record is not None:
        return TurnWait(record[OWNER], (record[KEY],), record[SINCE])
    return _carried_wait(awaited)


def _carried_wait(awaited: Any) -> TurnWait | None:
    """What a wait that says it itself (a ``Waiter``) waits for."""
    kind: object = awaited.__class__
    if kind is Waiter or kind is TimedWaiter:
        return TurnWait(awaited.share, (awaited.key,), awaited.since)
    if kind is MultiWaiter:
        return TurnWait(awaited.share, awaited.keys, awaited.since)
    return None


def waited_since(waiter: asyncio.Future[Any]) -> float | None:
    """When the call waiting on ``waiter`` registered; None if no record says so."""
    found = _carried_wait(waiter)
    if found is not None:
        return found.since
    for task in tasks_waiting_for(waiter):
        record = wait_of(task, waiter)
        if record is not None:
            return float(record[SINCE])
    return None


Task = asyncio.Task[Any]

#: Nodes `unreachable` visits before it gives up (and the forward walk runs in full).
_BACKWARD_BUDGET = 32

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
    if holds_any(task):
        return False  # the call registering now has no record yet: any record is another's
    return LATER if tasks_mid_step(task) else True


def _suspended_holds_nothing(task: Task, registering: bool = False) -> bool:
    """Whether the suspended ``task`` holds no key (False if unsure); ``registering``: it
    waits in a registration of its own, which holds nothing yet."""
    if task.done():
        return True
    if is_running(task) or holds_any(task):
        return False
    # A multi-key wait may hold some of its keys already.
    return registering or type(fut_waiter(task)) is not MultiWaiter


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
    share: KeyHolders,
    task: Task,
    keys: Sequence[Hashable],
    budget: int | None = None,
    fn: Any = None,
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
            return _describe(task, key, steps, fn)
        if search.exhausted:
            return EXHAUSTED
    return UNDECIDED if search.undecided else None


def may_wait_on_someone(holder: Task) -> bool:
    """Whether ``holder`` is blocked or mid-step; a holder that is neither closes no cycle."""
    return fut_waiter(holder) is not None or is_running(holder)


def check_no_cycle(share: KeyHolders, task: Task, keys: Sequence[Hashable], fn: Any = None) -> bool:
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
        found = find_cycle(share, task, keys, _FORWARD_BUDGET, fn)
    if found == EXHAUSTED:
        answer = unreachable(task, holders, running=True)
        if answer is True:
            return False
        if answer == LATER:
            return True
        found = find_cycle(share, task, keys, None, fn)
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


def describe_task(task: Task, fn: Any = None) -> str:
    """``function (task 'name')``: what the task runs, by the function the caller wrote
    (``fn``, where the caller knows it: a call registering now has no record yet)."""
    name = getattr(fn, "__qualname__", None)
    if not isinstance(name, str):
        name = _function_of(task)
    return f"{name} (task {task.get_name()!r})"


def _function_of(task: Task) -> str:
    """The function the task runs now (or waits to run): that of its innermost turn, else
    its coroutine's."""
    name = getattr(function_of(task), "__qualname__", None)
    if isinstance(name, str):
        return name
    coro = task.get_coro()
    return str(getattr(coro, "__qualname__", type(coro).__name__))


def _describe(
    task: Task, key: Hashable, steps: list[tuple[Any, Label]], fn: Any = None
) -> DeadlockError:
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
        named = (
            describe_task(source, fn if source is task else None),
            describe_task(node, fn if node is task else None),
        )
        edges.append(f"{named[0]} {text} {named[1]}")
        if node is not task:
            tasks.append(node)
        source, edge = node, ("", None)
    return DeadlockError("deadlock: " + "; ".join(edges), keys=keys, tasks=tasks)
