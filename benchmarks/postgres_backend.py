"""The PostgreSQL backend against the hand-written recipes, in one run, on a private database.

    python -m benchmarks.postgres_backend            # full sizes
    python -m benchmarks.postgres_backend --quick    # tiny sizes, for CI smoke runs

Measures, side by side: uncontended latency (sequential calls on distinct keys, each
writing one row in its turn), round trips per uncontended call (counted from libpq's
protocol trace: one per Sync or simple Query the client sends), and same-key hand-off
throughput with four processes taking turns on one key; for fair mode also with many calls
of another process waiting on other keys (``ELSEWHERE``), which a process's own ticket
statements must not read through. The recipes:

* ``pg_advisory_lock`` around the work: lock, write, unlock (a session lock: the write
  commits on its own, so a holder that stalls can still write after losing nothing);
* ``SELECT ... FOR UPDATE`` on the key's row, in a transaction with the write.

Uses the PostgreSQL at KEYSERIAL_TEST_POSTGRES (by default the local one), in a database
of its own that it drops afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import secrets
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Generator
from pathlib import Path
from typing import Any, NamedTuple

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg_pool import AsyncConnectionPool

from keyserial.postgres import PostgresKeyedQueue, connection, lock_id

from .redis_backend import start_server
from .report import environment

LIBRARIES = (
    "keyserial PostgresKeyedQueue",
    "keyserial, fair=True",
    "pg_advisory_lock recipe",
    "SELECT FOR UPDATE recipe",
    "keyserial RedisKeyedQueue",
)
POSTGRES = LIBRARIES[:2]
#: Calls each process keeps queued at once in the queued hand-off runs: a short queue, where
#: fair mode's run of a process's calls is two turns long, and a long one.
QUEUED = (2, 8)
#: Calls of another process waiting on other keys in fair mode's third hand-off run.
ELSEWHERE = 5000
#: The Redis server of the run (the Redis backend's column), set by main().
redis_port_of_run = 0  # set by main(): the Redis server of the run
DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
SCHEMA = """
CREATE TABLE IF NOT EXISTS item (key text PRIMARY KEY, value bigint NOT NULL DEFAULT 0);
"""

Turn = Callable[[str, Callable[[psycopg.AsyncConnection[Any]], Awaitable[None]]], Awaitable[None]]


async def _write(conn: psycopg.AsyncConnection[Any], key: str) -> None:
    await conn.execute(
        "INSERT INTO item (key, value) VALUES (%s, 1) "
        "ON CONFLICT (key) DO UPDATE SET value = item.value + 1",
        (key,),
    )


class Queues:
    """The queues of one process: the PostgreSQL backend's, and the Redis backend's."""

    def __init__(self, pool: AsyncConnectionPool[Any], redis_port: int) -> None:
        import redis.asyncio as redis_asyncio

        from keyserial.redis import RedisKeyedQueue

        self.postgres = PostgresKeyedQueue(pool, namespace="bench")
        self.postgres_fair = PostgresKeyedQueue(pool, namespace="bench", fair=True)
        self.client = redis_asyncio.Redis(port=redis_port)
        self.redis = RedisKeyedQueue(self.client, namespace="bench")

    async def close(self) -> None:
        await self.postgres.aclose()
        await self.postgres_fair.aclose()
        await self.redis.aclose()
        await self.client.aclose()


async def _one(library: str, pool: AsyncConnectionPool[Any], queues: Queues, key: str) -> None:
    """One call on ``key`` that writes its row, the way ``library`` does it."""
    if library in POSTGRES:

        async def work() -> None:
            await _write(connection(), key)

        queue = queues.postgres if library == LIBRARIES[0] else queues.postgres_fair
        await queue.run(key, work)
        return
    if library == LIBRARIES[4]:  # the turn from Redis; the write commits on its own

        async def write_alone() -> None:
            async with pool.connection() as conn:
                await _write(conn, key)

        await queues.redis.run(key, write_alone)
        return
    async with pool.connection() as conn:
        if library == LIBRARIES[2]:
            await conn.set_autocommit(True)
            await conn.execute("SELECT pg_advisory_lock(%s)", (lock_id("bench", key),))
            try:
                await _write(conn, key)
            finally:
                await conn.execute("SELECT pg_advisory_unlock(%s)", (lock_id("bench", key),))
                await conn.set_autocommit(False)
        else:
            async with conn.transaction():
                await conn.execute(
                    "INSERT INTO item (key) VALUES (%s) ON CONFLICT DO NOTHING", (key,)
                )
                await conn.execute("SELECT 1 FROM item WHERE key = %s FOR UPDATE", (key,))
                await _write(conn, key)


def _count_round_trips(trace: Path) -> int:
    """Messages that wait for the server: Sync (extended protocol) and Query (simple)."""
    count = 0
    for line in trace.read_text().splitlines():
        fields = line.split("\t")
        if len(fields) > 2 and fields[1] == "F" and fields[3:4] in (["Sync"], ["Query"]):
            count += 1
    return count


async def _uncontended(dsn: str, library: str, calls: int, trace: Path | None) -> float:
    """Seconds for ``calls`` sequential uncontended calls on distinct keys."""
    async with AsyncConnectionPool(dsn, min_size=1, max_size=1, open=False) as pool:
        queue = Queues(pool, redis_port_of_run)
        await _one(library, pool, queue, "warm-up")
        handle = None
        if trace is not None:
            handle = trace.open("w")
            async with pool.connection() as conn:
                conn.pgconn.trace(handle.fileno())
            # Fair mode's tickets travel on a connection of their own: counted too.
            desk = queue.postgres_fair._turns.early.desk.connection  # pyright: ignore[reportPrivateUsage]
            if library == LIBRARIES[1] and desk is not None:
                desk.pgconn.trace(handle.fileno())
        start = time.perf_counter()
        for i in range(calls):
            await _one(library, pool, queue, f"u{i}")
        elapsed = time.perf_counter() - start
        if handle is not None:
            async with pool.connection() as conn:
                conn.pgconn.untrace()
            desk = queue.postgres_fair._turns.early.desk.connection  # pyright: ignore[reportPrivateUsage]
            if desk is not None:
                desk.pgconn.untrace()
            handle.close()
        await queue.close()
        return elapsed


def _hand_off_worker(
    dsn: str,
    redis_port: int,
    library: str,
    turns: int,
    barrier: Any,
    times: Any,
    index: int,
    queued: int = 1,
) -> None:
    async def main() -> None:
        # A process holds a connection for its turn, and in fair mode one for its next call
        # when that waits in the server behind another process's turn: a pool of three has
        # one to spare.
        async with AsyncConnectionPool(dsn, min_size=1, max_size=3, open=False) as pool:
            queue = Queues(pool, redis_port)
            await _one(library, pool, queue, "warm-up")
            barrier.wait()
            try:
                for done in range(0, turns, queued):
                    batch = min(queued, turns - done)
                    for turn in range(done, done + batch):
                        times[index * turns + turn] = time.monotonic()
                    await asyncio.gather(
                        *(_one(library, pool, queue, "ball") for _ in range(batch))
                    )
                times[len(times) - 1 - index] = time.monotonic()
            finally:
                # Every process's turns are done (or this one failed: the run ends at once,
                # not at the barrier's timeout): the machine's CPU time is read then.
                barrier.wait()
            await queue.close()

    asyncio.run(main())


class HandOff(NamedTuple):
    """One hand-off run: turns per second, and the machine's CPU time per turn."""

    rate: float
    #: Busy CPU time of the whole machine (every process and the server) per turn, in
    #: seconds, from just before the first turn to just after the last; None off Linux.
    cpu_per_turn: float | None


