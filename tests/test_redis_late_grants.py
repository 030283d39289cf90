"""A grant that reaches its call late: the call's loop was blocked (its process paused) after
Redis granted the turn. The function never starts on a lease that may have run out: the call
renews the lease first, or, if it ran out, waits again at the head of the queue, with no error.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from keyserial import current_fence
from keyserial.redis import RedisKeyedQueue

from .redis_helpers import Clients, until, until_tickets_waiting

pytestmark = pytest.mark.asyncio

LEASE = 0.3


@pytest.mark.parametrize("fair", [False, True], ids=["default", "fair"])
@pytest.mark.parametrize("pause", [3 * LEASE, LEASE / 2], ids=["past-the-lease", "within-it"])
async def test_a_grant_that_arrives_after_a_pause_never_starts_the_function_late(
    clients: Clients, fair: bool, pause: float
) -> None:
    watcher = clients()
    a = RedisKeyedQueue(clients(), namespace="t", lease=LEASE, fair=fair)
    b = RedisKeyedQueue(clients(), namespace="t", lease=LEASE, fair=fair)
    release = asyncio.Event()
    fences: list[int | None] = []

    async def hold() -> None:
        fences.append(current_fence())
        await release.wait()

    async def note() -> float:
        fences.append(current_fence())
        return time.monotonic()

    holder = asyncio.create_task(a.run("k", hold))
    await until(lambda: len(fences) == 1, "the holder starts")
    waiter = asyncio.create_task(b.run("k", note))
    await until_tickets_waiting(watcher, "t", "k", 1)
    # The waiter's process stops just as the grant reaches it: the grant's lease runs on in
    # Redis meanwhile.
    listener = b._turns.listeners[asyncio.get_running_loop()]
    deliver = listener._deliver
    paused_until: list[float] = []

    def paused_deliver(message: bytes | str) -> None:
        if not paused_until:
            paused_until.append(time.monotonic() + pause)
            time.sleep(pause)
        deliver(message)

    listener._deliver = paused_deliver  # type: ignore[method-assign]
    release.set()
    started = await asyncio.wait_for(waiter, 10)  # no LeaseLost: it never started late
    await holder
    assert paused_until and started >= paused_until[0]
    first, second = fences
    assert first is not None and second is not None and second > first
    await a.aclose()
    await b.aclose()
