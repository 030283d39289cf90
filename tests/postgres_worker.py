"""A separate process using a PostgresKeyedQueue, driven by the PostgreSQL tests.

python -m tests.postgres_worker DSN log SEED CALLS KEYS
    make CALLS calls over KEYS keys; in each turn append a row to ``history`` (the key's
    next sequence number, this process, the call, the fence, start and end times) and
    fold the call into ``state`` (state = state * 31 + call): all in the turn's transaction
python -m tests.postgres_worker DSN hold KEY LEASE
    take KEY's turn, write a "partial" row, print "holding", wait for a line on stdin,
    then write a "final" row and print "committed", or "failed: <error>" if that was refused
python -m tests.postgres_worker DSN hold-idle KEY LEASE
    the same, without the "partial" row: "holding" comes before the turn's first statement
python -m tests.postgres_worker DSN sleep KEY LEASE
    take KEY's turn, print "holding", and run ``SELECT pg_sleep(60)`` in it
python -m tests.postgres_worker DSN fault-load MODE POOL BURST LOG INDEX START
    the fault suite's worker (see tests/fault_load.py), MODE fair or default, POOL its pool's
    max_size, BURST the calls it makes at once on one key (1: one at a time)
python -m tests.postgres_worker DSN order MODE LOG OWNERS INDEX START SPACING TURN
    the cross-process order test's worker (see tests/fair_order.py), MODE fair or default
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time

from psycopg_pool import AsyncConnectionPool

from keyserial import LeaseLost
from keyserial.postgres import (
    CommitInDoubt,
    LeaseExpired,
    PostgresKeyedQueue,
    PostgresUnavailable,
    connection,
)

from . import fair_order, fault_load

SCHEMA = """
CREATE TABLE IF NOT EXISTS history (
    key text, seq int, pid int, call int, fence bigint, started bigint, ended bigint,
    PRIMARY KEY (key, seq)
);
CREATE TABLE IF NOT EXISTS state (key text PRIMARY KEY, value bigint NOT NULL);
CREATE TABLE IF NOT EXISTS writes (key text, stage text, pid int);
"""

#: Set by the tests' postgres_mode fixture: the queues of the fault modes run in fair mode.
FAIR = os.environ.get("KEYSERIAL_TEST_POSTGRES_FAIR") == "1"

MODULUS = 2**31 - 1  # state * 31 stays far inside bigint


def say(line: str) -> None:
    print(line, flush=True)


async def log_calls(dsn: str, seed: int, calls: int, keys: int) -> None:
    # A turn holds a connection, so at most this many keys run at once in one process;
    # the shared test server has other tests' connections to serve too.
    async with AsyncConnectionPool(dsn, min_size=1, max_size=min(keys, 6), open=False) as pool:
        queue = PostgresKeyedQueue(pool, namespace="multi", fair=FAIR)
        rng = random.Random(seed)
        pid = os.getpid()

        async def work(key: str, call: int, delay: float) -> None:
            from keyserial import current_fence

            conn = connection()
            started = time.monotonic_ns()
            cursor = await conn.execute(
                "SELECT coalesce(max(seq), 0) + 1 FROM history WHERE key = %s", (key,)
            )
            row = await cursor.fetchone()
            assert row is not None
            await asyncio.sleep(delay)
            await conn.execute(
                "INSERT INTO state VALUES (%s, %s) ON CONFLICT (key) DO UPDATE "
                "SET value = (state.value * 31 + %s) %% %s",
                (key, call, call, MODULUS),
            )
            await conn.execute(
                "INSERT INTO history VALUES (%s, %s, %s, %s, %s, %s, %s)",
                (key, row[0], pid, call, current_fence(), started, time.monotonic_ns()),
            )

        plan = [(f"key-{rng.randrange(keys)}", c, rng.uniform(0, 0.003)) for c in range(calls)]
        await asyncio.gather(*(queue.run(k, work, k, c, d) for k, c, d in plan))
        await queue.aclose()
    say("done")


async def hold(dsn: str, key: str, lease: float, mode: str = "hold") -> None:
    async with AsyncConnectionPool(dsn, min_size=1, max_size=2, open=False) as pool:
        queue = PostgresKeyedQueue(pool, namespace="faults", lease=lease, fair=FAIR)
        pid = os.getpid()

        async def turn() -> None:
            conn = connection()
            if mode == "stop-in-statement":  # the test stops this process during the sleep
                say("holding")
                await conn.execute("SELECT pg_sleep(1)")
                return
            if mode == "sleep":
                say("holding")
                await conn.execute("SELECT pg_sleep(60)")
            if mode == "hold":
                await conn.execute("INSERT INTO writes VALUES (%s, 'partial', %s)", (key, pid))
            say("holding")
            await asyncio.to_thread(sys.stdin.readline)
            await conn.execute("INSERT INTO writes VALUES (%s, 'final', %s)", (key, pid))

        try:
            await queue.run(key, turn)
        except Exception as exc:
            say(f"failed: {type(exc).__name__}")
            return
        say("committed")


async def order(dsn: str, fair: bool, arguments: list[str]) -> None:
    # A pool smaller than the calls this process has waiting at once: in fair mode they wait
    # with tickets, so the order holds whatever the pool's size.
    async with AsyncConnectionPool(dsn, min_size=1, max_size=3, open=False) as pool:
        queue = PostgresKeyedQueue(pool, namespace="order", lease=5.0, fair=fair)

        async def hold(seconds: float) -> None:
            await connection().execute("SELECT pg_sleep(%s)", (seconds,))

        await fair_order.make_calls(queue.run, arguments, hold)
        await queue.aclose()
    say("done")


async def fault_calls(
    dsn: str, fair: bool, size: int, burst: int, log: str, index: int, start: int
) -> None:
    async with AsyncConnectionPool(dsn, min_size=1, max_size=size, open=False) as pool:
        queue = PostgresKeyedQueue(pool, namespace="load", lease=fault_load.LEASE, fair=fair)
        await fault_load.make_calls(
            queue.run,
            PostgresUnavailable,
            log,
            index,
            start,
            (LeaseLost, LeaseExpired),
            (CommitInDoubt,),
            burst,
        )
        await queue.aclose()


def create_schema(dsn: str) -> None:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)


def main() -> None:
    dsn, mode, *rest = sys.argv[1:]
    if mode == "log":
        asyncio.run(log_calls(dsn, int(rest[0]), int(rest[1]), int(rest[2])))
    elif mode == "fault-load":
        fair, size, burst = rest[0] == "fair", int(rest[1]), int(rest[2])
        asyncio.run(fault_calls(dsn, fair, size, burst, rest[3], int(rest[4]), int(rest[5])))
    elif mode == "order":
        asyncio.run(order(dsn, rest[0] == "fair", rest[1:]))
    elif mode in ("hold", "hold-idle", "sleep", "stop-in-statement"):
        asyncio.run(hold(dsn, rest[0], float(rest[1]), mode))


if __name__ == "__main__":
    main()
