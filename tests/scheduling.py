"""Shared helpers for deterministic concurrency tests: settling the loop, gated calls."""

from __future__ import annotations

import asyncio


async def settle(rounds: int = 10) -> None:
    """Let every ready task run until it blocks again (a few loop iterations)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


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
