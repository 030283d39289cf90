"""An event loop with a fake clock: time passes only when every task waits for a timer.

``loop.time()`` reads a number the loop keeps. When nothing is ready to run, asyncio asks
its selector to wait until the next timer; this loop instead moves its clock to that
timer at once and lets it fire. So a test that sleeps an hour takes no time, timeouts and
durations come out exact, and nothing depends on how fast the machine is (trio's
``MockClock`` and aiolimiter's tests work the same way).
"""

from __future__ import annotations

import asyncio
import selectors
from typing import Any


class FakeClockLoop(asyncio.SelectorEventLoop):
    """A selector loop whose clock jumps to the next timer when the loop would block."""

    def __init__(self) -> None:
        super().__init__(selectors.DefaultSelector())
        self.now = 0.0
        selector: Any = getattr(self, "_selector")  # noqa: B009  # asyncio's, not public
        select: Any = getattr(selector, "select")  # noqa: B009

        def jump_to_next_timer(timeout: float | None = None) -> Any:
            if timeout is not None and timeout > 0:
                self.now += timeout  # nothing to do until then: let it be then
                return select(0)
            return select(timeout)

        selector.select = jump_to_next_timer

    def time(self) -> float:
        return self.now
