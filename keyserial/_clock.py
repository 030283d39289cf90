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
    # Asked of the bound method, never of loop.__dict__: on CPython 3.11 and 3.12 reading an
    # object's __dict__ moves its attributes out of their inline storage for good, and every
    # attribute lookup on the loop after that (asyncio's call_soon, a Handle's get_debug)
    # takes the slow path, slowing every asyncio call on that loop.
    bound = loop.time
    if (
        getattr(bound, "__func__", None) is asyncio.BaseEventLoop.time
        and getattr(bound, "__self__", None) is loop
    ):
        return time.monotonic
    return bound
