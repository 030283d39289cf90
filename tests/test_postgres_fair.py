"""Fair mode's own promises on PostgreSQL: every call's transaction waits in the server from
its registration, a process's requests reach the server's queue in its call order, and a
call that gives up leaves no wait and no transaction behind."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from psycopg_pool import AsyncConnectionPool

from keyserial.postgres import PostgresKeyedQueue, connection, lock_id

from .conftest import Pools
from .redis_helpers import until

pytestmark = pytest.mark.asyncio


async def _waiting_pids(pool: AsyncConnectionPool[Any], namespace: str, key: str) -> list[int]:
    """The backends waiting for ``key``'s lock, in the order the server queued them."""
    unsigned = lock_id(namespace, key) % (1 << 64)
    async with pool.connection() as conn:
        cursor = await conn.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND classid = %s AND objid = %s AND objsubid = 1"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            " ORDER BY waitstart",
            (unsigned >> 32, unsigned & 0xFFFFFFFF),
        )
        return [int(row[0]) for row in await cursor.fetchall()]


async def _until_waiting(pool: AsyncConnectionPool[Any], count: int) -> list[int]:
    for _ in range(1000):
        pids = await _waiting_pids(pool, "t", "k")
        if len(pids) == count:
            return pids
        await asyncio.sleep(0.005)
    raise AssertionError(f"never {count} calls waiting in the server")


@pytest.mark.xdist_group("postgres-connections")
async def test_every_waiting_call_waits_in_the_server_in_call_order(pools: Pools) -> None:
    burst = 16
    pool, other = await pools(min_size=burst + 1, max_size=burst + 1), await pools()
    queue = PostgresKeyedQueue(pool, namespace="t", fair=True)
    release = asyncio.Event()
    order: list[int] = []

    async def hold() -> None:
        await release.wait()

    async def note(call: int) -> int:
        order.append(call)
        return connection().info.backend_pid

    holder = asyncio.create_task(queue.run("k", hold))
    await until(lambda: queue.stats().running == 1, "the holder starts")
    # Made in one burst: each asks for the lock only once the one before is queued.
    calls = [asyncio.create_task(queue.run("k", note, call)) for call in range(burst)]
    queued = await _until_waiting(other, burst)
    release.set()
    await holder
    backends = await asyncio.wait_for(asyncio.gather(*calls), 10)
    assert order == list(range(burst))
    assert len(set(backends)) == burst, "each waiting call has a transaction of its own"
    assert queued == backends, "the server queued the calls' requests in call order"
    await queue.aclose()


@pytest.mark.parametrize("how", ["cancelled", "timed out"])
async def test_a_call_that_gives_up_in_its_process_leaves_no_gap_in_the_server(
    pools: Pools, how: str
) -> None:
    first, second, watcher = await pools(), await pools(), await pools()
    a = PostgresKeyedQueue(first, namespace="t", lease=10.0, fair=True)
    b = PostgresKeyedQueue(second, namespace="t", lease=10.0, fair=True)
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
    await _until_waiting(watcher, 1)
    later = asyncio.create_task(b.run("k", note, "b"))
    await _until_waiting(watcher, 2)
    if how == "cancelled":
        gives_up.cancel()
    with pytest.raises(asyncio.CancelledError if how == "cancelled" else TimeoutError):
        await gives_up
    await _until_waiting(watcher, 1)  # its wait left the server's queue
    release.set()
    # A transaction left behind would take the lock and sit on it until its lease (10 s).
    await asyncio.wait_for(asyncio.gather(holder, later), 5)
    assert order == ["hold", "b"]
    for pool in (first, second):
        stats = pool.get_stats()
        assert stats["pool_size"] == stats["pool_available"], "a connection was not given back"
    await a.aclose()
    await b.aclose()
