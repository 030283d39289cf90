"""The PostgreSQL backend's promises under rollback: fences never repeat, no write is lost
in silence (against the real server)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from keyserial import current_fence
from keyserial.postgres import PostgresKeyedQueue, TurnRolledBack, connection

from .conftest import Pools
from .test_postgres_faults import holding

# Every test runs in the default mode and in fair mode (the postgres_mode fixture).
pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("postgres_mode")]


async def _segments(pool: AsyncConnectionPool[Any]) -> dict[str, str]:
    async with pool.connection() as conn:
        rows = await (await conn.execute("SELECT id, text FROM segment ORDER BY id")).fetchall()
    return {str(key): str(text) for key, text in rows}


async def test_fences_strictly_increase_after_raised_and_cancelled_turns(pools: Pools) -> None:
    queue = PostgresKeyedQueue(await pools(), namespace="fences")
    fences: list[int] = []
    hanging_started = asyncio.Event()

    async def take_fence(then: str) -> None:
        fences.append(current_fence())
        if then == "raise":
            raise ValueError("the turn fails")
        if then == "hang":
            hanging_started.set()
            await asyncio.sleep(60)

    await queue.run("k", take_fence, "return")
    with pytest.raises(ValueError, match="the turn fails"):
        await queue.run("k", take_fence, "raise")  # rolled back
    await queue.run("k", take_fence, "return")
    hanging = asyncio.create_task(queue.run("k", take_fence, "hang"))
    await asyncio.wait_for(hanging_started.wait(), timeout=10)
    hanging.cancel()  # rolled back
    with pytest.raises(asyncio.CancelledError):
        await hanging
    await queue.run("k", take_fence, "return")
    assert len(fences) == 5
    assert all(a < b for a, b in itertools.pairwise(fences)), fences  # never repeated


async def test_a_caught_database_error_fails_the_turn_instead_of_losing_its_writes(
    pools: Pools,
) -> None:
    pool = await pools()
    async with pool.connection() as conn:
        await conn.execute("CREATE TABLE segment (id text PRIMARY KEY, text text NOT NULL)")
    queue = PostgresKeyedQueue(pool, namespace="loss")

    async def save_twice(seg_id: str) -> str:
        await connection().execute("INSERT INTO segment VALUES (%s, 'first')", (seg_id,))
        # Caught: the transaction is aborted all the same.
        with contextlib.suppress(psycopg.errors.UniqueViolation):
            await connection().execute("INSERT INTO segment VALUES (%s, 'again')", (seg_id,))
        return "saved"

    with pytest.raises(TurnRolledBack, match="nothing of it was kept"):
        await queue.run("a", save_twice, "a")
    assert await _segments(pool) == {}

    async def nested_times_out(seg_id: str) -> str:
        await connection().execute("INSERT INTO segment VALUES (%s, 'outer')", (seg_id,))
        # The nested turn's lock wait fails inside the outer transaction.
        with contextlib.suppress(TimeoutError):
            await queue.with_options(timeout=0.2).run("held elsewhere", save_twice, "x")
        return "saved"

    other = PostgresKeyedQueue(await pools(), namespace="loss")  # another process's queue
    async with holding(other, "held elsewhere"):
        with pytest.raises(TurnRolledBack):
            await queue.run("b", nested_times_out, "b")
    assert await _segments(pool) == {}
    # The key is usable, and a turn that handles its error with a savepoint keeps its writes.

    async def save_with_savepoint(seg_id: str) -> str:
        await connection().execute("INSERT INTO segment VALUES (%s, 'first')", (seg_id,))
        with contextlib.suppress(psycopg.errors.UniqueViolation):
            async with connection().transaction():  # a savepoint: only it is rolled back
                await connection().execute("INSERT INTO segment VALUES (%s, 'again')", (seg_id,))
        return "saved"

    assert await queue.run("a", save_with_savepoint, "a") == "saved"
    assert await _segments(pool) == {"a": "first"}
    stats = pool.get_stats()
    assert stats["pool_size"] == stats["pool_available"]  # every connection went back
