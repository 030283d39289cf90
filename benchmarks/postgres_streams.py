"""Keyed stream consumers on PostgreSQL against what a user would write instead, in one run.

    python -m benchmarks.postgres_streams            # full sizes
    python -m benchmarks.postgres_streams --quick    # tiny sizes, for CI smoke runs

Every consumer drains the same backlog (16 keys, messages numbered per key) in one process,
and every handler does one write (an ``effects`` row) and ``await asyncio.sleep(0.005)``:

* keyserial's ``KeyedStream`` on PostgreSQL: the write commits with the acknowledgement;
* the ``FOR UPDATE SKIP LOCKED`` recipe: workers, each on a connection of its own, take the
  oldest unlocked job of one ``jobs`` table in a transaction, write, delete it, commit (fast,
  and its writes commit with the job's removal, but jobs of one key run concurrently);
* the same recipe as job-queue libraries run long jobs: a job is claimed in a short
  transaction (``locked_until`` a visibility timeout ahead), handled, then deleted, so that no
  transaction stays open while a handler runs; a claim past its timeout is taken again;
* a sequential consumer: one job at a time, in order.

Measured: messages per second (from the consumer's start until every effect committed), the
per-key order violations (an effect committed after an effect of a later message of its key),
and duplicate effects after the consumer process is SIGKILLed halfway and started again.
The recipes get as many connections as keyserial uses in all: its pool's, and the two it
keeps of its own (the listener, and the one for reads and lease renewals).

Uses the PostgreSQL at KEYSERIAL_TEST_POSTGRES (by default the local one), in a database of
its own that it drops afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg_pool import AsyncConnectionPool

from keyserial.postgres import connection
from keyserial.streams import KeyedStream, StreamMessage

from .report import environment

KEYS = 16
HANDLER_AWAIT = 0.005
CONNECTIONS = 16
#: keyserial's consumer's connections beside its pool: the listener, and the one for reads
#: and lease renewals.
OWN_CONNECTIONS = 2
#: The recipes' connections: as many as keyserial uses in all.
RECIPE_CONNECTIONS = CONNECTIONS + OWN_CONNECTIONS
PARTITIONS = 16
STREAM = "bench"
#: The claim recipe's visibility timeout: a claim older than this is taken again.
VISIBILITY = 1.0
DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
ROOT = Path(__file__).resolve().parent.parent
CONSUMERS = (
    "keyserial KeyedStream",
    "keyserial, max_in_flight=100",
    "SKIP LOCKED recipe",
    "claim, then ack recipe",
    "sequential",
)
SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id bigserial PRIMARY KEY, key text NOT NULL, seq int NOT NULL,
    locked_until timestamptz NOT NULL DEFAULT '-infinity'
);
CREATE TABLE IF NOT EXISTS effects (key text NOT NULL, seq int NOT NULL, at bigserial);
"""

#: A consumer: drains the backlog on the database at the DSN, returns when told to stop.
Consume = Callable[[str, asyncio.Event], Coroutine[Any, Any, None]]


async def write_effect(conn: psycopg.AsyncConnection[Any], key: str, seq: int) -> None:
    await conn.execute("INSERT INTO effects (key, seq) VALUES (%s, %s)", (key, seq))
    await asyncio.sleep(HANDLER_AWAIT)


# -- the consumers ----------------------------------------------------------------------------


async def keyserial_consumer(dsn: str, stop: asyncio.Event, max_in_flight: int = 1000) -> None:
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        dsn, min_size=CONNECTIONS, max_size=CONNECTIONS, open=False
    )
    await pool.open(wait=True)
    stream = KeyedStream(pool, STREAM, PARTITIONS, lease=2.0)

    @stream.consumer(max_in_flight=max_in_flight)
    async def handle(message: StreamMessage) -> None:
        await write_effect(connection(), str(message.key), int(message.fields["seq"]))

    running = asyncio.create_task(stream.run())
    await stop.wait()
    await stream.stop()
    await running
    await stream.aclose()
    await pool.close()


async def keyserial_consumer_100(dsn: str, stop: asyncio.Event) -> None:
    await keyserial_consumer(dsn, stop, max_in_flight=100)


async def _skip_locked_worker(conn: psycopg.AsyncConnection[Any], stop: asyncio.Event) -> None:
    while not stop.is_set():
        async with conn.transaction():
            found = await conn.execute(
                "SELECT id, key, seq FROM jobs ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED"
            )
            row = await found.fetchone()
            if row is not None:
                await write_effect(conn, row[1], row[2])
                await conn.execute("DELETE FROM jobs WHERE id = %s", (row[0],))
        if row is None:
            await asyncio.sleep(0.01)


