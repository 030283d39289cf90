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
from .fair_lines import ticket_count, until_a_lock_wait_older_than, until_tickets
from .redis_helpers import until
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


async def test_a_commit_refused_by_a_deferred_constraint_keeps_nothing_and_the_key_moves_on(
    pools: Pools, postgres_mode: str
) -> None:
    # c0's writes break a deferred constraint: its COMMIT fails. In fair mode c0..c2 wait
    # with tickets registered together, so c0's commit would begin c1's turn in the same
    # round trip, after the COMMIT that fails. c0 gets the server's error and keeps nothing;
    # c1 and c2 still run, in order, and nothing is left behind.
    pool = await pools()
    async with pool.connection() as conn:
        await conn.execute(
            "CREATE TABLE segment (id text, text text NOT NULL, "
            "UNIQUE (id) DEFERRABLE INITIALLY DEFERRED)"
        )
    queue = PostgresKeyedQueue(pool, namespace="deferred")
    order: list[str] = []
    release = asyncio.Event()

    async def hold() -> None:
        order.append("hold")
        await release.wait()

    async def save(seg_id: str, text: str, times: int) -> None:
        order.append(text)
        for _ in range(times):
            await connection().execute("INSERT INTO segment VALUES (%s, %s)", (seg_id, text))

    holder = asyncio.create_task(queue.run("k", hold))
    await until(lambda: order == ["hold"], "the holder starts")
    saves = [("a", "twice", 2), ("b", "once", 1), ("c", "once more", 1)]
    calls = [asyncio.create_task(queue.run("k", save, *args)) for args in saves]
    if postgres_mode == "fair":
        await until_tickets(pool, 3)
    release.set()
    outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)
    await holder
    assert isinstance(outcomes[0], psycopg.errors.UniqueViolation), outcomes
    assert outcomes[1:] == [None, None]
    assert order == ["hold", "twice", "once", "once more"]
    assert await _segments(pool) == {"b": "once", "c": "once more"}
    await queue.aclose()
    stats = pool.get_stats()
    assert stats["pool_size"] == stats["pool_available"]  # every connection went back
    assert await ticket_count(pool) == 0


async def test_a_serialization_failure_reaches_the_caller_as_the_server_s_error(
    pools: Pools, postgres_mode: str
) -> None:
    # Two turns on different keys, serializable, each reads what the other writes (a write
    # skew), in this order: both read, doctor 1 writes, doctor 2 writes, doctor 1 commits,
    # doctor 2 commits. One of them fails with the server's SerializationFailure, which an
    # application retries as it would any such failure; it is not reported as an unreachable
    # server, and the key moves on. In the default mode it is doctor 2's COMMIT. In fair
    # mode the server may refuse doctor 1's write already: the direct turns' own read of
    # the ticket table takes part in the server's checks too.
    pool = await pools(kwargs={"options": "-c default_transaction_isolation=serializable"})
    async with pool.connection() as conn:
        await conn.execute("CREATE TABLE on_call (id int PRIMARY KEY, here boolean NOT NULL)")
        await conn.execute("INSERT INTO on_call VALUES (1, true), (2, true)")
        await conn.commit()
    queue = PostgresKeyedQueue(pool, namespace="serializable")
    steps = {name: asyncio.Event() for name in ("read 1", "read 2", "wrote 1", "wrote 2", "done 1")}

    async def leave(doctor: int, after_read: str, after_write: str) -> None:
        try:
            await connection().execute("SELECT count(*) FROM on_call WHERE here")
            steps[f"read {doctor}"].set()
            await steps[after_read].wait()
            await connection().execute("UPDATE on_call SET here = false WHERE id = %s", (doctor,))
        finally:  # refused, it lets the other go on
            steps[f"read {doctor}"].set()
            steps[f"wrote {doctor}"].set()
        await steps[after_write].wait()

    first = asyncio.create_task(queue.run("doctor 1", leave, 1, "read 2", "wrote 2"))
    await asyncio.wait_for(steps["read 1"].wait(), 10)
    second = asyncio.create_task(queue.run("doctor 2", leave, 2, "wrote 1", "done 1"))
    outcomes = [(await asyncio.gather(asyncio.wait_for(first, 10), return_exceptions=True))[0]]
    steps["done 1"].set()
    outcomes += await asyncio.gather(asyncio.wait_for(second, 10), return_exceptions=True)
    refused = [n for n, outcome in enumerate(outcomes, 1) if outcome is not None]
    assert len(refused) == 1, outcomes
    assert isinstance(outcomes[refused[0] - 1], psycopg.errors.SerializationFailure), outcomes
    if postgres_mode == "default":
        assert refused == [2]
    async with pool.connection() as conn:
        cursor = await conn.execute("SELECT id FROM on_call WHERE here ORDER BY id")
        assert await cursor.fetchall() == [(refused[0],)]  # its doctor stays on call
        await conn.commit()
    assert await queue.run(f"doctor {refused[0]}", asyncio.sleep, 0, "again") == "again"
    await queue.aclose()


async def test_a_wait_for_the_key_outlasts_the_connection_s_statement_timeout(
    pools: Pools,
) -> None:
    # The application's connections carry a statement_timeout, and a lock_timeout set on
    # the session; a call waits for its key for longer than the statement_timeout. Its wait
    # is bounded by the call's own timeout alone (none here), and its function's statements
    # run under the application's two timeouts again.
    async def configure(conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute("SET lock_timeout = '2s'")
        await conn.commit()

    pool = await pools(kwargs={"options": "-c statement_timeout=100ms"}, configure=configure)
    watcher = await pools(max_size=1)
    holding_queue = PostgresKeyedQueue(pool, namespace="bounded")
    waiting_queue = PostgresKeyedQueue(pool, namespace="bounded")  # another process's
    holding, release = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        holding.set()
        await release.wait()

    async def timeouts() -> tuple[str, str]:
        cursor = await connection().execute(
            "SELECT current_setting('statement_timeout'), current_setting('lock_timeout')"
        )
        row = await cursor.fetchone()
        assert row is not None
        return str(row[0]), str(row[1])

    holder = asyncio.create_task(holding_queue.run("k", hold))
    await asyncio.wait_for(holding.wait(), 10)
    waiter = asyncio.create_task(waiting_queue.run("k", timeouts))
    await until_a_lock_wait_older_than(watcher, 0.3)
    release.set()
    assert await asyncio.wait_for(waiter, 10) == ("100ms", "2s")
    await holder
    await holding_queue.aclose()
    await waiting_queue.aclose()
