"""Shared helpers for deterministic concurrency tests: settling the loop, gated calls."""

from __future__ import annotations

import asyncio
from typing import Any

#: Loop steps a test may take to settle before the helper gives up (a task that never blocks).
MAX_STEPS = 10_000


def _blocked(task: asyncio.Task[Any]) -> bool:
    """Whether ``task`` waits on a future that is not done (it cannot run until woken)."""
    waiter = getattr(task, "_fut_waiter", None)
    return waiter is not None and not waiter.done()


async def settle() -> None:
    """Return once every other task is blocked, and stays so for a whole loop step.

    anyio's ``wait_all_tasks_blocked``, for asyncio: a test then sees the state the loop
    settles in, however many steps the code under test takes to get there. The extra step
    lets callbacks that are not tasks (done callbacks, ``call_soon``) run and wake someone.
    """
    me = asyncio.current_task()
    quiet = 0
    for _ in range(MAX_STEPS):
        await asyncio.sleep(0)
        if all(_blocked(task) for task in asyncio.all_tasks() if task is not me):
            quiet += 1
            if quiet == 2:
                return
        else:
            quiet = 0
    raise AssertionError(f"the loop did not settle within {MAX_STEPS} steps")


class Recorder:
    """Calls that log their start and end and block until released."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.gates: dict[str, asyncio.Event] = {}

    def gate(self, name: str) -> asyncio.Event:
        return self.gates.setdefault(name, asyncio.Event())

    async def step(self, name: str) -> str:
        self.log.append(f"start {name}")
        try:
            await self.gate(name).wait()
        finally:
            self.log.append(f"end {name}")
        return name