async def _claim_worker(conn: psycopg.AsyncConnection[Any], stop: asyncio.Event) -> None:
    while not stop.is_set():
        found = await conn.execute(
            "UPDATE jobs SET locked_until = clock_timestamp() + %s * interval '1 second' "
            "WHERE id = (SELECT id FROM jobs WHERE locked_until < clock_timestamp() "
            "ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED) RETURNING id, key, seq",
            (VISIBILITY,),
        )
        row = await found.fetchone()
        await conn.commit()
        if row is None:
            await asyncio.sleep(0.01)
            continue
        # No transaction stays open while the job runs: its write commits on its own.
        await conn.execute("INSERT INTO effects (key, seq) VALUES (%s, %s)", (row[1], row[2]))
        await conn.commit()
        await asyncio.sleep(HANDLER_AWAIT)
        await conn.execute("DELETE FROM jobs WHERE id = %s", (row[0],))
        await conn.commit()


async def _workers(
    dsn: str, stop: asyncio.Event, count: int, work: Callable[..., Awaitable[None]]
) -> None:
    conns = [await psycopg.AsyncConnection.connect(dsn) for _ in range(count)]
    try:
        await asyncio.gather(*(work(conn, stop) for conn in conns))
    finally:
        for conn in conns:
            await conn.close()


async def skip_locked_consumer(dsn: str, stop: asyncio.Event) -> None:
    await _workers(dsn, stop, RECIPE_CONNECTIONS, _skip_locked_worker)


async def claim_consumer(dsn: str, stop: asyncio.Event) -> None:
    await _workers(dsn, stop, RECIPE_CONNECTIONS, _claim_worker)


async def sequential_consumer(dsn: str, stop: asyncio.Event) -> None:
    await _workers(dsn, stop, 1, _skip_locked_worker)


CONSUME: dict[str, Consume] = dict(
    zip(
        CONSUMERS,
        (
            keyserial_consumer,
            keyserial_consumer_100,
            skip_locked_consumer,
            claim_consumer,
            sequential_consumer,
        ),
        strict=True,
    )
)


# -- the runs ---------------------------------------------------------------------------------


def backlog(messages: int) -> list[tuple[str, int]]:
    """``(key, seq)`` of each message in publication order: every key gets the same number
    of messages, in an order shuffled the same way every run, each key's numbered from 0."""
    keys = [n % KEYS for n in range(messages)]
    random.Random(1).shuffle(keys)
    counts = [0] * KEYS
    found: list[tuple[str, int]] = []
    for key in keys:
        found.append((f"k{key}", counts[key]))
        counts[key] += 1
    return found


def prepare(dsn: str, consumer: str, messages: int) -> None:
    """Empty the tables, then publish the backlog the way ``consumer`` reads it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)
        conn.execute("TRUNCATE jobs, effects")
        conn.execute(
            "DO $$ BEGIN IF to_regclass('keyserial_stream_messages') IS NOT NULL THEN "
            "TRUNCATE keyserial_stream_messages, keyserial_stream_dead; END IF; END $$"
        )
        if not consumer.startswith("keyserial"):
            with conn.cursor() as cursor:
                cursor.executemany("INSERT INTO jobs (key, seq) VALUES (%s, %s)", backlog(messages))
            return
    asyncio.run(_publish(dsn, messages))


async def _publish(dsn: str, messages: int) -> None:
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(dsn, max_size=4, open=False)
    await pool.open(wait=True)
    stream = KeyedStream(pool, STREAM, PARTITIONS)
    for key, seq in backlog(messages):
        await stream.publish(key, {"seq": seq})
    await pool.close()


def effects(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM effects").fetchone()
        return int(row[0]) if row else 0


def order_violations_and_duplicates(dsn: str) -> tuple[int, int]:
    """Effects committed after an effect of a later message of their key; effects beyond one."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT key, seq FROM effects ORDER BY at").fetchall()
    latest: dict[str, int] = {}
    seen: set[tuple[str, int]] = set()
    violations = duplicates = 0
    for key, seq in rows:
        if (key, seq) in seen:
            duplicates += 1
        seen.add((key, seq))
        if seq < latest.get(key, -1):
            violations += 1
        latest[key] = max(seq, latest.get(key, -1))
    return violations, duplicates


async def _drain(dsn: str, consumer: str, messages: int) -> float:
    """Seconds from the consumer's start until ``messages`` effects committed."""
    stop = asyncio.Event()
    started = time.perf_counter()
    running = asyncio.create_task(CONSUME[consumer](dsn, stop))
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        while True:
            found = await conn.execute("SELECT count(*) FROM effects")
            row = await found.fetchone()
            if row is not None and row[0] >= messages:
                break
            if running.done():
                running.result()  # its error, if it failed
            await asyncio.sleep(0.005)
    elapsed = time.perf_counter() - started
    stop.set()
    await running
    return elapsed