@contextlib.contextmanager
def _waiting_elsewhere(dsn: str, count: int) -> Generator[None, None, None]:
    """``count`` calls of another process waiting in fair mode, each on a key of its own.

    Their tickets are written into the ticket table directly, as that process's
    registrations would leave them (its heartbeat kept away: they never age), and removed
    afterwards. No hand-off run's key is among theirs.
    """
    owner = -1  # an owner id no process draws: theirs are random (keyserial.postgres._tickets)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO keyserial_fences_tq SELECT g, g, %s, 'infinity' "
            "FROM generate_series(1, %s) g",
            (owner, count),
        )
        conn.execute("ANALYZE keyserial_fences_tq")
        try:
            yield
        finally:
            conn.execute("DELETE FROM keyserial_fences_tq WHERE owner = %s", (owner,))


def _busy_seconds() -> float | None:
    """CPU time the machine has spent busy since it booted, all CPUs, from /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    # cpu user nice system idle iowait irq softirq steal ...: all but idle and iowait.
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _hand_off(dsn: str, library: str, processes: int, turns: int, queued: int = 1) -> HandOff:
    """Four processes taking turns on one key, ``queued`` calls at a time each: turns per
    second, and the machine's busy CPU time per turn while they did."""
    context = multiprocessing.get_context("spawn")
    # This process waits at the barrier too, before the first turn and after the last, to
    # read the machine's CPU time then: start-up and shutdown stay out of it.
    barrier = context.Barrier(processes + 1)
    shared = context.Array("d", processes * turns + processes, lock=False)
    workers = [
        context.Process(
            target=_hand_off_worker,
            args=(dsn, redis_port_of_run, library, turns, barrier, shared, i, queued),
        )
        for i in range(processes)
    ]
    for worker in workers:
        worker.start()
    try:
        barrier.wait(timeout=600)
        busy_before = _busy_seconds()
        barrier.wait(timeout=600)
        busy_after = _busy_seconds()
    except threading.BrokenBarrierError:
        barrier.abort()
        busy_before = busy_after = None
    for worker in workers:
        worker.join(timeout=600)
    if any(worker.exitcode != 0 for worker in workers):
        raise RuntimeError(f"a {library} hand-off worker failed")
    times: list[float] = list(shared)
    elapsed = max(times[processes * turns :]) - min(times[: processes * turns])
    cpu = None
    if busy_before is not None and busy_after is not None:
        cpu = (busy_after - busy_before) / (processes * turns)
    return HandOff(processes * turns / elapsed, cpu)


