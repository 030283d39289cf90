"""The PostgreSQL backend across processes, and under faults, against a real server."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections import defaultdict
from itertools import pairwise
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from keyserial.postgres import CommitInDoubt, PostgresKeyedQueue, PostgresUnavailable, connection

from . import fair_order
from .postgres_server import PrivateCluster
from .postgres_worker import MODULUS, create_schema
from .processes import run_until_done

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.xdist_group("postgres-connections")
@pytest.mark.usefixtures("postgres_mode")
def test_four_processes_twenty_keys_no_overlap_fifo_exactly_once(postgres_dsn: str) -> None:
    create_schema(postgres_dsn)
    processes, calls, keys = 4, 120, 20
    command = [sys.executable, "-m", "tests.postgres_worker", postgres_dsn, "log"]
    run_until_done([*command, str(seed), str(calls), str(keys)] for seed in range(processes))
    with psycopg.connect(postgres_dsn) as conn:
        history = conn.execute(
            "SELECT key, seq, pid, call, fence, started, ended FROM history ORDER BY key, seq"
        ).fetchall()
        state: dict[str, int] = dict(conn.execute("SELECT key, value FROM state").fetchall())
    assert len(history) == processes * calls  # every call ran, exactly once
    assert len({(pid, call) for _, _, pid, call, *_ in history}) == processes * calls
    by_key: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
    for row in history:
        by_key[row[0]].append(row)
    for key, turns in by_key.items():
        assert [row[1] for row in turns] == list(range(1, len(turns) + 1)), key
        for earlier, later in pairwise(turns):
            assert earlier[6] <= later[5], f"{key}: two turns overlapped"
            assert earlier[4] < later[4], f"{key}: fences did not increase"
        for pid in {row[2] for row in turns}:  # registration order within each process
            mine = [row[3] for row in turns if row[2] == pid]
            assert mine == sorted(mine), f"{key}: process {pid} out of order"
        expected = 0
        for row in turns:  # the state a serial run in this order leaves
            expected = (
                (expected * 31 + row[3]) % MODULUS if expected or row is not turns[0] else row[3]
            )
        assert state[key] == expected, key


class Holder:
    """A worker process holding a key's turn (tests/postgres_worker.py hold)."""

    def __init__(self, dsn: str, key: str, lease: float, mode: str = "hold") -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.postgres_worker", dsn, mode, key, str(lease)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    async def line(self) -> str:
        assert self.process.stdout is not None
        read = asyncio.to_thread(self.process.stdout.readline)
        return (await asyncio.wait_for(read, timeout=30)).strip()

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
        self.process.wait(timeout=10)
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()


async def _stages(dsn: str) -> list[str]:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cursor = await conn.execute("SELECT stage FROM writes ORDER BY stage")
        return [row[0] for row in await cursor.fetchall()]


@pytest.mark.asyncio
@pytest.mark.usefixtures("postgres_mode")
async def test_a_killed_holder_leaves_no_partial_write_and_frees_the_key(postgres_dsn: str) -> None:
    create_schema(postgres_dsn)
    holder = Holder(postgres_dsn, "k", 10.0)
    try:
        assert await holder.line() == "holding"
        holder.process.send_signal(signal.SIGKILL)
        async with AsyncConnectionPool(postgres_dsn, min_size=1, max_size=2, open=False) as pool:
            queue = PostgresKeyedQueue(pool, namespace="faults", lease=10.0)

            async def next_call() -> list[str]:
                await connection().execute("INSERT INTO writes VALUES ('k', 'next', 0)")
                return await _stages(postgres_dsn)

            # At once, not after a lease: the server ends the session when the socket closes.
            seen = await asyncio.wait_for(queue.run("k", next_call), timeout=5)
        assert seen == []  # the killed holder's partial write is gone; ours is not committed yet
        assert await _stages(postgres_dsn) == ["next"]
    finally:
        holder.close()


@pytest.mark.asyncio
@pytest.mark.usefixtures("postgres_mode")
async def test_a_stopped_holder_loses_its_transaction_and_its_late_write(postgres_dsn: str) -> None:
    create_schema(postgres_dsn)
    lease = 0.5  # the holder's idle_in_transaction_session_timeout
    holder = Holder(postgres_dsn, "k", lease)
    try:
        assert await holder.line() == "holding"
        holder.process.send_signal(signal.SIGSTOP)  # a long pause: GC, swap, a debugger
        async with AsyncConnectionPool(postgres_dsn, min_size=1, max_size=2, open=False) as pool:
            queue = PostgresKeyedQueue(pool, namespace="faults", lease=10.0)

            async def next_call() -> None:
                await connection().execute("INSERT INTO writes VALUES ('k', 'next', 0)")

            await asyncio.wait_for(queue.run("k", next_call), timeout=20)
        holder.process.send_signal(signal.SIGCONT)
        holder.send("go on")  # it tries its final write on a session the server ended
        # The documented error, not psycopg's IdleInTransactionSessionTimeout.
        assert await holder.line() == "failed: LeaseExpired"
        assert await _stages(postgres_dsn) == ["next"]  # no partial, no stale final
    finally:
        holder.close()


@pytest.mark.asyncio
@pytest.mark.usefixtures("postgres_mode")
async def test_a_server_restart_mid_run_keeps_nothing_half_written() -> None:
    cluster = PrivateCluster()
    cluster.start()
    try:
        cluster.wait_until_up()
        create_schema(cluster.dsn)
        async with AsyncConnectionPool(
            cluster.dsn, min_size=1, max_size=10, open=False, timeout=5, reconnect_timeout=30
        ) as pool:
            queue = PostgresKeyedQueue(pool, namespace="restart")

            async def work(call: int) -> None:
                conn = connection()
                await conn.execute("INSERT INTO writes VALUES ('k', 'first half', %s)", (call,))
                await asyncio.sleep(0.01)
                await conn.execute("INSERT INTO writes VALUES ('k', 'second half', %s)", (call,))

            calls = [asyncio.create_task(queue.run(f"key-{i % 3}", work, i)) for i in range(60)]
            await asyncio.sleep(0.2)
            await asyncio.to_thread(cluster.stop, "fast")
            await asyncio.to_thread(cluster.start)
            outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 60)
            failed = [o for o in outcomes if o is not None]
            # A COMMIT sent as the server went down is in doubt: the client cannot tell
            # whether it arrived. Either way, nothing is half written.
            assert all(isinstance(o, PostgresUnavailable | CommitInDoubt) for o in failed), failed
            async with await psycopg.AsyncConnection.connect(cluster.dsn) as conn:
                cursor = await conn.execute(
                    "SELECT pid, count(*) FROM writes GROUP BY pid HAVING count(*) <> 2"
                )
                assert await cursor.fetchall() == []  # both halves of a call, or neither
            await queue.run("key-0", work, 999)  # and the queue works again
    finally:
        cluster.close()


@pytest.mark.xdist_group("postgres-connections")
@pytest.mark.parametrize("mode", ["fair", "default"])
def test_across_processes_fair_mode_runs_calls_in_the_order_they_were_made(
    postgres_dsn: str, tmp_path: Path, mode: str
) -> None:
    worker = [sys.executable, "-m", "tests.postgres_worker", postgres_dsn, "order", mode]
    records = fair_order.run_workers(worker, tmp_path / "calls.log", seed=7)
    overtakes = fair_order.check_turns(records)
    if mode == "fair":
        assert overtakes == 0
    else:
        fair_order.report("PostgreSQL, default mode", overtakes)
