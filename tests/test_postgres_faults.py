"""The PostgreSQL backend under the faults users of a database lock meet first: a commit whose
reply is lost, a holder killed inside a long statement or stopped before its first one, double
cancellation, an exhausted pool, a role without CREATE (against the real server)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import psycopg
import pytest
import pytest_asyncio
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import AsyncConnectionPool

from keyserial import DeadlockError, current_fence
from keyserial.postgres import (
    CommitInDoubt,
    PoolExhausted,
    PostgresKeyedQueue,
    SetupRequired,
    connection,
    lock_id,
    setup_sql,
)

from .conftest import Pools
from .fair_lines import until_waiting_in_server
from .redis_helpers import until
from .test_postgres_processes import ROOT, Holder

# Every test runs in the default mode and in fair mode (the postgres_mode fixture).
pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("postgres_mode")]


class CommitCutter:
    """A TCP proxy to the server that, once armed, lets the next ``COMMIT`` through and drops
    the connection before the server's reply reaches the client: the commit happened, and
    the client cannot know it."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.armed = False
        self.cut = asyncio.Event()
        self.server: asyncio.Server | None = None
        #: The task serving each proxied connection: close() ends those still running.
        self.serving: set[asyncio.Task[Any]] = set()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(
        self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter
    ) -> None:
        serving = asyncio.current_task()
        assert serving is not None
        self.serving.add(serving)
        server_in, server_out = await asyncio.open_connection(self.host, self.port)
        dropping = False

        async def upstream() -> None:
            nonlocal dropping
            while data := await client_in.read(65536):
                if self.armed and b"COMMIT\x00" in data:
                    self.armed, dropping = False, True
                server_out.write(data)
                await server_out.drain()

        async def downstream() -> None:
            while data := await server_in.read(65536):
                if dropping:  # the server's reply to the COMMIT: never delivered
                    client_out.transport.abort()
                    server_out.close()
                    self.cut.set()
                    return
                client_out.write(data)
                await client_out.drain()

        pumps = [asyncio.ensure_future(upstream()), asyncio.ensure_future(downstream())]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            client_out.transport.abort()
            server_out.transport.abort()
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            self.serving.discard(serving)

    async def close(self) -> None:
        """Stop listening and end every proxied connection, before the test's loop closes."""
        if self.server is not None:
            self.server.close()
        for serving in list(self.serving):
            serving.cancel()
        await asyncio.gather(*self.serving, return_exceptions=True)
        if self.server is not None:
            await self.server.wait_closed()


async def test_a_commit_whose_reply_is_lost_is_reported_in_doubt(postgres_dsn: str) -> None:
    params = conninfo_to_dict(postgres_dsn)
    cutter = CommitCutter(str(params.get("host", "127.0.0.1")), int(str(params.get("port", 5432))))
    port = await cutter.start()
    through = make_conninfo(postgres_dsn, host="127.0.0.1", port=port, sslmode="disable")
    async with await psycopg.AsyncConnection.connect(postgres_dsn, autocommit=True) as admin:
        await admin.execute("CREATE TABLE segment (id text PRIMARY KEY, text text NOT NULL)")
        try:
            async with AsyncConnectionPool(through, min_size=1, max_size=2, open=False) as pool:
                queue = PostgresKeyedQueue(pool, namespace="doubt")

                async def save(seg_id: str, cut: bool) -> str:
                    await connection().execute(
                        "INSERT INTO segment VALUES (%s, 'final')", (seg_id,)
                    )
                    cutter.armed = cut
                    return "saved"

                with pytest.raises(CommitInDoubt, match="may or may not have been kept"):
                    await asyncio.wait_for(queue.run("s1", save, "s1", True), timeout=20)
                assert cutter.cut.is_set()
                # It was committed: "nothing was kept" would have been a lie.
                rows = await (await admin.execute("SELECT id FROM segment")).fetchall()
                assert rows == [("s1",)]
                assert await asyncio.wait_for(queue.run("s2", save, "s2", False), 20) == "saved"
        finally:
            await cutter.close()


