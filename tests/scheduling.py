"""Shared helpers: deterministic scheduling for concurrency tests."""

from __future__ import annotations

import asyncio


async def settle(rounds: int = 10) -> None:
    """Let every ready task run until it blocks again (a few loop iterations)."""
    for _ in range(rounds):
        await asyncio.sleep(0)
