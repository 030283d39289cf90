"""A turn whose locks reach its call late: the call's loop was blocked (its process paused)
after the server granted them. The function never starts on a session the server may have
ended for idling: the call checks that its session is alive first, or, if the server ended
it, begins its turn again, with no error."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from keyserial import current_fence
from keyserial.postgres import PostgresKeyedQueue
from keyserial.postgres._turn import PgTurn

from .conftest import Pools
from .redis_helpers import until

pytestmark = pytest.mark.asyncio

LEASE = 0.3


@pytest.mark.parametrize("fair", [False, True], ids=["default", "fair"])
@pytest.mark.parametrize("pause", [3 * LEASE, LEASE / 2], ids=["past-the-lease", "within-it"])
async def test_locks_granted_before_a_pause_never_start_the_function_late(
    pools: Pools, fair: bool, pause: float
) -> None:
    a = PostgresKeyedQueue(await pools(), namespace="t", lease=LEASE, fair=fair)
    b = PostgresKeyedQueue(await pools(), namespace="t", lease=LEASE, fair=fair)
    release = asyncio.Event()
    fences: list[int | None] = []

    async def hold() -> None:
        fences.append(current_fence())
        await release.wait()

    async def note() -> float:
        fences.append(current_fence())
        return time.monotonic()

    # The waiter's process stops just as its locks are granted: the server's idle timer of
    # its transaction runs on meanwhile. (Fair mode begins a turn from its ticket.)
    begin = b._turns.early.begin if fair else b._turns.begin
    paused_until: list[float] = []

    async def paused_begin(*args: Any, **kwargs: Any) -> PgTurn:
        turn = await begin(*args, **kwargs)
        if not paused_until:
            paused_until.append(time.monotonic() + pause)
            time.sleep(pause)  # noqa: ASYNC251 (the process stops: its loop with it)
        return turn

    if fair:
        b._turns.early.begin = paused_begin
    else:
        b._turns.begin = paused_begin  # type: ignore[method-assign]
    holder = asyncio.create_task(a.run("k", hold))
    await until(lambda: len(fences) == 1, "the holder starts")
    waiter = asyncio.create_task(b.run("k", note))
    await until(lambda: b.stats().running == 1, "the waiter registers")
    await asyncio.sleep(LEASE / 2)  # its lock request reaches the server's queue
    release.set()
    started = await asyncio.wait_for(waiter, 10)  # no LeaseExpired: it never started late
    await holder
    assert paused_until and started >= paused_until[0]
    first, second = fences
    assert first is not None and second is not None and second > first
