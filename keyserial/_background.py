"""``Background``: tasks a backend starts on its own and must not lose.

A release sent after its caller went on, a fair-mode ticket or transaction given up, a
probe: each runs as a task of its own, kept here until it ends (the event loop keeps only a
weak reference to a task), its failure logged rather than lost. ``aclose()`` waits for those
of its loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

logger = logging.getLogger("keyserial")

Task = asyncio.Task[Any]


class Background:
    """Tasks started on their own, kept until they end; ``what`` names them in the log."""

    __slots__ = ("tasks", "what")

    def __init__(self, what: str) -> None:
        self.what = what
        self.tasks: set[Task] = set()

    def spawn(self, work: Coroutine[Any, Any, Any]) -> Task:
        """Run ``work`` on its own in the running loop; its failure is only logged."""
        task = asyncio.get_running_loop().create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            logger.debug("keyserial: %s failed: %r", self.what, error)

    async def wait(self, timeout: float) -> None:
        """Wait for those started in the running loop, at most ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        pending = [task for task in self.tasks if task.get_loop() is loop]
        if pending:
            await asyncio.wait(pending, timeout=timeout)
