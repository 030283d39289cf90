"""Taking and ending turns in PostgreSQL: one transaction holds a turn's advisory locks.

A turn begins with one round trip, one query of several statements: ``BEGIN``, the settings
of the turn (``set_config(..., true)``), ``pg_advisory_xact_lock`` for each key in ascending
order, and the turn's fence: ``nextval`` of the queue's fence sequence. A sequence is not
transactional, so a turn that is rolled back (it raised, was cancelled, or stalled past its
lease) still used its fence up, and its successor gets a larger one. It ends with ``COMMIT``
(the call returned) or ``ROLLBACK`` (it raised or was cancelled), which also releases the
locks: there is no release to send, and nothing to forget when the process dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Coroutine, Hashable, Mapping
from typing import Any, TypeVar

import psycopg
from psycopg import AsyncConnection, sql
from psycopg.pq import TransactionStatus
from psycopg_pool import AsyncConnectionPool, PoolClosed, PoolTimeout

from .._errors import DeadlockError
from ._desk import EarlyTurn, connect_beside
from ._early import EarlyTurns
from ._errors import (
    CommitInDoubt,
    LeaseExpired,
    PoolExhausted,
    PostgresUnavailable,
    TurnRolledBack,
    naming,
)
from ._setup import ensure_sequence, ensure_ticket_table, sequence
from ._sql_text import every_result, query
from ._statements import TurnSql, milliseconds
from ._turn import PgTurn, SessionKeeper

Task = asyncio.Task[Any]
T = TypeVar("T")

logger = logging.getLogger("keyserial")


async def _cancelled_once(statements: Coroutine[Any, Any, T]) -> T:
    """Await ``statements`` in a task of their own that is cancelled at most once.

    Cancelled while a statement runs, psycopg asks the server to cancel it and waits until
    it has. Cancelled again meanwhile, it would close the connection at once, leaving the
    server's session running the statement, still queued for the lock: an orphan that would
    take the key when it comes free. So a second cancellation of the caller waits for the
    first to finish; the caller is cancelled all the same.
    """
    running = asyncio.ensure_future(statements)
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        running.cancel()
        while not running.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(running)
        raise


class PostgresTurns:
    """Turns of one queue's keys, as transactions on connections of the application's pool."""

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        table: str,
        schema: str | None,
        lease: float,
        fair: bool = False,
    ) -> None:
        self.pool = pool
        self.fair = fair
        #: Name the fence sequence, ``<table>_seq``, and the fence table of earlier versions.
        self.table = table
        self.schema = schema
        self.sequence = sequence(table, schema)
        self.lease = lease
        #: Whether the fence sequence is known to exist.
        self.table_ready = False
        #: task -> the turn it holds: a call of that task for another key locks it in the
        #: same transaction; for a key it holds, it runs inline.
        self.held: dict[Task, PgTurn] = {}
        #: The autocommit setting each lent connection had in the pool, restored on return.
        self.autocommit: dict[int, bool] = {}
        #: Connections this queue has lent, each watched for the server ending its session.
        self.watched: weakref.WeakSet[AsyncConnection[Any]] = weakref.WeakSet()
        #: Connections whose session the server ended for sitting idle past the lease, with
        #: its word for it (see `_watch`).
        self.timed_out: weakref.WeakKeyDictionary[AsyncConnection[Any], str] = (
            weakref.WeakKeyDictionary()
        )
        self.sql = TurnSql(self.sequence, lease)
        #: Fair mode's tickets, and the turns they begin (see _early).
        self.early = EarlyTurns(
            pool,
            table,
            schema,
            self.sql,
            self.begin_ticket,
            self.begin_direct,
            self.rollback,
        )

    async def begin(
        self,
        keys: Mapping[int, Hashable],
        deadline: float | None,
        loop: asyncio.AbstractEventLoop,
        ticket: int | None = None,
    ) -> PgTurn:
        """Take a connection and lock ``keys`` (lock id -> the caller's key) in a new transaction.

        ``ticket``: fair mode's ticket whose verdict was ``go`` (see _early); the transaction
        first takes its try-lock, which shows it in the server's queue. Connections that
        died while idle in the pool (the server restarted, or ended them) are replaced, up
        to the pool's size.

        Raises:
            As `_begin`.
        """
        turn = await self._begin(keys, deadline, loop, ticket, direct=False)
        assert turn is not None  # only a direct turn locks nothing
        return turn

    async def begin_direct(
        self, keys: Mapping[int, Hashable], deadline: float | None, loop: asyncio.AbstractEventLoop
    ) -> PgTurn | None:
        """Fair mode's direct turn (see _early): ``begin``, in the same round trip, unless a
        call of another process waits with a ticket on one of ``keys``' lines; then None,
        holding nothing.

        Raises:
            As `_begin`.
        """
        return await self._begin(keys, deadline, loop, None, direct=True)

    async def _begin(
        self,
        keys: Mapping[int, Hashable],
        deadline: float | None,
        loop: asyncio.AbstractEventLoop,
        ticket: int | None,
        *,
        direct: bool,
    ) -> PgTurn | None:
        """``begin``, or ``begin_direct`` if ``direct``.

        Raises:
            TimeoutError: the deadline passed (waiting for a connection or for the locks).
            RuntimeError: the pool is not open (never opened, or closed already).
            PoolExhausted: no connection of the pool came free within the pool's timeout.
            DeadlockError: PostgreSQL's deadlock detector chose this wait.
            PostgresUnavailable: the server could not be reached, or the connection broke.
            psycopg.Error: the server's own error, the connection still working (an
                operator cancelled the wait, for one); nothing is held.
        """
        attempts = self.pool.max_size + 1
        for attempt in range(1, attempts + 1):
            connection = await self._connection(keys, deadline, loop)
            try:
                if not self.table_ready:
                    await ensure_sequence(connection, self.table, self.schema)
                    if self.fair:  # a direct turn reads the ticket table
                        await ensure_ticket_table(connection, self.table, self.schema)
                    self.table_ready = True
                fence = await self._statements(
                    connection, keys, deadline, loop, begin=True, ticket=ticket, direct=direct
                )
            except (PostgresUnavailable, psycopg.OperationalError) as exc:
                await self._discard(connection)
                if attempt < attempts and connection.broken:
                    continue  # it holds nothing: its session ended, maybe before it was lent
                if isinstance(exc, PostgresUnavailable) or not connection.broken:
                    raise  # not broken: the server's own error (see `_wait_error`)
                raise PostgresUnavailable(f"PostgreSQL is unreachable: {exc}") from exc
            except BaseException:
                await self._discard(connection)
                raise
            if fence is None:  # another process's call waits with a ticket: nothing is held
                await self._discard(connection)
                return None
            return PgTurn(connection, fence, set(keys), ticket)
        raise AssertionError("unreachable")

    async def begin_ticket(self, early: EarlyTurn) -> PgTurn:
        """Begin the turn of a fair-mode ticket whose verdict was ``go``; no deadline (the
        call bounds the wait).

        Raises:
            As ``begin``.
        """
        return await self.begin(early.keys, None, asyncio.get_running_loop(), early.ticket)

    async def _connection(
        self, keys: Mapping[int, Hashable], deadline: float | None, loop: asyncio.AbstractEventLoop
    ) -> AsyncConnection[Any]:
        """A connection of the pool for a turn of ``keys``, watched (see `_watch`)."""
        wait = None if deadline is None else deadline - loop.time()
        if wait is not None and wait <= 0:
            raise TimeoutError(f"timed out waiting for the turn of {naming(keys)}")
        try:
            connection: AsyncConnection[Any] = await self.pool.getconn(timeout=wait)
        except PoolClosed as exc:
            raise RuntimeError(
                f"the connection pool of the queue is not open ({exc}): open it before the "
                "first call, with 'await pool.open()' or 'async with AsyncConnectionPool(...) "
                "as pool', and close it only after the queue's last call"
            ) from exc
        except PoolTimeout as exc:
            if deadline is not None and loop.time() >= deadline:
                raise TimeoutError(
                    f"timed out waiting for a connection for the turn of {naming(keys)}"
                ) from exc
            unreachable = await _unreachable(self.pool)
            if unreachable is None:
                raise PoolExhausted(
                    f"no connection for the turn of {naming(keys)}: every connection of the "
                    f"pool (max_size={self.pool.max_size}) stayed in use for its timeout "
                    f"({self.pool.timeout:g} s); a process holds one per key it runs or waits "
                    "for in the database: raise the pool's max_size"
                ) from exc
            raise PostgresUnavailable(f"PostgreSQL is unreachable: {unreachable}") from exc
        except psycopg.OperationalError as exc:
            raise PostgresUnavailable(f"PostgreSQL is unreachable: {exc}") from exc
        self._watch(connection)
        return connection

    def _watch(self, connection: AsyncConnection[Any]) -> None:
        """Note when the server ends ``connection``'s session for idling past the lease.

        The server's FATAL (SQLSTATE 25P03) may arrive while libpq thinks the connection is
        idle (the process was stopped with a statement's reply in hand); libpq then gives it
        to the notice handlers, not to the next command, whose failure reads as a lost
        connection. This handler keeps the server's word for the commit (see `commit`).
        """
        self.timed_out.pop(connection, None)  # a new turn on this connection
        if connection in self.watched:
            return
        self.watched.add(connection)
        reference = weakref.ref(connection)

        def on_notice(diagnostic: psycopg.errors.Diagnostic) -> None:
            watched = reference()
            if watched is not None and diagnostic.sqlstate == "25P03":
                self.timed_out[watched] = diagnostic.message_primary or "25P03"

        connection.add_notice_handler(on_notice)

    async def extend(
        self,
        turn: PgTurn,
        keys: Mapping[int, Hashable],
        deadline: float | None,
        loop: asyncio.AbstractEventLoop,
    ) -> int:
        """Lock more ``keys`` in ``turn``'s transaction (a nested call); their first fence."""
        fence = await self._statements(turn.connection, keys, deadline, loop, begin=False)
        assert fence is not None  # only a direct turn locks nothing
        turn.keys.update(keys)
        return fence

    async def _statements(
        self,
        connection: AsyncConnection[Any],
        keys: Mapping[int, Hashable],
        deadline: float | None,
        loop: asyncio.AbstractEventLoop,
        *,
        begin: bool,
        ticket: int | None = None,
        direct: bool = False,
    ) -> int | None:
        """Run the turn's statements; its fence, or None if a ``direct`` turn locked nothing."""
        lock_timeout = "0"  # wait as long as it takes
        if deadline is not None:
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError(f"timed out waiting for the turn of {naming(keys)}")
            lock_timeout = milliseconds(left)
        try:
            if begin:
                # The turn sends BEGIN itself, in its first query: psycopg's implicit BEGIN would
                # cost a round trip of its own. Autocommit is a local setting, restored when
                # the connection goes back to the pool.
                self.autocommit[id(connection)] = connection.autocommit
                await connection.set_autocommit(True)
            others = self.early.desk.sql.others_waiting(sorted(keys)) if direct else None
            statements = self.sql.first(
                sorted(keys), lock_timeout, connection.info.server_version, begin, ticket, others
            )
            last = await _cancelled_once(_last_row(connection, query(statements)))
        except psycopg.Error as exc:
            error = _wait_error(exc, keys, connection)
            if error is exc:
                raise
            raise error from exc
        assert last is not None
        if direct and last[1] != "false":
            return None
        return int(last[0])

    async def commit(
        self, turn: PgTurn, *, stalled: bool = False, early: EarlyTurn | None = None
    ) -> None:
        """End the turn: commit its transaction (the locks go with it), give the connection back.

        ``stalled``: the process stopped running for longer than the lease during the turn.
        ``early``: the call's fair-mode turn; if the next ticket of its line follows it, the
        same round trip begins that ticket's turn on this connection, which then stays with
        it (see ``EarlyTurns.hand_over``).

        Raises:
            TurnRolledBack: the transaction had failed already; it was rolled back.
            LeaseExpired: the server had ended the session (idle past the lease).
            PostgresUnavailable: the session was gone before the commit: nothing was kept.
            CommitInDoubt: the connection broke while the commit was on its way, or the
                server ended the session while the round trip that began the next turn
                was on its way.
        """
        connection = turn.connection
        if connection.pgconn.transaction_status == TransactionStatus.INERROR:
            # COMMIT would roll back quietly: the function caught a database error.
            await self._discard(connection)
            raise TurnRolledBack(
                "the turn's transaction failed before the function returned (a database error "
                "was caught inside the turn, or a nested turn failed); nothing of it was kept"
            )
        if connection.broken or connection.closed:
            await self._discard(connection)
            if stalled:
                raise _lease_expired("before its commit")
            raise PostgresUnavailable("the turn's connection was lost before its commit")
        closing = self.early.closing(turn, early, connection.info.server_version)
        follower = closing.follower
        try:
            results = await every_result(await connection.execute(query(closing.statements)))
        except BaseException as exc:
            if follower is not None:
                self.early.handed(follower, None)
            await self._discard(connection)
            error = _commit_error(exc, self.timed_out.get(connection), follower is not None)
            if error is exc:
                raise
            raise error from exc
        if self.early.closed(turn, closing, results) is not None:
            self._watch(connection)  # it holds the follower's turn now
            return
        if follower is not None:  # its transaction began without the locks
            await self._discard(connection)
            return
        await connection.set_autocommit(self.autocommit.pop(id(connection), False))
        await self.pool.putconn(connection)

    async def rollback(self, turn: PgTurn) -> None:
        """End the turn without keeping its writes; never raises (a broken session is dropped)."""
        await self._discard(turn.connection)

    async def _discard(self, connection: AsyncConnection[Any]) -> None:
        """Roll back whatever is open and give the connection back (the pool drops a broken one).

        Shielded: a caller cancelled again meanwhile must not leave the connection out of
        its pool, nor its transaction open. It is cancelled all the same, once the
        connection is back: when its task ends, it holds no connection.
        """
        returning = asyncio.ensure_future(self._roll_back_and_return(connection))
        try:
            await asyncio.shield(returning)
        except asyncio.CancelledError:
            while not returning.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(returning)
            raise

    async def _roll_back_and_return(self, connection: AsyncConnection[Any]) -> None:
        with contextlib.suppress(Exception):
            if connection.pgconn.transaction_status != TransactionStatus.IDLE:
                await connection.execute("ROLLBACK")
        with contextlib.suppress(Exception):
            await connection.set_autocommit(self.autocommit.pop(id(connection), False))
        with contextlib.suppress(Exception):
            await self.pool.putconn(connection)

    async def enter(
        self,
        task: Task,
        keys: Mapping[int, Hashable],
        deadline: float | None,
        early: EarlyTurn | None = None,
    ) -> tuple[PgTurn, SessionKeeper | None]:
        """``task``'s turn of ``keys``, and its keeper (None: it runs inside an outer turn).

        ``early``: the turn `register` began for this call (fair mode); it is taken up.
        """
        loop = asyncio.get_running_loop()
        outer = self.held.get(task)
        if outer is not None:
            if early is not None:
                await self.early.withdraw(early)
            missing = {key: name for key, name in keys.items() if key not in outer.keys}
            if not missing:  # re-entry: the outer turn holds every key
                return outer, None
            fence = await self.extend(outer, missing, deadline, loop)
            return PgTurn(outer.connection, fence, outer.keys), None  # commits with the outer
        since = loop.time()  # before the turn's first query: its idle timer starts later
        direct: PgTurn | None = None
        if early is not None and early.direct:
            direct = await self.early.take_direct(early, deadline, loop)
        if direct is not None:
            turn = direct
        elif early is not None:
            turn = await self.early.take_up(early, deadline, loop)
            since = early.since
        else:
            turn = await self.begin(keys, deadline, loop)
        turn, since = await self._confirmed(turn, since, keys, deadline, loop)
        self.held[task] = turn
        return turn, SessionKeeper(turn.connection, self.lease, since)

    async def _confirmed(
        self,
        turn: PgTurn,
        since: float,
        keys: Mapping[int, Hashable],
        deadline: float | None,
        loop: asyncio.AbstractEventLoop,
    ) -> tuple[PgTurn, float]:
        """``turn``, once its session is known to be alive, and when it last answered.

        The locks may be granted long after the turn's first query was sent (a long wait in
        the server's queue), and the reply may reach a process that was paused since: by the
        local measure, the server may have ended the idle session meanwhile, and the next
        caller may hold the key. So a turn with less than two thirds of its lease left by
        that measure sends ``SELECT 1`` first, which also restarts the server's idle timer.
        A turn with more left reads what has already arrived after the reply, without
        waiting: a session the server ended right after it answered (an operator's
        ``pg_terminate_backend``, a server shutting down) has sent its last word and closed,
        and its locks are free for the next caller. Either way, a session the server ended
        is given up and the turn begun again, without an error. Its function never starts on
        a lease that may have run out, nor on a session already known to be gone.
        """
        while True:
            if loop.time() - since < self.lease / 3:
                if not _ended_already(turn.connection):
                    return turn, since
            else:
                asked = loop.time()
                try:
                    await _cancelled_once(turn.connection.execute("SELECT 1"))
                    since = asked  # measured again: its reply may have come late too
                    continue
                except BaseException as exc:
                    if not isinstance(exc, psycopg.Error):  # else the session is gone
                        await self._discard(turn.connection)
                        raise
            await self._discard(turn.connection)
            since = loop.time()
            turn = await self.begin(keys, deadline, loop)

    async def leave(
        self,
        task: Task,
        turn: PgTurn,
        keeper: SessionKeeper | None,
        failed: bool,
        early: EarlyTurn | None = None,
    ) -> None:
        """End a turn ``enter`` gave: commit it, or roll it back if its call ``failed``.

        A turn inside an outer one (``keeper`` None) ends with the outer turn.

        Raises:
            TurnRolledBack, LeaseExpired, PostgresUnavailable, CommitInDoubt: as for
                ``commit``.
        """
        if keeper is None:
            return
        del self.held[task]
        stalled = keeper.stalled_past_lease()
        await keeper.stop()
        if failed:
            await self.rollback(turn)
        else:
            await self.commit(turn, stalled=stalled, early=early)


def _ended_already(connection: AsyncConnection[Any]) -> bool:
    """Whether the server has ended ``connection``'s session, as far as what has already
    arrived tells: it reads without waiting (the session is idle in its transaction, so no
    reply is due)."""
    if connection.broken:
        return True
    try:
        connection.pgconn.consume_input()  # a closed session: its FATAL, then end of stream
    except psycopg.OperationalError:
        return True
    return False


async def _unreachable(pool: AsyncConnectionPool[Any]) -> str | None:
    """Why ``pool``'s server cannot be reached, or None if it can (the pool was only full).

    Asked only after the pool gave no connection within its timeout: a pool whose
    server is down times out the same way as one whose connections are all in use.
    """
    try:
        probe = await connect_beside(pool, connect_timeout=5)
    except psycopg.Error as exc:
        return str(exc)
    await probe.close()
    return None


def _wait_error(
    exc: psycopg.Error, keys: Mapping[int, Hashable], connection: AsyncConnection[Any]
) -> BaseException:
    """What a turn reports when the statements that wait for its locks, on ``connection``,
    failed with ``exc``.

    A failure that left the connection working is the server's own word (an operator
    cancelled the wait, say), reported as it is: the server is reachable.
    """
    if isinstance(exc, psycopg.errors.LockNotAvailable):  # its lock_timeout: the deadline
        return TimeoutError(f"timed out waiting for the turn of {naming(keys)}")
    if isinstance(exc, psycopg.errors.DeadlockDetected):
        return DeadlockError(
            f"deadlock: PostgreSQL broke a cycle of transactions waiting for each other, "
            f"this one waiting for {naming(keys)}",
            keys=list(keys.values()),
            tasks=[],
        )
    if isinstance(exc, psycopg.InterfaceError) or (
        isinstance(exc, psycopg.OperationalError) and connection.broken
    ):
        return PostgresUnavailable(f"PostgreSQL is unreachable: {exc}")
    return exc


async def _last_row(
    connection: AsyncConnection[Any], statements: sql.SQL
) -> tuple[Any, ...] | None:
    """Send ``statements`` (as one simple query); the last statement's row."""
    cursor = await connection.execute(statements)
    while cursor.nextset():
        pass
    return await cursor.fetchone()


def turn_error(exc: BaseException, turn: PgTurn, keeper: SessionKeeper | None) -> BaseException:
    """What a call reports when its function raised ``exc`` inside ``turn``.

    The server ending the turn's session is reported as the backend's own error; any other
    exception, the function's own, reaches the caller unchanged.
    """
    if not isinstance(exc, psycopg.Error):
        return exc
    stalled = keeper is not None and keeper.stalled_past_lease()
    if isinstance(exc, psycopg.errors.IdleInTransactionSessionTimeout) or (
        stalled and turn.connection.broken
    ):
        return _lease_expired(f"({exc})")
    if isinstance(exc, psycopg.OperationalError) and turn.connection.broken:
        # The server ended the session (restart, network): nothing of the turn was committed.
        return PostgresUnavailable(f"the turn's connection was lost: {exc}")
    return exc


def _lease_expired(detail: str) -> LeaseExpired:
    return LeaseExpired(
        "the server ended the turn's session: its transaction sat idle longer than the lease "
        f"while this process was stopped; nothing of it was kept {detail}"
    )


def _commit_error(
    exc: BaseException, timed_out: str | None = None, begins_next: bool = False
) -> BaseException:
    """What a failed ``COMMIT`` means for the turn's writes.

    Only the server's word counts here: a commit whose reply was lost is in doubt even after
    a stall, since the keeper's view of the stall is an estimate. ``timed_out``: the server
    said, in a notice, that it ended the session for idling past the lease.
    ``begins_next``: the query went on after the COMMIT, beginning the next turn; the
    statements of that part fail only when the server ends the session (an operator's
    intervention, SQLSTATE class 57), which may have come after the COMMIT.
    """
    if (
        begins_next
        and isinstance(exc, psycopg.OperationalError)
        and (exc.sqlstate or "").startswith("57")
    ):
        return CommitInDoubt(
            "the server ended the session while the turn's COMMIT was on its way: its writes "
            f"may or may not have been kept; read them back before retrying ({exc})"
        )
    if isinstance(exc, psycopg.errors.IdleInTransactionSessionTimeout):
        return _lease_expired(f"before its commit ({exc})")
    if timed_out is not None and isinstance(
        exc, (psycopg.OperationalError, psycopg.InterfaceError)
    ):
        return _lease_expired(f"before its commit (the server said: {timed_out})")
    if not isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)):
        return exc
    if (exc.sqlstate or "").startswith("40"):
        # The server refused the transaction (a serialization failure, a deadlock): its own
        # error, which an application retries as it would any such failure; nothing was kept.
        return exc
    if exc.sqlstate is not None or isinstance(exc, psycopg.InterfaceError):
        # The server answered with an error, or the connection was closed before the
        # COMMIT could be sent: it was not committed.
        return PostgresUnavailable(f"the turn's transaction could not be committed: {exc}")
    return CommitInDoubt(
        "the connection broke while the turn's COMMIT was on its way: its writes may or may "
        f"not have been kept; read them back before retrying ({exc})"
    )
