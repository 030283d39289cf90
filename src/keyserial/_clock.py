"""Which clock a loop's share of a queue reads; it imports nothing of keyserial."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def loop_clock(loop: asyncio.AbstractEventLoop | None) -> Callable[[], float]:
    """``loop.time``, or the function it calls when that is asyncio's own: the hot paths read
    the clock on every hand-off, and the Python method around ``time.monotonic`` costs a
    frame each time. A loop whose ``time`` is its own (uvloop's, a test's fake clock) keeps it.
    """
    if loop is None:
        return time.monotonic
    if type(loop).time is asyncio.BaseEventLoop.time and "time" not in getattr(
        loop, "__dict__", {}
    ):
        return time.monotonic
    return loop.time
