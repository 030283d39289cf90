"""Deadlock detection: refuse a wait that would close a cycle of tasks waiting on each other.

The graph has two kinds of edges out of a task, both read from what the task
awaits (its ``_fut_waiter``): a queue waiter names the keys it waits for (each
leading to that key's holder), and a task is awaited directly (``await
child_task``). A task about to wait for
some keys closes a cycle if following those edges from the keys' holders leads
back to it. Only calls that must wait pay for the walk, and it visits only
tasks that are themselves blocked.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

from ._errors import DeadlockError

if TYPE_CHECKING:
    from ._state import Partition


Task = asyncio.Task[Any]


def _waits_on_something(part: Partition, holder: Task) -> bool:
    return bool(part.waiting_for(holder)) or isinstance(
        getattr(holder, "_fut_waiter", None), asyncio.Task
    )


def check_no_cycle(part: Partition, task: Task, keys: Sequence[Hashable]) -> None:
    """Raise DeadlockError if ``task`` waiting for ``keys`` would wait, in the end, on itself."""
    holders = [part.holding_task(key) for key in keys]
    # The common case: every holder is running, not waiting on anything; no walk needed.
    if not any(h is not None and _waits_on_something(part, h) for h in holders):
        return
    # Each visited task maps to (the task it was reached from, the key between them or None
    # for an awaited task), so that the cycle can be named.
    reached: dict[Task, tuple[Task | None, Hashable | None]] = {}
    frontier: list[tuple[Task | None, Task | None, Hashable | None]] = [
        (task, holder, key) for holder, key in zip(holders, keys, strict=True)
    ]
    while frontier:
        source, holder, key = frontier.pop()
        if holder is None or holder in reached:
            continue
        reached[holder] = (source, key)
        if holder is task:
            raise _describe(task, reached)
        for wanted in part.waiting_for(holder):
            frontier.append((holder, part.holding_task(wanted), wanted))
        awaited = getattr(holder, "_fut_waiter", None)
        if isinstance(awaited, asyncio.Task):
            frontier.append((holder, awaited, None))


def _describe(
    task: Task, reached: dict[Task, tuple[Task | None, Hashable | None]]
) -> DeadlockError:
    steps: list[tuple[Task, Hashable | None]] = []
    current: Task | None = task
    source, key = reached[task]
    # Walk back from the task to itself, collecting (waiting task, key) edges.
    while True:
        assert source is not None
        steps.append((source, key))
        if source is task:
            break
        current = source
        source, key = reached[current]
    steps.reverse()
    tasks = [waiter for waiter, _ in steps]
    keys = [key for _, key in steps if key is not None]
    parts = []
    for index, (waiter, edge_key) in enumerate(steps):
        target = tasks[(index + 1) % len(tasks)]
        if edge_key is None:
            parts.append(f"task {waiter.get_name()!r} awaits task {target.get_name()!r}")
        else:
            parts.append(
                f"task {waiter.get_name()!r} waits for key {edge_key!r} "
                f"held by task {target.get_name()!r}"
            )
    return DeadlockError("deadlock: " + "; ".join(parts), keys=keys, tasks=tasks)
