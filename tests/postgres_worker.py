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
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time

from psycopg_pool import AsyncConnectionPool

from keyserial.postgres import PostgresKeyedQueue, connection

SCHEMA = """
CREATE TABLE IF NOT EXISTS history (
    key text, seq int, pid int, call int, fence bigint, started bigint, ended bigint,
    PRIMARY KEY (key, seq)
);
CREATE TABLE IF NOT EXISTS state (key text PRIMARY KEY, value bigint NOT NULL);
CREATE TABLE IF NOT EXISTS writes (key text, stage text, pid int);
"""

MODULUS = 2**31 - 1  # state * 31 stays far inside bigint


def say(line: str) -> None:
    print(line, flush=True)


async def log_calls(dsn: str, seed: int, calls: int, keys: int) -> None:
    # A turn holds a connection, so at most this many keys run at once in one process;
    # the shared test server has other tests' connections to serve too.
    async with AsyncConnectionPool(dsn, min_size=1, max_size=min(keys, 6), open=False) as pool:
        queue = PostgresKeyedQueue(pool, namespace="multi")
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
        queue = PostgresKeyedQueue(pool, namespace="faults", lease=lease)
        pid = os.getpid()

        async def turn() -> None:
            conn = connection()
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


def create_schema(dsn: str) -> None:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)


def main() -> None:
    dsn, mode, *rest = sys.argv[1:]
    if mode == "log":
        asyncio.run(log_calls(dsn, int(rest[0]), int(rest[1]), int(rest[2])))
    elif mode in ("hold", "hold-idle", "sleep"):
        asyncio.run(hold(dsn, rest[0], float(rest[1]), mode))


if __name__ == "__main__":
    main()
