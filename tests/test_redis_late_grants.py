"""A grant that reaches its call late: the call's loop was blocked (its process paused) after
Redis granted the turn. The function never starts on a lease that may have run out: the call
renews the lease first, or, if it ran out, waits again at the head of the queue, with no error.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

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


@pytest.mark.parametrize("fair", [False, True], ids=["default", "fair"])
async def test_a_call_cancelled_while_it_confirms_a_late_grant_passes_the_turn_on(
    clients: Clients, fair: bool
) -> None:
    lease = 10.0  # a turn left behind would hold the key for this long
    watcher = clients()
    a = RedisKeyedQueue(clients(), namespace="t", lease=lease, fair=fair)
    b = RedisKeyedQueue(clients(), namespace="t", lease=lease, fair=fair)
    release = asyncio.Event()
    renewing = asyncio.Event()
    order: list[str] = []

    async def hold() -> None:
        order.append("a")
        await release.wait()

    async def note(name: str) -> None:
        order.append(name)

    wait_for_grant = b._turns.wait_for_grant

    async def late(*args: Any, **kwargs: Any) -> tuple[int, float] | None:
        granted = await wait_for_grant(*args, **kwargs)
        # As if the process had been paused since it last found its ticket waiting: the
        # grant has too little of its lease left to start on without renewing it.
        return None if granted is None else (granted[0], granted[1] - lease * 0.9)

    async def unanswered_renew(*args: Any) -> bool:
        renewing.set()
        await asyncio.Event().wait()  # Redis does not answer before the caller gives up
        return True

    b._turns.wait_for_grant = late  # type: ignore[method-assign]
    b._turns.renew = unanswered_renew  # type: ignore[method-assign,assignment]
    holder = asyncio.create_task(a.run("k", hold))
    await until(lambda: order == ["a"], "the holder starts")
    waiter = asyncio.create_task(b.run("k", note, "b"))
    await until_tickets_waiting(watcher, "t", "k", 1)
    release.set()
    await holder
    await asyncio.wait_for(renewing.wait(), 5)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    # The grant it held goes back at once, not when its lease runs out.
    await asyncio.wait_for(a.run("k", note, "a again"), 3)
    assert order == ["a", "a again"]
    await a.aclose()
    await b.aclose()