async def _next_caller_runs(dsn: str) -> bool:
    """Whether a call of another process gets key ``k`` within a bound far below the holder's
    stall (a minute)."""
    async with AsyncConnectionPool(dsn, min_size=1, max_size=2, open=False) as pool:
        queue = PostgresKeyedQueue(pool, namespace="faults", lease=10.0)

        async def nothing() -> str:
            return "ran"

        return await queue.with_options(timeout=15).run("k", nothing) == "ran"


async def test_a_holder_killed_inside_a_long_statement_frees_the_key_within_seconds(
    postgres_dsn: str,
) -> None:
    holder = Holder(postgres_dsn, "k", 10.0, mode="sleep")  # SELECT pg_sleep(60) in its turn
    try:
        assert await holder.line() == "holding"
        await asyncio.sleep(0.2)  # let the statement start
        holder.process.send_signal(signal.SIGKILL)
        # Without the server's check for a vanished client, the key stays held until the
        # holder's statement ends, a minute later.
        assert await _next_caller_runs(postgres_dsn)
    finally:
        holder.close()


async def test_a_holder_stopped_before_its_first_statement_loses_the_key_after_its_lease(
    postgres_dsn: str,
) -> None:
    from .postgres_worker import create_schema

    create_schema(postgres_dsn)
    holder = Holder(postgres_dsn, "k", 0.5, mode="hold-idle")
    try:
        assert await holder.line() == "holding"  # its turn is open; it sent no statement yet
        holder.process.send_signal(signal.SIGSTOP)
        # The holder stays stopped throughout: only its lease can free the key.
        assert await _next_caller_runs(postgres_dsn)
        holder.process.send_signal(signal.SIGCONT)
        holder.send("go on")
        assert await holder.line() == "failed: LeaseExpired"
    finally:
        holder.close()


async def test_a_holder_stopped_inside_a_statement_past_its_lease_gets_lease_expired(
    postgres_dsn: str,
) -> None:
    holder = Holder(postgres_dsn, "k", 0.5, mode="stop-in-statement")  # SELECT pg_sleep(1)
    try:
        assert await holder.line() == "holding"
        await asyncio.sleep(0.2)  # let the statement start
        holder.process.send_signal(signal.SIGSTOP)
        # The statement ends on the server, then the transaction idles past the lease while
        # the holder is stopped: the server ends the session, and the key passes on.
        assert await _next_caller_runs(postgres_dsn)
        holder.process.send_signal(signal.SIGCONT)
        # Its commit then finds the session gone: the server said why (nothing was kept).
        assert await holder.line() == "failed: LeaseExpired"
    finally:
        holder.close()


async def nothing() -> None:
    pass


@contextlib.asynccontextmanager
async def holding(queue: PostgresKeyedQueue, key: str) -> AsyncGenerator[None, None]:
    """``key``'s turn, held by a task of ``queue`` for the body of the block."""
    held, release = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        held.set()
        await release.wait()

    holder = asyncio.create_task(queue.run(key, hold))
    await asyncio.wait_for(held.wait(), timeout=10)
    try:
        yield
    finally:
        release.set()
        await holder


@contextlib.asynccontextmanager
async def _named_pool(
    postgres_dsn: str, size: int
) -> AsyncGenerator[tuple[AsyncConnectionPool[Any], str], None]:
    """An open pool of ``size`` connections whose sessions carry an application name of their
    own (to find them in ``pg_stat_activity``), and that name."""
    application = f"keyserial-{secrets.token_hex(4)}"
    dsn = make_conninfo(postgres_dsn, application_name=application)
    async with AsyncConnectionPool(dsn, min_size=size, max_size=size, open=False) as pool:
        await pool.open(wait=True)
        yield pool, application


async def _waiting_on_locks(dsn: str, application: str) -> int:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cursor = await conn.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE application_name = %s AND wait_event_type = 'Lock' AND wait_event = 'advisory'",
            (application,),
        )
        row = await cursor.fetchone()
        return int(row[0]) if row else 0


