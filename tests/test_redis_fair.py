"""Fair mode's own promises: a call's ticket goes to Redis when the call registers, keeps its
place while the call waits in its process, and leaves no gap when the call gives up."""

from __future__ import annotations

import asyncio

import pytest

from keyserial.redis import RedisKeyedQueue

from .redis_helpers import Clients, until_tickets_waiting
from .turn_notes import TurnNotes

pytestmark = pytest.mark.asyncio


async def test_a_call_waiting_in_its_process_past_its_tickets_heartbeat_keeps_its_place(
    clients: Clients,
) -> None:
    lease = 0.3
    watcher = clients()
    a = RedisKeyedQueue(clients(), namespace="t", lease=lease, fair=True)
    b = RedisKeyedQueue(clients(), namespace="t", lease=lease, fair=True)
    notes = TurnNotes()

    holder = asyncio.create_task(a.run("k", notes.hold))
    await notes.until_holding()
    second = asyncio.create_task(a.run("k", notes.note, "a, made first"))  # waits in a's process
    await until_tickets_waiting(watcher, "t", "k", 1)
    third = asyncio.create_task(b.run("k", notes.note, "b, made later"))
    await until_tickets_waiting(watcher, "t", "k", 2)
    # Past two leases, a ticket nobody polls is dead to Redis: the first waiter's is kept
    # alive for it while it waits behind the holder in its own process.
    await asyncio.sleep(4 * lease)
    notes.release.set()
    await asyncio.gather(holder, second, third)
    assert notes.order == ["hold", "a, made first", "b, made later"]
    await a.aclose()
    await b.aclose()


@pytest.mark.parametrize("how", ["cancelled", "timed out"])
async def test_a_call_that_gives_up_in_its_process_leaves_no_gap_in_redis(
    clients: Clients, how: str
) -> None:
    watcher = clients()
    a = RedisKeyedQueue(clients(), namespace="t", lease=10.0, fair=True)
    b = RedisKeyedQueue(clients(), namespace="t", lease=10.0, fair=True)
    notes = TurnNotes()

    holder = asyncio.create_task(a.run("k", notes.hold))
    await notes.until_holding()
    if how == "cancelled":
        gives_up = asyncio.create_task(a.run("k", notes.note, "gave up"))
    else:
        gives_up = asyncio.create_task(a.with_options(timeout=0.5).run("k", notes.note, "gave up"))
    await until_tickets_waiting(watcher, "t", "k", 1)
    later = asyncio.create_task(b.run("k", notes.note, "b"))
    await until_tickets_waiting(watcher, "t", "k", 2)
    if how == "cancelled":
        gives_up.cancel()
    with pytest.raises(asyncio.CancelledError if how == "cancelled" else TimeoutError):
        await gives_up
    await until_tickets_waiting(watcher, "t", "k", 1)  # its ticket left Redis's queue
    notes.release.set()
    # A ticket left behind would be granted and never taken up: the key would stall until
    # the lease (10 s) ran out.
    await asyncio.wait_for(asyncio.gather(holder, later), 5)
    assert notes.order == ["hold", "b"]
    await a.aclose()
    await b.aclose()
