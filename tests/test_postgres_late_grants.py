"""A turn whose locks reach its call late: the call's loop was blocked (its process paused)
after the server granted them. The function never starts on a session the server may have
ended for idling: the call checks that its session is alive first, or, if the server ended
it, begins its turn again, with no error."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from keyserial import current_fence
from keyserial.postgres import PostgresKeyedQueue
from keyserial.postgres._turn import PgTurn

from .conftest import Pools
from .fair_lines import until_tickets, until_waiting_in_server
from .redis_helpers import until

pytestmark = pytest.mark.asyncio

LEASE = 0.3


@pytest.mark.parametrize("mode", ["default", "fair-direct", "fair-ticket"])
@pytest.mark.parametrize("pause", [3 * LEASE, LEASE / 2], ids=["past-the-lease", "within-it"])
async def test_locks_granted_before_a_pause_never_start_the_function_late(
    pools: Pools, mode: str, pause: float
) -> None:
    fair = mode != "default"
    watcher = await pools(max_size=1)
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
    # its transaction runs on meanwhile. In fair mode a process's only call on the key takes
    # its turn directly; a call that finds a ticket waiting begins its turn from a ticket.
    paused_until: list[float] = []

    def pausing(begin: Callable[..., Awaitable[PgTurn | None]]) -> Any:
        async def paused_begin(*args: Any, **kwargs: Any) -> PgTurn | None:
            turn = await begin(*args, **kwargs)
            if not paused_until:
                paused_until.append(time.monotonic() + pause)
                time.sleep(pause)  # noqa: ASYNC251 (the process stops: its loop with it)
            return turn

        return paused_begin

    if mode == "fair-ticket":
        b._turns.early.begin = pausing(b._turns.early.begin)
    elif mode == "fair-direct":
        b._turns.early.begin_direct = pausing(b._turns.early.begin_direct)
    else:
        b._turns.begin = pausing(b._turns.begin)  # type: ignore[method-assign]
    holder = asyncio.create_task(a.run("k", hold))
    await until(lambda: len(fences) == 1, "the holder starts")
    calls: list[asyncio.Task[Any]] = [holder]
    if mode == "fair-ticket":  # a's next call takes a ticket, and b's finds it
        calls.append(asyncio.create_task(a.run("k", note)))
        await until_tickets(watcher, 1)  # its ticket is registered: b's call will see it
    waiter = asyncio.create_task(b.run("k", note))
    # The waiter's transaction waits in the server's queue (in fair-ticket mode, behind a's
    # next call's).
    await until_waiting_in_server(watcher, 2 if mode == "fair-ticket" else 1)
    release.set()
    started = await asyncio.wait_for(waiter, 10)  # no LeaseExpired: it never started late
    await asyncio.gather(*calls)
    assert paused_until and started >= paused_until[0]
    assert len(fences) == len(calls) + 1
    fences = fences[len(calls) - 1 :]  # the holder's, or a's next call's; the waiter's
    first, second = fences
    assert first is not None and second is not None and second > first