async def test_cancelling_a_waiting_call_twice_leaves_no_session_waiting_on_the_server(
    postgres_dsn: str,
) -> None:
    async with _named_pool(postgres_dsn, 9) as (pool, application):
        async with holding(PostgresKeyedQueue(pool, namespace="c"), "k"):
            # Separate queues: each is a process of its own, each with a wait on the server
            # (in fair mode too: each is its process's only call on the key, and finds an
            # idle connection in the pool).
            queues = [PostgresKeyedQueue(pool, namespace="c") for _ in range(8)]
            waiters = [asyncio.create_task(queue.run("k", nothing)) for queue in queues]
            on_server = len(waiters)
            for _ in range(200):
                if await _waiting_on_locks(postgres_dsn, application) == on_server:
                    break
                await asyncio.sleep(0.02)
            assert await _waiting_on_locks(postgres_dsn, application) == on_server
            for waiter in waiters:
                waiter.cancel()
            await asyncio.sleep(0)  # psycopg starts cancelling each statement on the server...
            for waiter in waiters:
                waiter.cancel()  # ...and is interrupted again
            outcomes = await asyncio.gather(*waiters, return_exceptions=True)
            assert all(isinstance(o, asyncio.CancelledError) for o in outcomes), outcomes
            # Every wait is gone from the server, not left running behind a closed connection.
            assert await _waiting_on_locks(postgres_dsn, application) == 0
            for queue in queues:
                await queue.aclose()
        stats = pool.get_stats()
        assert stats["pool_size"] == stats["pool_available"]


async def test_a_wait_an_operator_cancels_reaches_the_caller_as_the_server_s_error(
    postgres_dsn: str,
) -> None:
    # An operator cancels a turn's wait for its lock (pg_cancel_backend): the server is
    # reachable and said why; the caller gets that, not "unreachable", and holds nothing.
    async with _named_pool(postgres_dsn, 4) as (pool, application):
        holder_queue = PostgresKeyedQueue(pool, namespace="cancelled")
        waiter_queue = PostgresKeyedQueue(pool, namespace="cancelled")  # another process
        async with holding(holder_queue, "k"):
            waiter = asyncio.create_task(waiter_queue.run("k", nothing))
            await until_waiting_in_server(pool, 1)
            async with await psycopg.AsyncConnection.connect(
                postgres_dsn, autocommit=True
            ) as admin:
                await admin.execute(
                    "SELECT pg_cancel_backend(pid) FROM pg_stat_activity "
                    "WHERE application_name = %s AND wait_event_type = 'Lock'",
                    (application,),
                )
            with pytest.raises(psycopg.errors.QueryCanceled, match="user request"):
                await waiter
        # Nothing of the cancelled wait is left: the key passes on, and the pool is whole.
        assert await waiter_queue.run("k", lambda: asyncio.sleep(0, "ran")) == "ran"
        await holder_queue.aclose()
        await waiter_queue.aclose()
        stats = pool.get_stats()
        assert stats["pool_size"] == stats["pool_available"]


async def test_a_turn_whose_session_ends_right_after_its_grant_begins_again(
    postgres_dsn: str,
) -> None:
    # A waiting turn is granted its key, and right after the server answered, an operator
    # ends its session (pg_terminate_backend): the key is free for the next caller. The
    # process reads the grant only then (it was held back: here, its event loop is blocked
    # meanwhile), well within the lease. Its function must not start on that ended session:
    # the turn begins again, on a live one, and the call succeeds.
    async with _named_pool(postgres_dsn, 3) as (pool, application):
        queue = PostgresKeyedQueue(pool, namespace="ended", lease=30)
        sessions: list[int] = []

        async def work() -> str:
            sessions.append(connection().info.backend_pid)
            return "ran"

        with psycopg.connect(postgres_dsn) as holder:  # another process holds the key
            holder.execute("SELECT pg_advisory_xact_lock(%s)", (lock_id("ended", "k"),))
            waiter = asyncio.create_task(queue.run("k", work))
            await until_waiting_in_server(pool, 1)
            # From here until the waiter reads its grant, this process is held back (the
            # event loop is blocked).
            holder.commit()
            with psycopg.connect(postgres_dsn, autocommit=True) as admin:
                granted = _granted_and_answered(admin, application)
                admin.execute("SELECT pg_terminate_backend(%s, 5000)", (granted,))
        assert await waiter == "ran"
        assert sessions and granted not in sessions, "the function ran on the ended session"
        assert len(sessions) == 1
        await queue.aclose()

        def whole() -> bool:  # the ended session's connection was replaced, no other lent
            stats = pool.get_stats()
            return stats["pool_size"] == stats["pool_available"] == 3

        await until(whole, "every connection of the pool back and idle")


