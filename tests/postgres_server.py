"""PostgreSQL for the tests: a private database on a running server, or a private cluster.

Most tests need only a database of their own: one is created on the server at
``KEYSERIAL_TEST_POSTGRES`` (a DSN; by default the local server on 127.0.0.1:5432) and
dropped afterwards. The restart test needs a server it may stop: ``PrivateCluster`` runs
``initdb`` and ``postgres`` (as the ``postgres`` user when run as root) on a free port.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Generator

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"


def server_dsn() -> str:
    return os.environ.get("KEYSERIAL_TEST_POSTGRES", DEFAULT_DSN)


def unavailable(message: str) -> None:
    """A missing server is a failure under CI=true, a skip elsewhere."""
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def cannot_connect(dsn: str, error: Exception) -> str:
    """Why the tests cannot connect to the server at ``dsn``, named by its real cause."""
    text = str(error).strip()
    if "too many clients" in text or getattr(error, "sqlstate", None) == "53300":
        return (
            f"the PostgreSQL server at {dsn} is up but refused a connection: too many clients "
            f"(max_connections reached, by this suite or by something else on the server; "
            f"SELECT count(*) FROM pg_stat_activity shows them): {text}"
        )
    if "Connection refused" in text or "No such file or directory" in text:
        return f"no PostgreSQL server answers at {dsn} (set KEYSERIAL_TEST_POSTGRES): {text}"
    return f"cannot connect to the PostgreSQL server at {dsn}: {text}"


@contextlib.contextmanager
def connection_errors(pool_name: str) -> Generator[list[Exception], None, None]:
    """The errors the pool ``pool_name`` met connecting, while the block runs (psycopg_pool
    logs them and retries; its own timeout then says only that it did not open)."""
    found: list[Exception] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if f"error connecting in {pool_name!r}" in message:
                found.append(psycopg.OperationalError(message.partition(": ")[2]))

    handler = Collect(level=logging.WARNING)
    logger = logging.getLogger("psycopg.pool")
    logger.addHandler(handler)
    try:
        yield found
    finally:
        logger.removeHandler(handler)


def with_database(dsn: str, database: str) -> str:
    return make_conninfo(dsn, dbname=database)


@contextlib.contextmanager
def private_database() -> Generator[str, None, None]:
    """A new database on the test server, dropped afterwards; yields its DSN."""
    admin_dsn = server_dsn()
    try:
        admin = psycopg.connect(admin_dsn, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        unavailable(cannot_connect(admin_dsn, exc))
        raise AssertionError("unreachable") from exc
    name = f"keyserial_test_{secrets.token_hex(6)}"
    with admin:
        database = sql.Identifier(name)
        admin.execute(sql.SQL("CREATE DATABASE {}").format(database))
        # Deadlocks are found after deadlock_timeout (1 s by default): faster for the tests.
        admin.execute(sql.SQL("ALTER DATABASE {} SET deadlock_timeout = '100ms'").format(database))
        try:
            yield with_database(admin_dsn, name)
        finally:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(database))


def postgres_binaries() -> str:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found and shutil.which("initdb"):
        found = [shutil.which("initdb") or ""]
    if not found:
        unavailable("initdb is not installed (apt-get install postgresql)")
    return os.path.dirname(found[-1])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PrivateCluster:
    """A PostgreSQL cluster of the test's own, which it may stop and start again."""

    def __init__(self) -> None:
        self.bin = postgres_binaries()
        self.directory = tempfile.mkdtemp(prefix="keyserial-pg-")
        self.data = os.path.join(self.directory, "data")
        self.port = free_port()
        self.as_root = os.geteuid() == 0
        if self.as_root:  # initdb refuses to run as root
            shutil.chown(self.directory, "postgres", "postgres")
        self._run("initdb", "-D", self.data, "-A", "trust", "-U", "postgres", "--no-sync")

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        command = [os.path.join(self.bin, tool), *args]
        if self.as_root:
            command = ["runuser", "-u", "postgres", "--", *command]
        subprocess.run(command, check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        options = f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1 -c fsync=off"
        log = os.path.join(self.directory, "log")
        self._run("pg_ctl", "-D", self.data, "-o", options, "-l", log, "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self._run("pg_ctl", "-D", self.data, "-m", mode, "-w", "stop")

    def wait_until_up(self, seconds: float = 30) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                psycopg.connect(self.dsn, connect_timeout=1).close()
                return
            except psycopg.OperationalError:
                time.sleep(0.05)
        raise RuntimeError("the private PostgreSQL cluster did not come up")

    def close(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.directory, ignore_errors=True)
