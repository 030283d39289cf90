"""The PostgreSQL backend against a real server, in a database of each test's own."""

from __future__ import annotations

import asyncio
import math
import os
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from keyserial import DeadlockError, current_fence, serialized
from keyserial.postgres import PostgresKeyedQueue, PostgresUnavailable, connection, lock_id
from keyserial.postgres import _queue as postgres_queue

from .conftest import Pools
from .redis_helpers import until
from .scheduling import Recorder

# Every test runs in the default mode and in fair mode (the postgres_mode fixture).
pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("postgres_mode")]


async def _table(pool: AsyncConnectionPool[Any]) -> None:
    async with pool.connection() as conn:
        await conn.execute("CREATE TABLE IF NOT EXISTS segment (id text PRIMARY KEY, text text)")


async def _rows(pool: AsyncConnectionPool[Any]) -> dict[str, str]:
    async with pool.connection() as conn:
        cursor = await conn.execute("SELECT id, text FROM segment ORDER BY id")
        return {row[0]: row[1] for row in await cursor.fetchall()}


async def _waiting_locks(pool: AsyncConnectionPool[Any]) -> int:
    async with pool.connection() as conn:
        cursor = await conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
        row = await cursor.fetchone()
        assert row is not None
        return int(row[0])


async def test_same_key_across_queues_in_order_with_increasing_fences(pools: Pools) -> None:
    first = PostgresKeyedQueue(await pools(), namespace="t")
    second = PostgresKeyedQueue(await pools(), namespace="t")
    rec = Recorder()
    fences: dict[str, int] = {}
    admin = await pools()

    async def step(name: str) -> str:
        fences[name] = current_fence()
        return await rec.step(name)

    a = asyncio.create_task(first.run("seg", step, "a"))
    await until(lambda: rec.log == ["start a"], "a starts")
    b = asyncio.create_task(second.run("seg", step, "b"))
    for _ in range(200):  # b's wait reaches the server before c's
        if await _waiting_locks(admin) == 1:
            break
        await asyncio.sleep(0.01)
    c = asyncio.create_task(first.run("seg", step, "c"))
    other = asyncio.create_task(second.run("other", step, "other"))
    await until(lambda: "start other" in rec.log, "a different key runs at once")
    assert "start b" not in rec.log and "start c" not in rec.log
    for name in ("a", "b", "c", "other"):
        rec.gate(name).set()
    assert list(await asyncio.gather(a, b, c, other)) == ["a", "b", "c", "other"]
    starts = [line for line in rec.log if line.startswith("start") and line != "start other"]
    assert starts == ["start a", "start b", "start c"]
    assert fences["a"] < fences["b"] < fences["c"]
    assert fences["other"] > 0