def throughput(dsn: str, consumer: str, messages: int) -> tuple[float, int]:
    """Messages per second, and per-key order violations."""
    prepare(dsn, consumer, messages)
    seconds = asyncio.run(_drain(dsn, consumer, messages))
    violations, _ = order_violations_and_duplicates(dsn)
    return messages / seconds, violations


def duplicates_after_a_kill(dsn: str, consumer: str, messages: int) -> int:
    """Duplicate effects once the consumer process, SIGKILLed halfway, was started again."""
    prepare(dsn, consumer, messages)
    command = [sys.executable, "-m", "benchmarks.postgres_streams", "--consume", consumer, dsn]
    first = subprocess.Popen(command, cwd=ROOT)
    while effects(dsn) < messages // 2:
        time.sleep(0.01)
    first.send_signal(signal.SIGKILL)
    first.wait()
    second = subprocess.Popen(command, cwd=ROOT)
    deadline = time.monotonic() + 120
    while effects(dsn) < messages and time.monotonic() < deadline:
        time.sleep(0.05)
    # Whatever is still running may yet write a duplicate: give it a lease's time.
    time.sleep(3 * VISIBILITY)
    second.send_signal(signal.SIGTERM)
    second.wait(timeout=30)
    _, duplicates = order_violations_and_duplicates(dsn)
    return duplicates


def consume_until_terminated(consumer: str, dsn: str) -> None:
    async def consume() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await CONSUME[consumer](dsn, stop)

    asyncio.run(consume())


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.postgres_streams")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for CI smoke runs")
    parser.add_argument("--markdown", type=Path, help="also write the report to this file")
    parser.add_argument("--consume", nargs=2, metavar=("CONSUMER", "DSN"), help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.consume:
        consume_until_terminated(*options.consume)
        return 0
    messages, sequential_messages, repeats = (64, 16, 1) if options.quick else (3200, 200, 3)
    admin_dsn = os.environ.get("KEYSERIAL_TEST_POSTGRES", DEFAULT_DSN)
    name = f"keyserial_bench_{secrets.token_hex(4)}"
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = make_conninfo(admin_dsn, dbname=name)
    rates: dict[str, list[float]] = {consumer: [] for consumer in CONSUMERS}
    violations: dict[str, int] = dict.fromkeys(CONSUMERS, 0)
    duplicates: dict[str, int] = {}
    try:
        for _ in range(repeats):
            for consumer in CONSUMERS:
                size = sequential_messages if consumer == "sequential" else messages
                per_second, violated = throughput(dsn, consumer, size)
                rates[consumer].append(per_second)
                violations[consumer] += violated
        for consumer in (CONSUMERS[0], *CONSUMERS[2:4]):
            duplicates[consumer] = duplicates_after_a_kill(dsn, consumer, messages)
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
    rate = {consumer: statistics.median(values) for consumer, values in rates.items()}
    keyserial = rate[CONSUMERS[0]]
    rows = {
        "messages/s": {c: f"{rate[c]:,.0f}" for c in CONSUMERS},
        "keyserial ÷ this": {c: f"{keyserial / rate[c]:.2f}" for c in CONSUMERS},
        "per-key order violations": {c: f"{violations[c]:,}" for c in CONSUMERS},
        "duplicate effects after a SIGKILL": {
            c: f"{duplicates[c]:,}" if c in duplicates else "" for c in CONSUMERS
        },
        "connections": {
            CONSUMERS[0]: f"{CONNECTIONS} (pool) + {OWN_CONNECTIONS}",
            CONSUMERS[1]: f"{CONNECTIONS} (pool) + {OWN_CONNECTIONS}",
            CONSUMERS[2]: str(RECIPE_CONNECTIONS),
            CONSUMERS[3]: str(RECIPE_CONNECTIONS),
            CONSUMERS[4]: "1",
        },
    }
    lines = [
        f"Environment: {environment()}, PostgreSQL on loopback",
        "",
        f"Command: `python -m benchmarks.postgres_streams{' --quick' if options.quick else ''}`",
        "",
        f"### Keyed streams on PostgreSQL: {messages:,} messages over {KEYS} keys "
        f"({sequential_messages:,} for the sequential consumer), a write and a "
        f"{HANDLER_AWAIT * 1000:.0f} ms await per message, one process; median of {repeats}",
        "",
        "| | " + " | ".join(CONSUMERS) + " |",
        "|---|" + "---:|" * len(CONSUMERS),
        *(
            f"| {measure} | " + " | ".join(values[c] for c in CONSUMERS) + " |"
            for measure, values in rows.items()
        ),
    ]
    report = "\n".join(lines)
    print(report)
    if options.markdown:
        options.markdown.write_text(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
