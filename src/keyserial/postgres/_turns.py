"""Taking and ending turns in PostgreSQL: one transaction holds a turn's advisory locks.

A turn begins with one round trip, in pipeline mode: ``BEGIN``, the session settings of the
turn (``SET LOCAL``), ``pg_advisory_xact_lock`` for each key in ascending order, and the
turn's fence: ``nextval`` of the queue's fence sequence. A sequence is not transactional, so
a turn that is rolled back (it raised, was cancelled, or stalled past its lease) still used
its fence up, and its successor gets a larger one. It ends with ``COMMIT`` (the call
returned) or ``ROLLBACK`` (it raised or was cancelled), which also releases the locks: there
is no release to send, and nothing to forget when the process dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import AsyncConnection, sql
from psycopg.pq import TransactionStatus
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from .._errors import DeadlockError
from ._turn import PgTurn, SessionKeeper

Task = asyncio.Task[Any]

logger = logging.getLogger("keyserial")

#: The advisory lock taken while the fence table is created (by whichever process is first).
_SCHEMA_LOCK = 0x6B65797365726961  # "keyseria"


class TurnRolledBack(RuntimeError):
    """The function returned, but its transaction had already failed: nothing was kept.

    A database error inside the turn aborts its transaction; a function that catches the
    error and returns normally would otherwise have its writes rolled back in silence.
    The turn's transaction was rolled back, and the function's result is not returned.
    Use a savepoint (``async with connection().transaction():``) around a statement whose
    error you mean to handle.

    Example:
        ```pycon
        >>> issubclass(TurnRolledBack, RuntimeError)
        True

        ```
    """


class PostgresUnavailable(ConnectionError):
    """PostgreSQL could not be reached, or the connection broke; the call did not complete.

    Nothing of the call's transaction was committed. Once the server is back, the queue
    works again without being recreated.

    Example:
        ```pycon
        >>> issubclass(PostgresUnavailable, ConnectionError)
        True

        ```
    """


def _milliseconds(seconds: float) -> str:
    return f"{max(1, int(seconds * 1000))}ms"


class PostgresTurns:
    """Turns of one queue's keys, as transactions on connections of the application's pool."""

    def __init__(
        self, pool: AsyncConnectionPool[Any], table: tuple[str, ...], lease: float
    ) -> None:
        self.pool = pool
        self.table = sql.Identifier(*table)
        #: The fence sequence, named after ``table`` (whose rows fences once came from).
        self.sequence = sql.Identifier(*table[:-1], table[-1] + "_seq")
        self.lease = lease
        self.table_ready = False
        #: task -> the turn it holds: a call of that task for another key locks it in the
        #: same transaction; for a key it holds, it runs inline.
        self.held: dict[Task, PgTurn] = {}
        #: The autocommit setting each lent connection had in the pool, restored on return.
        self.autocommit: dict[int, bool] = {}
        quoted = ('"' + part.replace('"', '""') + '"' for part in (*table[:-1], table[-1] + "_seq"))
        self.next_fence = sql.SQL("SELECT nextval({})").format(sql.Literal(".".join(quoted)))

    async def _create_table(self, connection: AsyncConnection[Any]) -> None:
        """Create the fence sequence if it is missing (by whichever process is first).

        Fences continue above those of a fence table of an earlier version, if there is one.
        A role without ``CREATE`` on the schema can use a sequence made beforehand.
        """
        async with connection.transaction():
            found = await connection.execute(
                "SELECT to_regclass(%s)", (self.sequence.as_string(connection),)
            )
            row = await found.fetchone()
            if row is not None and row[0] is not None:
                self.table_ready = True
                return
            await connection.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            await connection.execute(
                sql.SQL("CREATE SEQUENCE IF NOT EXISTS {}").format(self.sequence)
            )
            old = await connection.execute(
                "SELECT to_regclass(%s)",
                (self.table.as_string(connection),),
            )
            row = await old.fetchone()
            if row is not None and row[0] is not None:
                await connection.execute(
                    sql.SQL(
                        "SELECT setval({seq}, max(fence)) FROM {table} "
                        "HAVING max(fence) > (SELECT last_value FROM {seq_name})"
                    ).format(
                        seq=sql.Literal(self.sequence.as_string(connection)),
                        table=self.table,
                        seq_name=self.sequence,
                    )
                )
        self.table_ready = True

    async def begin(
        self, keys: Sequence[int], deadline: float | None, loop: asyncio.AbstractEventLoop
    ) -> PgTurn:
        """Take a connection and lock ``keys`` (ascending) in a new transaction.

        Raises:
            TimeoutError: the deadline passed (waiting for a connection or for the locks).
            DeadlockError: PostgreSQL's deadlock detector chose this wait.
            PostgresUnavailable: the server could not be reached, or the connection broke.
        """
        wait = None if deadline is None else deadline - loop.time()
        if wait is not None and wait <= 0:
            raise TimeoutError("timed out waiting for the turn")
        try:
            connection = await self.pool.getconn(timeout=wait)
        except PoolTimeout as exc:
            if deadline is not None and loop.time() >= deadline:
                raise TimeoutError("timed out waiting for a connection for the turn") from exc
            raise PostgresUnavailable(f"no PostgreSQL connection: {exc}") from exc
        except psycopg.OperationalError as exc:
            raise PostgresUnavailable(f"PostgreSQL is unreachable: {exc}") from exc
        try:
            if not self.table_ready:
                await self._create_table(connection)
            return await self._lock(connection, keys, deadline, loop)
        except BaseException:
            await self._discard(connection)
            raise

    async def extend(
        self,
        turn: PgTurn,
        keys: Sequence[int],
        deadline: float | None,
        loop: asyncio.AbstractEventLoop,
    ) -> int:
        """Lock more ``keys`` in ``turn``'s transaction (a nested call); their first fence."""
        fence = await self._statements(turn.connection, keys, deadline, loop, begin=False)
        turn.keys.update(keys)
        return fence

    async def _lock(
        self,
        connection: AsyncConnection[Any],
        keys: Sequence[int],
        deadline: float | None,
        loop: asyncio.AbstractEventLoop,
    ) -> PgTurn:
        fence = await self._statements(connection, keys, deadline, loop, begin=True)
        return PgTurn(connection, fence, set(keys))

    async def _statements(
        self,
        connection: AsyncConnection[Any],
        keys: Sequence[int],
        deadline: float | None,
        loop: asyncio.AbstractEventLoop,
        *,
        begin: bool,
    ) -> int:
        lock_timeout = "0"  # wait as long as it takes
        if deadline is not None:
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError("timed out waiting for the turn")
            lock_timeout = _milliseconds(left)
        try:
            if begin:
                # The turn sends BEGIN itself, in the pipeline: psycopg's implicit BEGIN would
                # cost a round trip of its own. Autocommit is a local setting, restored when
                # the connection goes back to the pool.
                self.autocommit[id(connection)] = connection.autocommit
                await connection.set_autocommit(True)
            # One round trip: BEGIN, the turn's settings, the locks, the fences.
            async with connection.pipeline():
                if begin:
                    await connection.execute("BEGIN")
                    await connection.execute(
                        "SELECT set_config('idle_in_transaction_session_timeout', %s, true)",
                        (_milliseconds(self.lease),),
                    )
                await connection.execute(
                    "SELECT set_config('lock_timeout', %s, true)", (lock_timeout,)
                )
                for key in sorted(keys):
                    await connection.execute("SELECT pg_advisory_xact_lock(%s)", (key,))
                await connection.execute("SET LOCAL lock_timeout TO DEFAULT")
                fence = await connection.execute(self.next_fence)  # after the locks: ordered
            first = await fence.fetchone()
        except psycopg.errors.LockNotAvailable as exc:
            raise TimeoutError("timed out waiting for the turn") from exc
        except psycopg.errors.DeadlockDetected as exc:
            raise DeadlockError(
                f"deadlock: PostgreSQL broke a cycle of transactions waiting for each other "
                f"({exc})",
                keys=list(keys),
                tasks=[],
            ) from exc
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            raise PostgresUnavailable(f"PostgreSQL is unreachable: {exc}") from exc
        assert first is not None
        return int(first[0])

    async def commit(self, turn: PgTurn) -> None:
        """End the turn: commit its transaction (the locks go with it), give the connection back.

        Raises:
            TurnRolledBack: the transaction had failed already; it was rolled back.
            PostgresUnavailable: the commit did not go through (the session was ended or the
                connection broke): nothing of the turn was kept.
        """
        connection = turn.connection
        if connection.pgconn.transaction_status == TransactionStatus.INERROR:
            # COMMIT would roll back quietly: the function caught a database error.
            await self._discard(connection)
            raise TurnRolledBack(
                "the turn's transaction failed before the function returned (a database error "
                "was caught inside the turn, or a nested turn failed); nothing of it was kept"
            )
        try:
            await connection.execute("COMMIT")
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            await self._discard(connection)
            raise PostgresUnavailable(
                f"the turn's transaction could not be committed: {exc}"
            ) from exc
        except BaseException:
            await self._discard(connection)
            raise
        await connection.set_autocommit(self.autocommit.pop(id(connection), False))
        await self.pool.putconn(connection)

    async def rollback(self, turn: PgTurn) -> None:
        """End the turn without keeping its writes; never raises (a broken session is dropped)."""
        await self._discard(turn.connection)

    async def _discard(self, connection: AsyncConnection[Any]) -> None:
        """Roll back whatever is open and give the connection back (the pool drops a broken one).

        Shielded: a caller cancelled again meanwhile must not leave the connection out of
        its pool, nor its transaction open.
        """
        await asyncio.shield(self._roll_back_and_return(connection))

    async def _roll_back_and_return(self, connection: AsyncConnection[Any]) -> None:
        with contextlib.suppress(Exception):
            if connection.pgconn.transaction_status != TransactionStatus.IDLE:
                await connection.execute("ROLLBACK")
        with contextlib.suppress(Exception):
            await connection.set_autocommit(self.autocommit.pop(id(connection), False))
        with contextlib.suppress(Exception):
            await self.pool.putconn(connection)

    async def enter(
        self, task: Task, keys: Sequence[int], deadline: float | None
    ) -> tuple[PgTurn, SessionKeeper | None]:
        """``task``'s turn of ``keys``, and its keeper (None: it runs inside an outer turn)."""
        loop = asyncio.get_running_loop()
        outer = self.held.get(task)
        if outer is not None:
            missing = [key for key in keys if key not in outer.keys]
            if not missing:  # re-entry: the outer turn holds every key
                return outer, None
            fence = await self.extend(outer, missing, deadline, loop)
            return PgTurn(outer.connection, fence, outer.keys), None  # commits with the outer
        turn = await self.begin(keys, deadline, loop)
        self.held[task] = turn
        return turn, SessionKeeper(turn.connection, self.lease)

    async def leave(
        self, task: Task, turn: PgTurn, keeper: SessionKeeper | None, failed: bool
    ) -> None:
        """End a turn ``enter`` gave: commit it, or roll it back if its call ``failed``.

        A turn inside an outer one (``keeper`` None) ends with the outer turn.

        Raises:
            PostgresUnavailable: the commit did not go through; nothing of the turn was kept.
        """
        if keeper is None:
            return
        del self.held[task]
        await keeper.stop()
        if failed:
            await self.rollback(turn)
        else:
            await self.commit(turn)