def _granted_and_answered(admin: psycopg.Connection[Any], application: str) -> int:
    """The pid of the session of ``application`` that holds an advisory lock and has sent its
    reply (it waits for the client's next command, idle in its transaction). Blocking: the
    caller's event loop does not run meanwhile."""
    for _ in range(1000):
        row = admin.execute(
            "SELECT a.pid FROM pg_stat_activity a JOIN pg_locks l ON l.pid = a.pid "
            "WHERE a.application_name = %s AND l.locktype = 'advisory' AND l.granted "
            "AND a.state = 'idle in transaction' AND a.wait_event = 'ClientRead'",
            (application,),
        ).fetchone()
        if row is not None:
            return int(row[0])
        time.sleep(0.01)
    raise AssertionError("the waiting session was never granted its key")


async def test_an_exhausted_pool_is_reported_as_such(pools: Pools) -> None:
    pool = await pools(max_size=1, timeout=0.5)
    queue = PostgresKeyedQueue(pool, namespace="exhausted")
    async with holding(queue, "a"):  # holds the pool's only connection
        with pytest.raises(PoolExhausted, match=r"key 'b'.*max_size=1") as caught:
            await queue.run("b", nothing)
    assert isinstance(caught.value, TimeoutError)
    await queue.run("b", nothing)


async def test_timeouts_and_deadlocks_name_the_callers_keys(pools: Pools) -> None:
    queue = PostgresKeyedQueue(await pools(), namespace="names")
    other = PostgresKeyedQueue(await pools(), namespace="names")  # another process
    third = PostgresKeyedQueue(await pools(), namespace="names")  # and a third
    ids = [str(lock_id("names", key)) for key in ("seg-1", "seg-2")]
    async with holding(other, "seg-1"):
        for timed_out in (
            other.with_options(timeout=0.2).run("seg-1", nothing),  # waits in its process
            third.with_options(timeout=0.2).run("seg-1", nothing),  # waits on the server
        ):
            with pytest.raises(TimeoutError) as caught:
                await timed_out
            assert "'seg-1'" in str(caught.value)
            assert not any(lock in str(caught.value) for lock in ids)

    # A cycle across two "processes" that PostgreSQL breaks.
    first_in, second_in = asyncio.Event(), asyncio.Event()

    async def then_lock(mine: asyncio.Event, theirs: asyncio.Event, key: str, q: Any) -> None:
        mine.set()
        await theirs.wait()
        await q.run(key, nothing)

    results = await asyncio.gather(
        queue.run("seg-1", then_lock, first_in, second_in, "seg-2", queue),
        other.run("seg-2", then_lock, second_in, first_in, "seg-1", other),
        return_exceptions=True,
    )
    deadlocks = [r for r in results if isinstance(r, DeadlockError)]
    assert len(deadlocks) == 1, results
    assert deadlocks[0].keys in (["seg-1"], ["seg-2"])
    assert not any(lock in str(deadlocks[0]) for lock in ids)


async def test_a_namespace_with_nul_is_refused(pools: Pools) -> None:
    pool = await pools()
    with pytest.raises(ValueError, match="NUL"):
        PostgresKeyedQueue(pool, namespace="a\0b")
    with pytest.raises(ValueError, match="NUL"):
        lock_id("a\0", "k")


@pytest_asyncio.fixture
async def app_role(postgres_dsn: str) -> AsyncIterator[str]:
    """A login role with no privilege but CONNECT and USAGE on the schema (no CREATE)."""
    role = f"keyserial_app_{secrets.token_hex(4)}"
    async with await psycopg.AsyncConnection.connect(postgres_dsn, autocommit=True) as admin:
        await admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        await admin.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
        try:
            yield role
        finally:
            await admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            await admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


