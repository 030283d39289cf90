"""The transcript pipeline against PostgreSQL, with four worker processes.

Each segment gets three updates — partial, revision, final — 100 ms apart, each sent to one
of four worker processes at random. A worker takes a while to process an update (the
partial longest), then writes it. Five ways to run the workers:

* ``unserialized``: a slow partial lands after the final: the segment ends stale;
* ``revision check``: the write is conditional (``WHERE revision < %s``): no stale rows,
  but every late write is refused after its work was done;
* ``@serialized``: ``PostgresKeyedQueue`` runs one update per segment at a time across
  the processes, and each write commits with its turn. In the default mode a call
  waiting behind another call of its own process reaches the database only when its
  turn in the process comes, so a later update sent to another process can overtake it:
  a few segments still end stale;
* ``@serialized, fair``: the same with ``fair=True``: every call waits in the database
  from when it is made (in the server's queue, or with a ticket), so the updates run in
  the order they were sent: no stale rows, nothing refused, no check needed (on a machine
  that schedules the workers on time: the order is the one the calls reached the server);
* ``@serialized + check``: the default mode with the check as belt and braces: no stale
  rows, and only the few overtaken writes refused.

Needs a PostgreSQL server (by default the local one; ``--dsn`` or KEYSERIAL_TEST_POSTGRES)
and the ``postgres`` extra: pip install ".[postgres]".

Run it:  python examples/postgres_transcripts.py [--segments 100]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import secrets
import time
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg_pool import AsyncConnectionPool

from keyserial import serialized
from keyserial.postgres import PostgresKeyedQueue, connection

STAGES = ("partial", "revision", "final")
MODES = (
    "unserialized",
    "revision check",
    "@serialized",
    "@serialized, fair",
    "@serialized + check",
)
WORKERS = 4

Update = tuple[str, int, str, float]  # segment, revision, stage, processing seconds


def updates(segments: int, seed: int) -> list[tuple[float, Update]]:
    """When each update is sent, and what it is: the stages of a segment 100 ms apart."""
    rng = random.Random(seed)
    plan: list[tuple[float, Update]] = []
    for n in range(segments):
        start = rng.uniform(0, 0.04 * segments)
        for revision, stage in enumerate(STAGES, 1):
            work = rng.uniform(0.2, 0.3) if stage == "partial" else rng.uniform(0, 0.01)
            plan.append((start + 0.1 * revision, (f"seg-{n:03d}", revision, stage, work)))
    return sorted(plan)


async def _work(dsn: str, mode: str, inbox: Any, ready: Any) -> None:
    # Enough connections for every segment busy in the process (each holds one while it waits
    # in the server): in the default mode a call waiting for a connection has not reached the
    # server's lock queue yet, and the order across processes is that queue's.
    async with AsyncConnectionPool(dsn, min_size=10, max_size=10, open=False) as pool:
        await pool.wait()  # every connection open before the first update arrives
        await asyncio.to_thread(ready.wait)
        queue = PostgresKeyedQueue(pool, namespace="transcripts", fair=mode.endswith("fair"))

        async def write(conn: psycopg.AsyncConnection[Any], update: Update) -> None:
            seg_id, revision, stage, _ = update
            if mode in ("revision check", "@serialized + check"):  # refuse an older revision
                query = (
                    "UPDATE segment SET stage = %s, revision = %s, writes = writes + 1 "
                    "WHERE id = %s AND revision < %s"
                )
            else:
                query = (
                    "UPDATE segment SET stage = %s, revision = %s, writes = writes + 1 "
                    "WHERE id = %s AND %s IS NOT NULL"
                )
            cursor = await conn.execute(query, (stage, revision, seg_id, revision))
            if cursor.rowcount == 0:
                await conn.execute(
                    "UPDATE segment SET refused = refused + 1 WHERE id = %s", (seg_id,)
                )

        @serialized(key="seg_id", queue=queue)
        async def in_turn(seg_id: str, update: Update) -> None:
            await asyncio.sleep(update[3])  # processing, inside the segment's turn
            await write(connection(), update)

        async def handle(update: Update) -> None:
            if mode.startswith("@serialized"):
                await in_turn(update[0], update)
                return
            await asyncio.sleep(update[3])
            async with pool.connection() as conn:
                await write(conn, update)

        # A thread reads the inbox and hands each update to the loop at once: the order in
        # which updates reach the database is the order they were sent, give or take the
        # processes' scheduling.
        loop = asyncio.get_running_loop()
        tasks: list[asyncio.Task[None]] = []
        finished = loop.create_future()

        def start(update: Update | None) -> None:
            if update is None:
                finished.set_result(None)
            else:
                tasks.append(loop.create_task(handle(update)))

        def read() -> None:
            while True:
                update = inbox.get()
                loop.call_soon_threadsafe(start, update)
                if update is None:
                    return

        reader = loop.run_in_executor(None, read)
        await finished
        await reader
        await asyncio.gather(*tasks)


def _worker(dsn: str, mode: str, inbox: Any, ready: Any) -> None:
    asyncio.run(_work(dsn, mode, inbox, ready))


def run(dsn: str, mode: str, segments: int, seed: int) -> dict[str, int]:
    """Send every update through four worker processes; count what the table ends with."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS segment")
        conn.execute(
            "CREATE TABLE segment (id text PRIMARY KEY, stage text, revision int NOT NULL, "
            "writes int NOT NULL DEFAULT 0, refused int NOT NULL DEFAULT 0)"
        )
        with conn.cursor() as cursor:
            cursor.executemany(
                "INSERT INTO segment (id, stage, revision) VALUES (%s, 'new', 0)",
                [(f"seg-{n:03d}",) for n in range(segments)],
            )
    context = multiprocessing.get_context("spawn")
    inboxes = [context.Queue() for _ in range(WORKERS)]
    ready = context.Barrier(WORKERS + 1)
    workers = [
        context.Process(target=_worker, args=(dsn, mode, inbox, ready), daemon=True)
        for inbox in inboxes
    ]
    for worker in workers:
        worker.start()
    ready.wait(timeout=60)  # every worker started and connected: the clock starts now
    rng = random.Random(seed)
    start = time.monotonic()
    for at, update in updates(segments, seed):
        time.sleep(max(0.0, start + at - time.monotonic()))
        rng.choice(inboxes).put(update)
    for inbox in inboxes:
        inbox.put(None)
    for worker in workers:
        worker.join(timeout=120)
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE stage <> 'final'), coalesce(sum(refused), 0) "
            "FROM segment"
        ).fetchone()
    assert row is not None
    return {"stale": int(row[0]), "refused": int(row[1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--segments", type=int, default=100)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--dsn",
        default=os.environ.get(
            "KEYSERIAL_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
    )
    options = parser.parse_args()
    name = f"keyserial_example_{secrets.token_hex(4)}"
    with psycopg.connect(options.dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        dsn = make_conninfo(options.dsn, dbname=name)
        print(f"{options.segments} segments, 3 updates each, {WORKERS} worker processes\n")
        print(f"{'mode':<22}{'stale at end':>14}{'writes refused':>16}")
        for mode in MODES:
            result = run(dsn, mode, options.segments, options.seed)
            print(f"{mode:<22}{result['stale']:>14}{result['refused']:>16}")
    finally:
        with psycopg.connect(options.dsn, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


if __name__ == "__main__":
    main()
