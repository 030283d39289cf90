"""Faults for KeyedStream on PostgreSQL, with real consumer processes and a real server.

The parent publishes messages for many keys (each key's messages numbered 0, 1, 2, ...),
starts consumer processes, and injects one kind of fault while they work: consumers
SIGKILLed mid-handler (a new one takes each one's place), a consumer SIGSTOPped well past
its lease, every session of the consumers ended by ``pg_terminate_backend``, the server
stopped at once and started again, or consumers whose pools have fewer connections than
they have keys to run (one of them killed). Each handler inserts one row (its effect) through
``keyserial.postgres.connection()`` and then awaits a little, so that faults land while
transactions are open. Once every effect is in, the consumers stop, and the parent checks:

* exactly once: every message's effect is in the table once, none twice (a handler whose
  transaction did not commit left nothing, and a message whose commit did land is not run
  again);
* order: per key, the effects committed in publish order;
* nothing lost or left behind: no message dead-lettered, none unacknowledged.

The suite runs small sizes (``test_postgres_stream_faults.py``); a larger run::

    python -m tests.postgres_stream_faults DSN --fault kill --messages 5000 --keys 64
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from keyserial.postgres import connection
from keyserial.streams import KeyedStream, StreamMessage

ROOT = Path(__file__).resolve().parent.parent
STREAM = "faults"
#: The application name of the consumers' sessions, before ``-<pid>``
#: (``pg_terminate_backend`` finds them by it, in the run's own database).
APPLICATION = "ksfault-consumer"
#: How long each handler awaits after its write, its transaction open.
HANDLER_AWAIT = 0.03

FAULTS = ("kill", "stop", "terminate", "restart", "small-pool")
#: Connections in each consumer's pool: fewer than its keys in the small-pool fault. Kept
#: small in every case: with a killed consumer's sessions not yet gone and its replacement
#: started, larger pools came near the shared server's max_connections.
POOL = {"small-pool": 3}


# -- the consumer process ---------------------------------------------------------------------


async def consume(dsn: str, partitions: int, lease: float, pool_size: int) -> None:
    pool: AsyncConnectionPool[psycopg.AsyncConnection[object]] = AsyncConnectionPool(
        dsn,
        min_size=min(2, pool_size),
        max_size=pool_size,
        kwargs={"application_name": f"{APPLICATION}-{os.getpid()}"},
        open=False,
    )
    await pool.open()
    stream = KeyedStream(pool, STREAM, partitions, lease=lease)

    @stream.consumer(max_in_flight=100, max_attempts=5, retry_delay=0.01, drain_timeout=5)
    async def handle(message: StreamMessage) -> None:
        await connection().execute(
            "INSERT INTO effects (key, seq, pid) VALUES (%s, %s, %s)",
            (message.key, int(message.fields["seq"]), os.getpid()),
        )
        await asyncio.sleep(HANDLER_AWAIT)

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stream.stop)
    print("ready", flush=True)
    await stream.run()
    await stream.aclose()
    await pool.close()


# -- the parent -------------------------------------------------------------------------------


@dataclass
class Report:
    published: int = 0
    effects: int = 0
    problems: list[str] = field(default_factory=lambda: [])
    faults: Counter[str] = field(default_factory=lambda: Counter())

    def summary(self) -> str:
        head = f"published {self.published}, effects {self.effects}, faults {dict(self.faults)}"
        return "\n".join([head, *self.problems[:20]])


class FaultRun:
    """One run: publish, consume under ``fault``, check (see the module docstring).

    ``restart``, when the fault is ``"restart"``, stops the server at once and starts it
    again (the test's private cluster).
    """

    def __init__(
        self,
        dsn: str,
        fault: str,
        *,
        messages: int,
        keys: int,
        consumers: int = 2,
        partitions: int = 8,
        lease: float = 1.0,
        seed: int = 1,
        restart: Callable[[], None] | None = None,
    ) -> None:
        if fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
        self.dsn, self.fault = dsn, fault
        self.messages, self.keys = messages, keys
        self.consumers, self.partitions, self.lease = consumers, partitions, lease
        self.rng = random.Random(seed)
        self.restart = restart
        self.processes: list[subprocess.Popen[str]] = []
        self.killed: list[subprocess.Popen[str]] = []
        self._watch: psycopg.Connection[tuple[Any, ...]] | None = None  # polls progress
        self.report = Report()

    def run(self, seconds: float = 45.0) -> Report:
        deadline = time.monotonic() + seconds
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute("DROP TABLE IF EXISTS effects")
            conn.execute("CREATE TABLE effects (key text, seq int, pid int, at bigserial)")
        asyncio.run(self._publish())
        try:
            for _ in range(self.consumers):
                self._spawn()
            self._inject(deadline)
            self._wait_until_done(deadline)
        finally:
            self._stop_all()
            if self._watch is not None:
                self._watch.close()
        self._check()
        return self.report

    async def _publish(self) -> None:
        pool: AsyncConnectionPool[psycopg.AsyncConnection[object]] = AsyncConnectionPool(
            self.dsn, min_size=1, max_size=4, open=False
        )
        await pool.open()
        stream = KeyedStream(pool, STREAM, self.partitions, lease=self.lease)
        for n in range(self.messages):
            await stream.publish(f"k{n % self.keys}", {"seq": n // self.keys})
        self.report.published = self.messages
        await stream.aclose()
        await pool.close()

    def _spawn(self) -> None:
        command = [
            sys.executable,
            "-m",
            "tests.postgres_stream_faults",
            self.dsn,
            "--consume",
            "--partitions",
            str(self.partitions),
            "--lease",
            str(self.lease),
            "--pool",
            str(POOL.get(self.fault, 12)),
        ]
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        assert process.stdout is not None
        if process.stdout.readline().strip() != "ready":
            raise RuntimeError("a consumer did not start")
        self.processes.append(process)

    def _done(self) -> int:
        """How many effects are in (0 while the server cannot say)."""
        try:
            if self._watch is None or self._watch.closed:
                self._watch = psycopg.connect(self.dsn, connect_timeout=2, autocommit=True)
            row = self._watch.execute("SELECT count(*) FROM effects").fetchone()
            return int(row[0]) if row is not None else 0
        except psycopg.OperationalError:
            if self._watch is not None:
                self._watch.close()
            return 0

    def _until_progress(self, share: float, deadline: float) -> None:
        while self._done() < share * self.messages and time.monotonic() < deadline:
            time.sleep(0.02)

    def _inject(self, deadline: float) -> None:
        faults = self.report.faults
        if self.fault in ("kill", "small-pool"):
            for share in (0.1, 0.35, 0.6)[: 3 if self.fault == "kill" else 1]:
                self._until_progress(share, deadline)
                victim = self.processes.pop(self.rng.randrange(len(self.processes)))
                victim.kill()
                victim.wait()
                self.killed.append(victim)
                faults["killed"] += 1
                self._spawn()
        elif self.fault == "stop":
            for share in (0.15, 0.5):
                self._until_progress(share, deadline)
                victim = self.rng.choice(self.processes)
                victim.send_signal(signal.SIGSTOP)
                time.sleep(2.5 * self.lease)  # well past its lease: its partitions move
                victim.send_signal(signal.SIGCONT)
                faults["stopped past the lease"] += 1
        elif self.fault == "terminate":
            for share in (0.1, 0.3, 0.5, 0.7):
                self._until_progress(share, deadline)
                with psycopg.connect(self.dsn, autocommit=True) as conn:
                    ended = conn.execute(
                        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) "
                        "FROM pg_stat_activity WHERE datname = current_database() "
                        "AND application_name LIKE %s",
                        (APPLICATION + "-%",),
                    ).fetchone()
                faults["sessions terminated"] += int(ended[0]) if ended else 0
        else:
            assert self.restart is not None, "the restart fault needs a server to restart"
            self._until_progress(0.3, deadline)
            self.restart()
            faults["server restarted"] += 1

    def _wait_until_done(self, deadline: float) -> None:
        while self._done() < self.messages and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._done() < self.messages:
            self.report.problems.append(f"not done by the deadline: {self._state()}")
        for process in self.processes:
            if process.poll() is not None:
                self.report.problems.append(f"a consumer exited with {process.returncode}")

    def _state(self) -> str:
        """What the stream's tables hold: the partitions' owners and what waits in them."""
        with psycopg.connect(self.dsn) as conn:
            partitions = conn.execute(
                "SELECT partition, fence, owner, round(extract(epoch FROM lease_until - "
                "clock_timestamp())::numeric, 2) FROM keyserial_stream_partitions ORDER BY 1"
            ).fetchall()
            waiting = conn.execute(
                "SELECT partition, count(*), min(id), max(deliveries) "
                "FROM keyserial_stream_messages GROUP BY 1 ORDER BY 1"
            ).fetchall()
            members = conn.execute("SELECT member FROM keyserial_stream_members").fetchall()
        return f"partitions {partitions}; waiting {waiting}; members {members}"

    def _stop_all(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                self.report.problems.append("a consumer did not stop within 20 s of SIGTERM")
        for process in self.killed + self.processes:
            if process.stdout is not None:
                process.stdout.close()

    def _check(self) -> None:
        problems = self.report.problems
        with psycopg.connect(self.dsn) as conn:
            effects = conn.execute("SELECT key, seq FROM effects ORDER BY at").fetchall()
            dead = conn.execute("SELECT count(*) FROM keyserial_stream_dead").fetchone()
            left = conn.execute("SELECT count(*) FROM keyserial_stream_messages").fetchone()
        self.report.effects = len(effects)
        counts = Counter(effects)
        twice = sorted(effect for effect, count in counts.items() if count > 1)
        if twice:
            problems.append(f"{len(twice)} effects applied more than once, e.g. {twice[:5]}")
        by_key: defaultdict[str, list[int]] = defaultdict(list)
        for key, seq in effects:
            by_key[key].append(seq)
        for n in range(self.keys):
            key = f"k{n}"
            expected = list(range(len(range(n, self.messages, self.keys))))
            got = by_key.get(key, [])
            if sorted(set(got)) != expected:
                missing = sorted(set(expected) - set(got))
                problems.append(f"{key}: the effects of {missing[:10]} are missing")
            elif got != sorted(got):
                problems.append(f"{key}: effects committed out of order: {got}")
        if dead and dead[0]:
            problems.append(f"{dead[0]} messages dead-lettered")
        if left and left[0]:
            problems.append(f"{left[0]} messages unacknowledged after the consumers stopped")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("dsn")
    parser.add_argument("--consume", action="store_true", help="run as a consumer process")
    parser.add_argument("--fault", choices=FAULTS, default="kill")
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--keys", type=int, default=64)
    parser.add_argument("--consumers", type=int, default=3)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--lease", type=float, default=1.0)
    parser.add_argument("--pool", type=int, default=12, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if args.consume:
        asyncio.run(consume(args.dsn, args.partitions, args.lease, args.pool))
        return 0
    if args.fault == "restart":
        parser.error("the restart fault runs in the test suite, on a private cluster")
    run = FaultRun(
        args.dsn,
        args.fault,
        messages=args.messages,
        keys=args.keys,
        consumers=args.consumers,
        partitions=args.partitions,
        lease=args.lease,
        seed=args.seed,
    )
    report = run.run(seconds=600)
    print(report.summary())
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
