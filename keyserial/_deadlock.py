"""Deadlock detection: refuse a wait that would close a cycle of tasks waiting on each other.

A task about to wait for some keys closes a cycle if the holders of those keys, in the end,
wait for it. "Wait for" has two kinds of edges:

* a task waiting for a key waits for the key's holder (the queue's records, and for a
  wait on a plain future the frame that awaits it: ``keyserial._waiting``);
* a task blocked in ``await`` waits for what it awaits — a task, or through ``gather``,
  ``TaskGroup``, ``wait``, ``shield`` or ``wait_for`` the tasks behind them
  (``keyserial._awaits`` reads those off asyncio's objects).

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
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from ._asyncio_internals import fut_waiter
from ._awaits import (
    Wait,
    coroutine_chain,
    frame_of,
    is_running,
    is_task,
    waits_of_future,
    waits_of_task,
)
from ._errors import DeadlockError
from ._reach import LATER, register_holding_code, unreachable
from ._records import KeyHolders
from ._waiting import TurnWait, turn_wait_of_task

Task = asyncio.Task[Any]

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
        wait: Wait | None
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

    def _follow(self, wait: Wait) -> list[tuple[Any, Label]]:
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