def _median_rate(runs: list[HandOff]) -> float:
    """The median turns per second over ``runs``."""
    return statistics.median(run.rate for run in runs)


def _median_cpu(runs: list[HandOff]) -> float | None:
    """The median CPU time per turn over ``runs``, or None where it was not measured."""
    measured = [run.cpu_per_turn for run in runs if run.cpu_per_turn is not None]
    return statistics.median(measured) if measured else None


def _milliseconds(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.2f}"


def _busy_share(rate: float, cpu_per_turn: float | None) -> str:
    """The share of the machine's CPUs busy while turns ran at ``rate`` per second, each
    costing ``cpu_per_turn`` seconds of CPU time; empty where that was not measured."""
    if cpu_per_turn is None:
        return ""
    return f"{rate * cpu_per_turn / (os.cpu_count() or 1):.0%}"


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.postgres_backend")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for CI smoke runs")
    parser.add_argument("--markdown", type=Path, help="also write the report to this file")
    options = parser.parse_args()
    calls, turns, repeats = (30, 20, 1) if options.quick else (2000, 300, 5)
    processes = 4
    global redis_port_of_run
    redis_server, redis_port_of_run, redis_directory = start_server()
    admin_dsn = os.environ.get("KEYSERIAL_TEST_POSTGRES", DEFAULT_DSN)
    name = f"keyserial_bench_{secrets.token_hex(4)}"
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = make_conninfo(admin_dsn, dbname=name)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(SCHEMA)
        round_trips: dict[str, float] = {}
        with tempfile.TemporaryDirectory() as directory:
            for library in LIBRARIES:
                trace = Path(directory) / "trace"
                asyncio.run(_uncontended(dsn, library, calls, trace))
                round_trips[library] = _count_round_trips(trace) / calls
        samples: dict[str, list[float]] = {library: [] for library in LIBRARIES}
        rates: dict[str, list[HandOff]] = {library: [] for library in LIBRARIES}
        queued_rates: dict[tuple[int, str], list[HandOff]] = {
            (depth, library): [] for depth in QUEUED for library in POSTGRES
        }
        elsewhere_rates: list[HandOff] = []
        for _ in range(repeats):
            for library in LIBRARIES:
                seconds = asyncio.run(_uncontended(dsn, library, calls, None))
                samples[library].append(seconds / calls)
            for library in LIBRARIES:
                rates[library].append(_hand_off(dsn, library, processes, turns))
            for depth in QUEUED:
                for library in POSTGRES:
                    run = _hand_off(dsn, library, processes, turns, depth)
                    queued_rates[depth, library].append(run)
            with _waiting_elsewhere(dsn, ELSEWHERE):
                elsewhere_rates.append(_hand_off(dsn, LIBRARIES[1], processes, turns))
    finally:
        redis_server.terminate()
        redis_server.wait(timeout=10)
        shutil.rmtree(redis_directory, ignore_errors=True)
        with psycopg.connect(admin_dsn, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
    latency = {library: statistics.median(values) for library, values in samples.items()}
    throughput = {library: _median_rate(runs) for library, runs in rates.items()}
    queued = {place: _median_rate(runs) for place, runs in queued_rates.items()}
    cpu = {library: _median_cpu(runs) for library, runs in rates.items()}
    queued_cpu = {place: _median_cpu(runs) for place, runs in queued_rates.items()}
    elsewhere = _median_rate(elsewhere_rates)
    rows = {
        "uncontended µs/call": {n: f"{latency[n] * 1e6:,.0f}" for n in LIBRARIES},
        "round trips/call": {n: f"{round_trips[n]:.1f}" for n in LIBRARIES},
        "hand-off turns/s": {n: f"{throughput[n]:,.0f}" for n in LIBRARIES},
        **{
            f"hand-off turns/s, {depth} calls queued per process": {
                n: f"{queued[depth, n]:,.0f}" if n in POSTGRES else "" for n in LIBRARIES
            }
            for depth in QUEUED
        },
        f"hand-off turns/s, {ELSEWHERE:,} calls waiting on other keys": {
            n: f"{elsewhere:,.0f}" if n == LIBRARIES[1] else "" for n in LIBRARIES
        },
        "machine CPU ms per hand-off turn": {n: _milliseconds(cpu[n]) for n in LIBRARIES},
        **{
            f"machine CPU ms per turn, {depth} calls queued per process": {
                n: _milliseconds(queued_cpu[depth, n]) if n in POSTGRES else "" for n in LIBRARIES
            }
            for depth in QUEUED
        },
        "connections per waiting call": {
            LIBRARIES[0]: "one per key and process",
            LIBRARIES[1]: "a process's only call: one per key; tickets: none",
            LIBRARIES[2]: "one",
            LIBRARIES[3]: "one",
            LIBRARIES[4]: "none",
        },
        "writes in the turn's transaction": {
            n: "yes" if n in (*POSTGRES, LIBRARIES[3]) else "no" for n in LIBRARIES
        },
        "order across processes": {
            LIBRARIES[0]: "each process's next call",
            LIBRARIES[1]: "call order",
            LIBRARIES[2]: "lock manager's order",
            LIBRARIES[3]: "lock manager's order",
            LIBRARIES[4]: "each process's next call",
        },
    }
    ratios = " and ".join(
        f"{queued[depth, LIBRARIES[1]] / queued[depth, LIBRARIES[0]]:.2f} with {depth}"
        for depth in QUEUED
    )
    busy = " and ".join(
        f"{_busy_share(queued[depth, LIBRARIES[0]], queued_cpu[depth, LIBRARIES[0]])} and "
        f"{_busy_share(queued[depth, LIBRARIES[1]], queued_cpu[depth, LIBRARIES[1]])} with {depth}"
        for depth in QUEUED
    )
    lines = [
        f"Environment: {environment()}, PostgreSQL on loopback",
        "",  # separate paragraphs in Markdown
        f"Command: `python -m benchmarks.postgres_backend{' --quick' if options.quick else ''}`",
        "",
        f"### PostgreSQL backend: {calls:,} uncontended calls, each writing a row; "
        f"{processes} processes x {turns:,} turns on one key",
        "",
        "| | " + " | ".join(LIBRARIES) + " |",
        "|---|" + "---:|" * len(LIBRARIES),
        *(
            f"| {measure} | " + " | ".join(values[n] for n in LIBRARIES) + " |"
            for measure, values in rows.items()
        ),
        "",
        f"Medians of {repeats} interleaved runs. Round trips are counted from libpq's protocol "
        "trace of the uncontended calls (each Sync or simple Query waits for the server; the Redis "
        "backend's own two round trips to Redis are not counted); the PostgreSQL backend sends "
        "BEGIN, its settings, the lock and the fence in one round trip (one query), then the "
        "function's statement, then COMMIT. Fair mode ÷ default, hand-off turns/s: "
        f"{throughput[LIBRARIES[1]] / throughput[LIBRARIES[0]]:.2f} with one call per process "
        f"at a time, {ratios} queued per process (fair mode's calls then wait with "
        "tickets, and take the key in runs of one process's calls as long as its queue). "
        "Machine CPU per hand-off turn: the busy time of every CPU (all "
        "processes and the server; from /proc/stat) from the first turn to the last of the "
        "runs, per turn. Share of the machine's CPUs kept busy in the queued runs, default "
        f"and fair mode: {busy}. "
        f"With {ELSEWHERE:,} calls waiting on other keys: the tickets of another process's "
        "waiting calls, one per key, written into the ticket table for that run; fair mode ÷ "
        f"itself without them: {elsewhere / throughput[LIBRARIES[1]]:.2f}.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if options.markdown:
        options.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
