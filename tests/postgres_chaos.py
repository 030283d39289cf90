"""Chaos run of the PostgreSQL backend: worker processes, faults injected, every turn checked.

Worker processes make read-modify-write calls on a few keys through one ``PostgresKeyedQueue``
each, on a private cluster: in its turn, a call reads the key's last sequence number and
inserts the next one, with the turn's fence, in the turn's transaction. A call that returns
normally records ``ok <pid> <call>`` in its worker's log file, outside the database. Meanwhile
the parent injects faults at random: SIGKILL of a worker (a new one takes its place),
``pg_terminate_backend`` of a worker's sessions, and fast restarts of the server. Afterwards it
checks, from the database and the logs:

* no write was lost: every call that returned normally has its row;
* no two turns of a key overlapped: the sequence numbers of a key are 1, 2, 3, ... (an
  overlap would read the same number twice and fail on the primary key, or skip one);
* fences on a key strictly increase in the order of its turns, across all of it.

The test suite runs a small size (``test_postgres_chaos.py``); a larger run::

    python -m tests.postgres_chaos --workers 6 --seconds 120 --seed 1
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from itertools import pairwise
from pathlib import Path
from typing import TextIO

import psycopg

from .postgres_server import PrivateCluster

ROOT = Path(__file__).resolve().parent.parent

SCHEMA = """
CREATE TABLE IF NOT EXISTS chaos (
    key text, seq int, pid int, call int, fence bigint, PRIMARY KEY (key, seq)
);
"""


async def work(dsn: str, out: TextIO, seed: int, keys: int) -> None:
    """A worker: calls one after another on random keys, until killed or told to stop."""
    from psycopg_pool import AsyncConnectionPool

    from keyserial import current_fence
    from keyserial.postgres import PostgresKeyedQueue, connection

    rng = random.Random(seed)
    pid = os.getpid()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", file=out, flush=True)  # from now on, SIGTERM asks it to drain
    pool = AsyncConnectionPool(dsn, min_size=1, max_size=4, open=False, timeout=5)
    await pool.open()
    queue = PostgresKeyedQueue(pool, namespace="chaos", lease=2.0)

    async def turn(key: str, call: int) -> None:
        conn = connection()
        cursor = await conn.execute(
            "SELECT coalesce(max(seq), 0) + 1 FROM chaos WHERE key = %s", (key,)
        )
        row = await cursor.fetchone()
        assert row is not None
        await asyncio.sleep(rng.uniform(0, 0.004))
        await conn.execute(
            "INSERT INTO chaos VALUES (%s, %s, %s, %s, %s)",
            (key, row[0], pid, call, current_fence()),
        )

    async def one(call: int, out: TextIO) -> None:
        key = f"key-{rng.randrange(keys)}"
        try:
            await queue.with_options(timeout=10).run(key, turn, key, call)
        except Exception as exc:  # faults are expected: the call failed, and says so
            print(f"failed {pid} {call} {type(exc).__name__}", file=out, flush=True)
        else:
            print(f"ok {pid} {call}", file=out, flush=True)

    call = 0
    while not stop.is_set():
        batch = [one(call + i, out) for i in range(3)]  # three calls in flight at a time
        call += len(batch)
        await asyncio.gather(*batch)
    await pool.close()


def run(workers: int, seconds: float, seed: int) -> dict[str, int]:
    """Run the chaos for ``seconds`` and check the outcome; AssertionError on a violation.

    Returns the count of each fault injected, and of calls that returned normally (``ok``).
    """
    rng = random.Random(seed)
    cluster = PrivateCluster()
    cluster.start()
    logs = tempfile.mkdtemp(prefix="keyserial-pg-chaos-")
    running: list[subprocess.Popen[bytes]] = []
    log_of: dict[int, str] = {}
    started = 0

    def spawn() -> None:
        nonlocal started
        log = os.path.join(logs, f"worker-{started}.log")
        command = [sys.executable, "-m", "tests.postgres_chaos", "--work", cluster.dsn, log]
        with open(log + ".stderr", "w") as errors:  # the pool's warnings during faults
            worker = subprocess.Popen(
                [*command, str(seed * 1000 + started), "3"], cwd=ROOT, stderr=errors
            )
        running.append(worker)
        log_of[worker.pid] = log
        started += 1

    try:
        cluster.wait_until_up()
        with psycopg.connect(cluster.dsn, autocommit=True) as conn:
            conn.execute(SCHEMA)
        for _ in range(workers):
            spawn()
        faults: dict[str, int] = defaultdict(int)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(0.3, 0.8))
            fault = rng.choice(["kill", "kill", "terminate", "terminate", "restart"])
            faults[fault] += 1
            if fault == "kill":
                victim = running.pop(rng.randrange(len(running)))
                victim.kill()
                victim.wait(timeout=30)
                spawn()
            elif fault == "terminate":
                try:
                    with psycopg.connect(cluster.dsn, autocommit=True, connect_timeout=5) as conn:
                        conn.execute(
                            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                            "WHERE backend_type = 'client backend' AND pid <> pg_backend_pid() "
                            "ORDER BY random() LIMIT 2"
                        )
                except psycopg.OperationalError:
                    pass  # the server is still coming back from a restart
            else:
                cluster.stop("fast")
                cluster.start()
                cluster.wait_until_up()
        for worker in running:
            _wait_until_ready(log_of[worker.pid])
            worker.send_signal(signal.SIGTERM)
        for worker in running:
            code = worker.wait(timeout=60)
            with open(log_of[worker.pid] + ".stderr") as errors:
                assert code == 0, f"a worker did not drain and exit when asked: {errors.read()}"
        faults["ok"] = check(cluster.dsn, logs)
        print(f"chaos: {started} workers, {dict(faults)}: all checks passed")
        return dict(faults)
    finally:
        for worker in running:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        cluster.close()
        shutil.rmtree(logs, ignore_errors=True)


def _wait_until_ready(log: str) -> None:
    """Wait until a worker has started handling SIGTERM (a new one may still be importing)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if os.path.exists(log):
            with open(log) as lines:
                if "ready\n" in lines:
                    return
        time.sleep(0.05)
    raise AssertionError(f"a worker never became ready ({log})")


