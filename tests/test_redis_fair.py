"""Fair mode's own promises: a call's ticket goes to Redis when the call registers, keeps its
place while the call waits in its process, and leaves no gap when the call gives up."""

from __future__ import annotations

import asyncio

import pytest

from keyserial.redis import RedisKeyedQueue, encode_key
from keyserial.redis._names import base_name, encoded_namespace

from .redis_helpers import Clients, until

pytestmark = pytest.mark.asyncio


async def _tickets_waiting(queue: RedisKeyedQueue, client_of: Clients, key: str) -> int:
    """How many tickets wait in Redis's queue for ``key`` (the holder's is not among them)."""
    client = client_of()
    base = base_name(encoded_namespace("t"), encode_key(key))
    count = int(await client.llen(f"{base}:queue"))
    await client.aclose()
    return count


async def _until_waiting(queue: RedisKeyedQueue, clients: Clients, key: str, count: int) -> None:
    for _ in range(2000):
        if await _tickets_waiting(queue, clients, key) == count:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never {count} tickets waiting in Redis")


async def test_a_call_waiting_in_its_process_past_its_tickets_heartbeat_keeps_its_place(
    clients: Clients,
) -> None:
    lease = 0.3
    a = RedisKeyedQueue(clients(), namespace="t", lease=lease, fair=True)
    b = RedisKeyedQueue(clients(), namespace="t", lease=lease, fair=True)
    order: list[str] = []
    release = asyncio.Event()

    async def hold() -> None:
        order.append("hold")
        await release.wait()

    async def note(name: str) -> None:
        order.append(name)

    holder = asyncio.create_task(a.run("k", hold))
    await until(lambda: order == ["hold"], "the holder starts")
    second = asyncio.create_task(a.run("k", note, "a, made first"))  # waits in a's process
    await _until_waiting(a, clients, "k", 1)
    third = asyncio.create_task(b.run("k", note, "b, made later"))
    await _until_waiting(b, clients, "k", 2)
    # Past two leases, a ticket nobody polls is dead to Redis: the first waiter's is kept
    # alive for it while it waits behind the holder in its own process.
    await asyncio.sleep(4 * lease)
    release.set()
    await asyncio.gather(holder, second, third)
    assert order == ["hold", "a, made first", "b, made later"]
    await a.aclose()
    await b.aclose()


@pytest.mark.parametrize("how", ["cancelled", "timed out"])
async def test_a_call_that_gives_up_in_its_process_leaves_no_gap_in_redis(
    clients: Clients, how: str
) -> None:
    a = RedisKeyedQueue(clients(), namespace="t", lease=10.0, fair=True)
    b = RedisKeyedQueue(clients(), namespace="t", lease=10.0, fair=True)
    order: list[str] = []
    release = asyncio.Event()

    async def hold() -> None:
        order.append("hold")
        await release.wait()

    async def note(name: str) -> None:
        order.append(name)

    holder = asyncio.create_task(a.run("k", hold))
    await until(lambda: order == ["hold"], "the holder starts")
    if how == "cancelled":
        gives_up = asyncio.create_task(a.run("k", note, "gave up"))
    else:
        gives_up = asyncio.create_task(a.with_options(timeout=0.5).run("k", note, "gave up"))
    await _until_waiting(a, clients, "k", 1)
    later = asyncio.create_task(b.run("k", note, "b"))
    await _until_waiting(b, clients, "k", 2)
    if how == "cancelled":
        gives_up.cancel()
    with pytest.raises(asyncio.CancelledError if how == "cancelled" else TimeoutError):
        await gives_up
    await _until_waiting(a, clients, "k", 1)  # its ticket left Redis's queue
    release.set()
    # A ticket left behind would be granted and never taken up: the key would stall until
    # the lease (10 s) ran out.
    await asyncio.wait_for(asyncio.gather(holder, later), 5)
    assert order == ["hold", "b"]
    await a.aclose()
    await b.aclose()