async def test_writes_commit_with_the_turn_and_roll_back_when_it_fails(pools: Pools) -> None:
    pool = await pools()
    await _table(pool)
    queue = PostgresKeyedQueue(pool, namespace="t")

    @serialized(key="seg_id", queue=queue)
    async def save(seg_id: str, text: str, fail: bool = False) -> None:
        await connection().execute(
            "INSERT INTO segment VALUES (%s, %s) ON CONFLICT (id) DO UPDATE SET text = %s",
            (seg_id, text, text),
        )
        if fail:
            raise ValueError("after the write")

    await save("a", "kept")
    with pytest.raises(ValueError, match="after the write"):
        await save("b", "rolled back", fail=True)
    gate = asyncio.Event()

    async def cancelled() -> None:
        await connection().execute("INSERT INTO segment VALUES ('c', 'cancelled')")
        gate.set()
        await asyncio.sleep(60)

    task = asyncio.create_task(queue.run("c", cancelled))
    await asyncio.wait_for(gate.wait(), timeout=10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await _rows(pool) == {"a": "kept"}
    stats = pool.get_stats()
    assert stats["pool_size"] == stats["pool_available"]  # every connection went back


async def test_connection_outside_a_turn_and_in_helpers(pools: Pools) -> None:
    queue = PostgresKeyedQueue(await pools(), namespace="t")
    with pytest.raises(RuntimeError, match="inside a PostgresKeyedQueue turn"):
        connection()

    async def helper() -> object:
        return connection()

    async def turn() -> bool:
        mine = connection()
        (helpers,) = await asyncio.gather(helper())
        async with queue.lock("other"):  # nested: the same transaction, one more lock
            nested = connection()
        return mine is helpers is nested

    assert await queue.run("k", turn)


async def test_timeout_and_cancel_end_the_server_side_wait(pools: Pools) -> None:
    pool, admin = await pools(), await pools()
    holder_queue = PostgresKeyedQueue(await pools(), namespace="t")
    queue = PostgresKeyedQueue(pool, namespace="t")
    rec = Recorder()
    holder = asyncio.create_task(holder_queue.run("k", rec.step, "holder"))
    await until(lambda: rec.log == ["start holder"], "the holder runs")

    async def never() -> None:
        raise AssertionError("a call that timed out must not start")

    with pytest.raises(TimeoutError):
        await queue.with_options(timeout=0.3).run("k", never)
    assert await _waiting_locks(admin) == 0
    waiting = asyncio.create_task(queue.run("k", never))
    for _ in range(200):
        if await _waiting_locks(admin) == 1:
            break
        await asyncio.sleep(0.01)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert await _waiting_locks(admin) == 0
    stats = pool.get_stats()
    assert stats["pool_size"] == stats["pool_available"]  # back, and clean
    rec.gate("holder").set()
    await holder


async def test_several_keys_in_any_order_do_not_deadlock(pools: Pools) -> None:
    queue = PostgresKeyedQueue(await pools(), namespace="t")
    other = PostgresKeyedQueue(await pools(), namespace="t")
    ran: list[str] = []

    async def work(name: str) -> None:
        await asyncio.sleep(0.01)
        ran.append(name)

    await asyncio.wait_for(
        asyncio.gather(
            *(queue.run_all(["a", "b"], work, f"ab{i}") for i in range(5)),
            *(other.run_all(["b", "a"], work, f"ba{i}") for i in range(5)),
        ),
        timeout=30,
    )
    assert len(ran) == 10


async def test_a_cycle_across_processes_is_a_deadlock_error(pools: Pools) -> None:
    first = PostgresKeyedQueue(await pools(), namespace="t")
    second = PostgresKeyedQueue(await pools(), namespace="t")
    both = asyncio.Event()
    holding: list[str] = []

    async def nested(queue: PostgresKeyedQueue, mine: str, then: str) -> None:
        async def inner() -> None:
            return None

        async def outer() -> None:
            holding.append(mine)
            if len(holding) == 2:
                both.set()
            await both.wait()
            await queue.run(then, inner)  # the same transaction takes the second lock

        await queue.run(mine, outer)

    outcomes = await asyncio.wait_for(
        asyncio.gather(nested(first, "a", "b"), nested(second, "b", "a"), return_exceptions=True),
        timeout=30,
    )
    errors = [outcome for outcome in outcomes if outcome is not None]
    assert len(errors) == 1 and isinstance(errors[0], DeadlockError)
    assert isinstance(errors[0].__cause__, psycopg.errors.DeadlockDetected)


async def test_colliding_keys_serialize_with_each_other_only(
    pools: Pools, monkeypatch: pytest.MonkeyPatch
) -> None:
    def colliding(namespace: str, key: object) -> int:
        return 7 if key in ("x", "y") else lock_id(namespace, key)

    monkeypatch.setattr(postgres_queue, "lock_id", colliding)
    first = PostgresKeyedQueue(await pools(), namespace="t")
    second = PostgresKeyedQueue(await pools(), namespace="t")
    rec = Recorder()
    x = asyncio.create_task(first.run("x", rec.step, "x"))
    await until(lambda: rec.log == ["start x"], "x runs")
    y = asyncio.create_task(second.run("y", rec.step, "y"))
    z = asyncio.create_task(second.run("z", rec.step, "z"))
    await until(lambda: "start z" in rec.log, "z, which does not collide, runs at once")
    await asyncio.sleep(0.1)
    assert "start y" not in rec.log  # y shares x's lock id: it waits for x
    for name in "xyz":
        rec.gate(name).set()
    await asyncio.gather(x, y, z)
    assert rec.log.index("end x") < rec.log.index("start y")


async def test_bad_input(pools: Pools) -> None:
    pool = await pools()
    with pytest.raises(TypeError, match="AsyncConnectionPool"):
        PostgresKeyedQueue(object(), namespace="n")  # type: ignore[arg-type]

    class Pool:  # as asyncpg.create_pool() makes
        pass

    Pool.__module__ = "asyncpg.pool"
    with pytest.raises(TypeError, match=r"not asyncpg\.pool\..*Pool \(asyncpg is not supported"):
        PostgresKeyedQueue(Pool(), namespace="n")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="namespace must be a str"):
        PostgresKeyedQueue(pool, namespace=b"n")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="namespace"):
        PostgresKeyedQueue(pool, namespace="")
    for lease in (math.inf, math.nan, 0, 0.01):
        with pytest.raises(ValueError, match="lease"):
            PostgresKeyedQueue(pool, namespace="n", lease=lease)
    with pytest.raises(TypeError, match="fair must be True or False, not 1"):
        PostgresKeyedQueue(pool, namespace="n", fair=1)  # type: ignore[arg-type]
    queue = PostgresKeyedQueue(pool, namespace="n")

    async def work() -> None:
        return None

    with pytest.raises(TypeError, match="PostgresKeyedQueue keys must be str"):
        await queue.run(1.5, work)
    with pytest.raises(TypeError, match="coalesce=True needs an in-process KeyedSerialQueue"):
        serialized(coalesce=True, queue=queue)(work)


