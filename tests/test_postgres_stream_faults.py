"""KeyedStream on PostgreSQL under faults, with real consumer processes and a real server:
every message's effect applied exactly once, in per-key order, none lost (the checks of
tests/postgres_stream_faults.py). Run with the other fault suites, on its own, one case per
CPU at most:

    python -m pytest -m fault_suite -n "$(nproc)" tests/test_postgres_stream_faults.py
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import psycopg
import pytest

from .postgres_server import PrivateCluster, with_database
from .postgres_stream_faults import FaultRun, Report

pytestmark = [pytest.mark.fault_suite, pytest.mark.xdist_group("postgres-connections")]

MESSAGES, KEYS = 640, 16


def _assert_clean(report: Report) -> None:
    assert report.problems == [], report.summary()
    assert report.effects == report.published == MESSAGES


def test_consumers_killed_mid_handler(postgres_dsn: str) -> None:
    report = FaultRun(postgres_dsn, "kill", messages=MESSAGES, keys=KEYS).run()
    _assert_clean(report)
    assert report.faults["killed"] == 3


def test_a_consumer_stopped_past_its_lease(postgres_dsn: str) -> None:
    report = FaultRun(postgres_dsn, "stop", messages=MESSAGES, keys=KEYS).run()
    _assert_clean(report)
    assert report.faults["stopped past the lease"] == 2


def test_the_consumers_sessions_terminated(postgres_dsn: str) -> None:
    report = FaultRun(postgres_dsn, "terminate", messages=MESSAGES, keys=KEYS).run()
    _assert_clean(report)
    # Each time, the consumers' sessions were there to end: handlers' transactions among them.
    assert report.faults["sessions terminated"] >= 4 * 2


@pytest.fixture
def cluster() -> Iterator[PrivateCluster]:
    server = PrivateCluster()
    try:
        server.start()
        server.wait_until_up()
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute("CREATE DATABASE streams")
        yield server
    finally:
        server.close()


def test_the_server_restarted(cluster: PrivateCluster) -> None:
    def restart() -> None:
        cluster.stop("immediate")  # as a crash: open transactions are lost, commits kept
        time.sleep(1.0)
        cluster.start()
        cluster.wait_until_up()

    dsn = with_database(cluster.dsn, "streams")
    report = FaultRun(dsn, "restart", messages=MESSAGES, keys=KEYS, restart=restart).run()
    _assert_clean(report)
    assert report.faults["server restarted"] == 1


def test_pools_smaller_than_the_keys_with_a_consumer_killed(postgres_dsn: str) -> None:
    report = FaultRun(postgres_dsn, "small-pool", messages=MESSAGES, keys=KEYS).run()
    _assert_clean(report)
    assert report.faults["killed"] == 1