async def test_a_role_without_create_works_after_the_documented_setup_step(
    postgres_dsn: str, app_role: str
) -> None:
    as_app = make_conninfo(postgres_dsn, user=app_role)

    async def fence() -> int:
        return current_fence()

    # One connection: had the refused call kept it, the calls below would find none.
    async with AsyncConnectionPool(as_app, min_size=1, max_size=1, open=False, timeout=5) as pool:
        queue = PostgresKeyedQueue(pool, namespace="privileges")
        with pytest.raises(SetupRequired, match=r"python -m keyserial\.postgres setup"):
            await queue.run("k", fence)

        # The operator's step, as the docs give it.
        setup = await asyncio.to_thread(
            subprocess.run,
            [
                sys.executable,
                "-m",
                "keyserial.postgres",
                "setup",
                postgres_dsn,
                "--grant",
                app_role,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert setup.returncode == 0, setup.stderr
        fences = [await queue.run("k", fence) for _ in range(3)]
        assert fences == sorted(set(fences))


async def test_the_setup_sql_is_what_a_migration_needs(postgres_dsn: str, app_role: str) -> None:
    async with await psycopg.AsyncConnection.connect(postgres_dsn, autocommit=True) as admin:
        migration = setup_sql(grant_to=app_role, table="fences", streams=True)
        for statement in migration.split(";\n"):
            # One statement at a time, as a migration tool would send them.
            await admin.execute(sql.SQL(statement.rstrip(";")))  # pyright: ignore[reportArgumentType]

    async def fence() -> int:
        return current_fence()

    as_app = make_conninfo(postgres_dsn, user=app_role)
    async with AsyncConnectionPool(as_app, min_size=1, max_size=2, open=False) as pool:
        queue = PostgresKeyedQueue(pool, namespace="privileges", table="fences")
        first = await queue.run("k", fence)
        assert await queue.run("k", fence) > first
    printed = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "keyserial.postgres", "setup", "-", "--table", "fences", "--print"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert printed.stdout.strip() == setup_sql(table="fences", streams=True)


async def test_a_role_that_may_not_add_the_owner_index_is_told_once_and_still_works(
    postgres_dsn: str, app_role: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The ticket table was made by an earlier version, without its index by owner, and
    # the application's role does not own it: fair mode works, and a warning says what to
    # run, once, although the process's ticket connection opens again after an idle lease.
    async with await psycopg.AsyncConnection.connect(postgres_dsn, autocommit=True) as admin:
        for statement in setup_sql(grant_to=app_role, table="fences").split(";\n"):
            if "CREATE INDEX" not in statement:
                await admin.execute(sql.SQL(statement.rstrip(";")))  # pyright: ignore[reportArgumentType]

    async def fence() -> int:
        return current_fence()

    as_app = make_conninfo(postgres_dsn, user=app_role)
    async with AsyncConnectionPool(as_app, min_size=1, max_size=2, open=False) as pool:
        queue = PostgresKeyedQueue(
            pool, namespace="privileges", table="fences", lease=0.3, fair=True
        )
        desk = queue._turns.early.desk  # pyright: ignore[reportPrivateUsage]
        with caplog.at_level("WARNING", logger="keyserial"):
            first = await queue.run("k", fence)
            await until(lambda: desk.connection is None, "the idle ticket connection closes")
            assert await queue.run("k", fence) > first
        await queue.aclose()
    warnings = [r.getMessage() for r in caplog.records if "fences_tqo" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "python -m keyserial.postgres setup" in warnings[0]


async def test_connections_that_died_idle_in_the_pool_are_replaced(
    pools: Pools, postgres_dsn: str
) -> None:
    # The server ended the pool's connections while they sat idle (a restart, an operator):
    # the call's first statement finds each dead, and the turn begins again on another
    # instead of failing a call that never reached the server.
    pool = await pools(min_size=3, max_size=3)
    queue = PostgresKeyedQueue(pool, namespace="idle")
    async with pool.connection() as a, pool.connection() as b, pool.connection() as c:
        pids = [conn.info.backend_pid for conn in (a, b, c)]
    async with await psycopg.AsyncConnection.connect(postgres_dsn, autocommit=True) as admin:
        await admin.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) pid", (pids,))
        for _ in range(200):
            cursor = await admin.execute(
                "SELECT 1 FROM pg_stat_activity WHERE pid = ANY(%s::int[])", (pids,)
            )
            if not await cursor.fetchall():
                break
            await asyncio.sleep(0.01)

    async def backend() -> int:
        return connection().info.backend_pid

    assert await queue.run("k", backend) not in pids
    await queue.aclose()
