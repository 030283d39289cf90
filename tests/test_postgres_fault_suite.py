"""Faults under load on PostgreSQL, in both modes, with real processes and a real server: the
checks of tests/fault_load.py (every call's writes are kept once, no function starts on a lease
that ran out, no call is left waiting, the key passes on within 1.5 leases, order in fair mode).

Run with the Redis fault suite, on its own (see tests/test_redis_fault_suite.py):

    python -m pytest -m fault_suite tests/test_postgres_fault_suite.py
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from . import fault_load

pytestmark = [pytest.mark.fault_suite, pytest.mark.xdist_group("postgres-connections")]

MODES = pytest.mark.parametrize("fair", [False, True], ids=["default", "fair"])

Workers = list[subprocess.Popen[str]]


def _run(
    postgres_dsn: str,
    tmp_path: Path,
    fair: bool,
    fault: Callable[[Workers], int],
    killed: int | None = None,
) -> None:
    log = tmp_path / "calls.log"
    # Fair mode holds a connection per waiting call: room for every call a process waits for.
    pool = "24" if fair else "4"
    mode = "fair" if fair else "default"
    worker = [sys.executable, "-m", "tests.postgres_worker", postgres_dsn, "fault-load", mode, pool]
    workers, start = fault_load.start_workers(worker, log)
    at = start + fault_load.CALLS * fault_load.SPACING * 1e9 / 4
    time.sleep(max(0.0, (at - time.monotonic_ns()) / 1e9))
    began = fault(workers)
    ended = time.monotonic_ns()
    fault_load.wait_for(workers, 20 * fault_load.LEASE + 10, killed)
    # A turn whose session the server ended keeps nothing, and its call fails with
    # PostgresUnavailable: the worker makes it again.
    fault_load.check(log, (began, ended), fair, killed, unkept=True)


@MODES
def test_a_killed_process_with_a_turn_and_calls_waiting(
    postgres_dsn: str, tmp_path: Path, fair: bool
) -> None:
    def killed(workers: Workers) -> int:
        fault_load.until_holding(tmp_path / "calls.log", 0)
        workers[0].kill()
        return time.monotonic_ns()

    _run(postgres_dsn, tmp_path, fair, killed, killed=0)


@MODES
def test_a_holder_paused_past_its_lease(postgres_dsn: str, tmp_path: Path, fair: bool) -> None:
    def stopped(workers: Workers) -> int:
        fault_load.until_holding(tmp_path / "calls.log", 0)
        workers[0].send_signal(signal.SIGSTOP)
        began = time.monotonic_ns()
        time.sleep(3 * fault_load.LEASE)
        workers[0].send_signal(signal.SIGCONT)
        return began

    _run(postgres_dsn, tmp_path, fair, stopped)


@MODES
def test_a_waiting_process_paused_past_two_leases(
    postgres_dsn: str, tmp_path: Path, fair: bool
) -> None:
    def stopped(workers: Workers) -> int:
        began = time.monotonic_ns()
        workers[1].send_signal(signal.SIGSTOP)
        time.sleep(3 * fault_load.LEASE)
        workers[1].send_signal(signal.SIGCONT)
        return began

    _run(postgres_dsn, tmp_path, fair, stopped)


@MODES
def test_terminated_connections(postgres_dsn: str, tmp_path: Path, fair: bool) -> None:
    def terminate(_: Workers) -> int:
        began = time.monotonic_ns()
        with psycopg.connect(postgres_dsn, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        return began

    _run(postgres_dsn, tmp_path, fair, terminate)