async def test_a_database_that_is_down_fails_calls_clearly() -> None:
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        "postgresql://postgres@127.0.0.1:1/postgres",
        open=False,
        min_size=0,
        max_size=1,
        timeout=0.5,
    )
    await pool.open(wait=False)
    queue = PostgresKeyedQueue(pool, namespace="n")

    async def work() -> None:
        raise AssertionError("must not run without its turn")

    with pytest.raises(PostgresUnavailable):
        await queue.run("k", work)
    await pool.close()


async def test_an_uncontended_call_takes_the_lock_and_begin_in_one_round_trip(
    pools: Pools, tmp_path: Any
) -> None:
    pool = await pools(min_size=1, max_size=1)
    queue = PostgresKeyedQueue(pool, namespace="t")

    async def work() -> None:
        await connection().execute("SELECT 1")

    await queue.run("warm-up", work)  # the fence table exists
    trace = tmp_path / "trace"
    with trace.open("w") as handle:
        async with pool.connection() as conn:
            conn.pgconn.trace(handle.fileno())
        await queue.run("k", work)
        async with pool.connection() as conn:
            conn.pgconn.untrace()
    sent = [line.split("\t")[3] for line in trace.read_text().splitlines() if "\tF\t" in line]
    waits = [message for message in sent if message in ("Sync", "Query")]
    # BEGIN + settings + lock + fence (one query), the function's statement, COMMIT.
    assert waits == ["Query", "Query", "Query"], sent


async def test_the_postgres_mode_fixture_makes_the_queues_it_promises(
    pools: Pools, postgres_mode: str
) -> None:
    queue = PostgresKeyedQueue(await pools(), namespace="t")
    assert queue.fair is (postgres_mode == "fair")
    assert (os.environ.get("KEYSERIAL_TEST_POSTGRES_FAIR") == "1") is (postgres_mode == "fair")


async def test_a_pool_that_is_not_open_gets_an_error_saying_to_open_it(postgres_dsn: str) -> None:
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(postgres_dsn, open=False)
    queue = PostgresKeyedQueue(pool, namespace="unopened")

    async def work() -> str:
        return "ran"

    with pytest.raises(RuntimeError, match=r"pool of the queue is not open.*await pool\.open\(\)"):
        await queue.run("k", work)
    assert queue.stats().waiting == 0  # nothing left waiting
    await pool.open()
    try:
        assert await queue.run("k", work) == "ran"  # the key was not left stuck
    finally:
        await pool.close()
    with pytest.raises(RuntimeError, match="not open"):
        await queue.run("k", work)  # closed again: the same clear error


async def test_a_table_name_postgresql_would_cut_is_refused_at_construction(pools: Pools) -> None:
    pool = await pools()
    longest = "t" * 59  # its sequence, t..._seq, is 63 bytes: what PostgreSQL keeps
    queue = PostgresKeyedQueue(pool, namespace="names", table=longest)

    async def work() -> int:
        return current_fence()

    assert await queue.run("k", work) >= 1
    for table in ("t" * 60, "é" * 30, ""):
        with pytest.raises(ValueError, match=r"table must be 1 to 59 bytes long.*63 bytes"):
            PostgresKeyedQueue(pool, namespace="names", table=table)
    with pytest.raises(ValueError, match="schema must be 1 to 63 bytes"):
        PostgresKeyedQueue(pool, namespace="names", schema="s" * 64)
    with pytest.raises(TypeError, match="table must be a str"):
        PostgresKeyedQueue(pool, namespace="names", table=b"fences")  # type: ignore[arg-type]
