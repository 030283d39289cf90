"""Transcript updates as a keyed stream on PostgreSQL: an outbox, two consumers, one killed.

A producer saves each segment's text and, in the same transaction, publishes an update
event for it (partial, revision, final): an event exists if and only if the save
committed. Two consumer processes apply the events to a ``segment_view`` table through
``keyserial.postgres.connection()``, so each event's write commits with its
acknowledgement. Halfway through, one consumer is killed (SIGKILL) with handlers running;
the other takes its partitions over within the lease.

At the end every segment's view is ``final`` and counts exactly three applied updates: no
event was applied twice (a killed handler's write rolled back with its transaction), none
was lost, and each segment's updates were applied in the order they were published.

Needs PostgreSQL (``--dsn``, by default the local server; the example's tables are dropped
afterwards) and the ``postgres`` extra: pip install ".[postgres]".

Run it:  python examples/postgres_stream.py [--segments 100] [--dsn postgresql://...]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import signal
import time
from typing import Any

import psycopg
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from keyserial.postgres import connection
from keyserial.streams import KeyedStream, StreamMessage

STAGES = ("partial", "revision", "final")
STREAM = "transcript-events"
TABLES = """
CREATE TABLE segment (id text PRIMARY KEY, text text NOT NULL);
CREATE TABLE segment_view (id text PRIMARY KEY, stage text NOT NULL, applied int NOT NULL);
"""


STREAM_TABLES = (
    "keyserial_stream_messages",
    "keyserial_stream_dead",
    "keyserial_stream_members",
    "keyserial_stream_partitions",
    "keyserial_streams",
)


async def produce(dsn: str, segments: int) -> None:
    """Save every segment's three updates, each with its event, in one transaction each."""
    async with AsyncConnectionPool(dsn, max_size=4) as pool:
        stream = KeyedStream(pool, STREAM, partitions=8, lease=1.0)
        for stage in STAGES:
            for n in range(segments):
                async with pool.connection() as conn, conn.transaction():
                    await conn.execute(
                        "INSERT INTO segment VALUES (%s, %s) "
                        "ON CONFLICT (id) DO UPDATE SET text = EXCLUDED.text",
                        (f"seg-{n}", f"{stage} text"),
                    )
                    await stream.publish(f"seg-{n}", {"stage": stage}, connection=conn)


async def consume(dsn: str) -> None:
    async with AsyncConnectionPool(dsn, max_size=10) as pool:
        stream = KeyedStream(pool, STREAM, partitions=8, lease=1.0)

        @stream.consumer(max_in_flight=100)
        async def apply(message: StreamMessage) -> None:
            stage = message.fields["stage"]
            await connection().execute(
                "INSERT INTO segment_view VALUES (%s, %s, 1) ON CONFLICT (id) DO UPDATE "
                "SET stage = EXCLUDED.stage, applied = segment_view.applied + 1",
                (message.key, stage),
            )
            await asyncio.sleep(0.02)  # other work, the transaction still open

        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stream.stop)
        await stream.run()
        await stream.aclose()


def consumer_process(dsn: str) -> None:
    asyncio.run(consume(dsn))


def applied(dsn: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT id, stage, applied FROM segment_view").fetchall()


def run(dsn: str, segments: int) -> dict[str, int]:
    """Produce, consume with two processes (one killed halfway); what the view holds."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(TABLES)
    try:
        asyncio.run(produce(dsn, segments))
        context = multiprocessing.get_context("spawn")
        consumers = [context.Process(target=consumer_process, args=(dsn,)) for _ in range(2)]
        for process in consumers:
            process.start()
        killed = False
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            rows = applied(dsn)
            done = sum(applied_count for _, _, applied_count in rows)
            if not killed and done >= segments * len(STAGES) // 2:
                os.kill(consumers[0].pid or 0, signal.SIGKILL)
                killed = True
            if len(rows) == segments and all(stage == "final" for _, stage, _ in rows):
                break
            time.sleep(0.05)
        time.sleep(1.0)  # anything still running would show as a fourth update
        for process in consumers[1:]:
            os.kill(process.pid or 0, signal.SIGTERM)
        for process in consumers:
            process.join(timeout=30)
        rows = applied(dsn)
        with psycopg.connect(dsn) as conn:
            left = conn.execute(
                "SELECT count(*) FROM keyserial_stream_messages WHERE stream = %s", (STREAM,)
            ).fetchone()
        return {
            "segments": len(rows),
            "final": sum(stage == "final" for _, stage, _ in rows),
            "applied three times": sum(count == 3 for _, _, count in rows),
            "unacknowledged": left[0] if left else -1,
        }
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("DROP TABLE IF EXISTS segment, segment_view")
            for table in STREAM_TABLES:  # the stream's rows, left by nothing but this example
                delete = sql.SQL("DELETE FROM {} WHERE stream = %s").format(sql.Identifier(table))
                conn.execute(delete, (STREAM,))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--segments", type=int, default=100)
    parser.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/postgres")
    args = parser.parse_args()
    for name, value in run(args.dsn, args.segments).items():
        print(f"{name:<20} {value}")


if __name__ == "__main__":
    main()
