"""Faults under load on PostgreSQL, in both modes, with real processes and a real server, calls
made one at a time and in bursts: the checks of tests/fault_load.py (every call returns once and
its function runs once, no function starts on a lease that ran out, no call is left waiting, the
key passes on within 1.5 leases, order in fair mode).

Run as the Redis fault suite is, on its own and one case at a time (see
tests/test_redis_fault_suite.py; on a machine of 2 CPUs, at two at once, a key once stood idle
past 1.5 leases, fair mode, a waiting process paused):

    python -m pytest -m fault_suite -n 0 tests/test_postgres_fault_suite.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import psycopg
import pytest

from . import fault_load

pytestmark = [pytest.mark.fault_suite, pytest.mark.xdist_group("postgres-connections")]

MODES = pytest.mark.parametrize("fair", [False, True], ids=["default", "fair"])
LOADS = fault_load.LOADS
#: Seconds the terminated-connections fault lasts past its backends' exit (a fifth of a
#: lease): for a worker that read a last answer such a backend sent to log its function's
#: start (see that case).
LAST_ANSWERS = fault_load.LEASE / 5


def _run(
    postgres_dsn: str,
    tmp_path: Path,
    fair: bool,
    fault: fault_load.Fault,
    killed: int | None = None,
    burst: int = 1,
) -> None:
    # A pool of four, smaller than the calls each process has waiting, in both modes: fair
    # mode's waiting calls hold tickets, not connections.
    mode = "fair" if fair else "default"
    worker = [
        *(sys.executable, "-m", "tests.postgres_worker", postgres_dsn),
        *("fault-load", mode, "4", str(burst)),
    ]
    # A turn whose session the server ended keeps nothing, and its call fails with
    # PostgresUnavailable: the worker makes it again.
    fault_load.run_case(
        worker, tmp_path / "calls.log", fair, fault, killed, unkept=True, burst=burst
    )


@MODES
@LOADS
def test_a_killed_process_with_a_turn_and_calls_waiting(
    postgres_dsn: str, tmp_path: Path, fair: bool, burst: int
) -> None:
    kill = fault_load.kill_holder(tmp_path / "calls.log", 0)
    _run(postgres_dsn, tmp_path, fair, kill, 0, burst)


@MODES
@LOADS
def test_a_holder_paused_past_its_lease(
    postgres_dsn: str, tmp_path: Path, fair: bool, burst: int
) -> None:
    stop = fault_load.stop_holder(tmp_path / "calls.log", 0)
    _run(postgres_dsn, tmp_path, fair, stop, None, burst)


@MODES
@LOADS
def test_a_waiting_process_paused_past_two_leases(
    postgres_dsn: str, tmp_path: Path, fair: bool, burst: int
) -> None:
    _run(postgres_dsn, tmp_path, fair, fault_load.stop_process(1), None, burst)


@MODES
@LOADS
def test_terminated_connections(postgres_dsn: str, tmp_path: Path, fair: bool, burst: int) -> None:
    def terminate(_: fault_load.Workers) -> int:
        began = time.monotonic_ns()
        with psycopg.connect(postgres_dsn, autocommit=True) as admin:
            # Each call returns once its backend has exited (or after 5 s): a backend told to
            # end while it runs a statement may still answer it on its way out.
            admin.execute(
                "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        # The fault lasts until its workers have acted on such last answers: a turn that read
        # one before its backend was gone may log its function's start a moment after (its
        # commit is then in doubt); one that reads it later finds the session ended and
        # begins again.
        time.sleep(LAST_ANSWERS)
        return began

    _run(postgres_dsn, tmp_path, fair, terminate, None, burst)