def check(dsn: str, logs: str) -> int:
    """Check the run's invariants; the number of calls that returned normally."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT key, seq, pid, call, fence FROM chaos ORDER BY key, seq"
        ).fetchall()
    kept = {(pid, call) for _, _, pid, call, _ in rows}
    returned: set[tuple[int, int]] = set()
    for name in os.listdir(logs):
        if not name.endswith(".log"):
            continue
        with open(os.path.join(logs, name)) as log:
            for line in log:
                word, *rest = line.split()
                if word == "ok" and rest:
                    returned.add((int(rest[0]), int(rest[1])))
    assert returned, "no call returned normally: the run checked nothing"
    lost = returned - kept
    assert not lost, (
        f"{len(lost)} calls returned normally but their writes are gone: {sorted(lost)[:5]}"
    )
    by_key: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for key, seq, _, _, fence in rows:
        by_key[key].append((seq, fence))
    for key, turns in by_key.items():
        assert [seq for seq, _ in turns] == list(range(1, len(turns) + 1)), f"{key}: overlap"
        for (seq, earlier), (_, later) in pairwise(turns):
            assert earlier < later, f"{key}: fence {later} after turn {seq} with fence {earlier}"
    return len(returned)


def main() -> None:
    parser = argparse.ArgumentParser(description="Chaos run of the PostgreSQL backend.")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--work", nargs=4, metavar=("DSN", "LOG", "SEED", "KEYS"))
    args = parser.parse_args()
    if args.work:
        dsn, log, seed, keys = args.work
        with open(log, "a", buffering=1) as out:
            asyncio.run(work(dsn, out, int(seed), int(keys)))
        return
    run(args.workers, args.seconds, args.seed)


if __name__ == "__main__":
    main()
