"""``TurnNotes``: the order in which calls' functions started, and a holder that keeps its
turn until the test releases it (shared by the fair-mode tests of both backends)."""

from __future__ import annotations

import asyncio

from .redis_helpers import until


class TurnNotes:
    """Functions for turns that note their start: ``hold`` (as "hold", then waits for
    ``release``) and ``note(name)``; ``order`` lists the starts."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.release = asyncio.Event()

    async def hold(self) -> None:
        self.order.append("hold")
        await self.release.wait()

    async def note(self, name: str) -> None:
        self.order.append(name)

    async def until_holding(self) -> None:
        """Wait until the holder's function has started (and nothing else has)."""
        await until(lambda: self.order == ["hold"], "the holder starts")
