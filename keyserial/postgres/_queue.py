"""``PostgresKeyedQueue``: the in-process order, with turns held by PostgreSQL transactions."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Iterable, Mapping
from typing import Any, ParamSpec, TypeVar

from psycopg_pool import AsyncConnectionPool

from .._errors import called, check_function
from .._options import MultiKeyWaitOptions, deprecated_call
from .._protocols import KeyLock
from .._queue import KeyedSerialQueue
from .._stats import QueueStats
from .._turns import enter_turn, leave_turn
from ._desk import EarlyTurn
from ._ids import lock_id
from ._lock import PostgresLock
from ._setup import check_names
from ._turns import PostgresTurns, turn_error

T = TypeVar("T")
P = ParamSpec("P")
Task = asyncio.Task[Any]

#: The shortest lease accepted, in seconds.
MIN_LEASE = 0.1


class PostgresKeyedQueue:
    """A keyed serial queue whose turns are PostgreSQL transactions holding advisory locks.

    Calls with the same key, made in any process connected to the same database with the
    same ``namespace``, run one at a time; within one process in registration order.
    Across processes, by default, turns are granted in the order each process's next call
    reaches the server's lock manager, so a later call of one process can run before an
    earlier call still queued inside another. With ``fair=True`` every call takes a ticket
    (a row of the queue's ticket table) when it registers, and turns follow the tickets'
    order, whatever the process. A turn is a
    transaction: it holds ``pg_advisory_xact_lock`` on the key, and the function's
    statements on [connection][keyserial.postgres.connection] run in that same
    transaction. They commit together with the end of the turn when the function returns,
    and roll back when it raises or is cancelled. A holder whose process dies, stalls or
    loses its connection cannot commit anything: its transaction is rolled back and its
    locks released, by the server.

    By default only the first call of a key in a process waits in the database (the others
    wait in the process, behind it), so a process uses one connection per key it is
    running or waiting for. With ``fair=True`` a waiting call holds a ticket, not a
    connection: a process uses one connection per key it runs, one per key whose next
    call is its own, and one of its own for its tickets. An uncontended call costs two
    round trips: ``BEGIN`` with the lock and the fence in one, ``COMMIT``; in fair mode, one
    more to register its ticket.

    Args:
        pool: the application's ``psycopg_pool.AsyncConnectionPool`` (connections in the
            default, non-autocommit mode).
        namespace: separates queues sharing one database; all processes of one queue must
            use the same one. Keys map to advisory-lock ids by a 64-bit hash of the
            namespace and the key.
        lease: seconds a turn's transaction may sit idle before the server ends it
            (``idle_in_transaction_session_timeout``, set for the turn): the longest a
            stalled holder keeps its key. A live call is kept alive by a ``SELECT 1``
            every third of it while it works outside the database.
        max_pending: per-key bound on this process's running plus waiting calls.
        table: names the fence sequence, ``<table>_seq``, and fair mode's ticket table,
            ``<table>_tq``, created on first use if missing (fences continue above those of
            a fence table of that name from an earlier version). At most 59 bytes, so that
            the sequence's name fits PostgreSQL's 63.
        schema: the schema of the sequence and the ticket table (by default the
            connection's search path; fair mode's statements that run after the function
            name the schema where it found the ticket table first).
        fair: grant turns across processes in the order the calls registered their tickets
            (see above). Every process of one queue should use the same setting.

    Raises:
        TypeError: ``pool`` is not a ``psycopg_pool.AsyncConnectionPool``, or
            ``namespace`` is not a ``str``.
        ValueError: ``namespace`` is empty or contains NUL, ``lease`` is not a finite number of
            seconds of at least ``MIN_LEASE``, or ``table`` or ``schema`` is empty or longer
            than PostgreSQL keeps a name (the message says the limit).

    Example:
        ```python
        from psycopg_pool import AsyncConnectionPool
        from keyserial import serialized
        from keyserial.postgres import PostgresKeyedQueue, connection

        pool = AsyncConnectionPool("postgresql://app@db/app", open=False)
        queue = PostgresKeyedQueue(pool, namespace="transcripts")

        @serialized(key="seg_id", queue=queue)
        async def finalize(seg_id: str, text: str) -> None:
            await connection().execute(
                "UPDATE segment SET text = %s, state = 'final' WHERE id = %s", (text, seg_id)
            )
        ```
    """

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        namespace: str,
        lease: float = 10.0,
        *,
        max_pending: int | None = None,
        table: str = "keyserial_fences",
        schema: str | None = None,
        fair: bool = False,
    ) -> None:
        if not isinstance(pool, AsyncConnectionPool):
            module = type(pool).__module__
            why = ""
            if module.partition(".")[0] == "asyncpg":
                why = " (asyncpg is not supported: see Drivers on the PostgreSQL page)"
            raise TypeError(
                "PostgresKeyedQueue needs a psycopg_pool.AsyncConnectionPool, not "
                f"{module}.{type(pool).__qualname__}{why}"
            )
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str, not {type(namespace).__name__}")
        if not namespace:
            raise ValueError("namespace must be a non-empty string")
        if "\0" in namespace:
            raise ValueError(f"namespace must not contain a NUL character, got {namespace!r}")
        if not (isinstance(lease, (int, float)) and math.isfinite(lease) and lease >= MIN_LEASE):
            raise ValueError(
                f"lease must be a finite number of seconds >= {MIN_LEASE}, got {lease!r}"
            )
        if not isinstance(fair, bool):
            raise TypeError(f"fair must be True or False, not {fair!r}")
        check_names(table, schema)
        self._namespace = namespace
        self._lease = float(lease)
        self._local = KeyedSerialQueue(max_pending=max_pending)
        self._turns = PostgresTurns(pool, table, schema, self._lease, fair)

    @property
    def lease(self) -> float:
        """Seconds a turn's transaction may sit idle before the server ends it."""
        return self._lease

    @property
    def fair(self) -> bool:
        """Whether turns follow the order in which calls reached the server, across processes."""
        return self._turns.fair

    def _early_turn(self, ids: Mapping[int, Hashable], task: Task | None) -> EarlyTurn | None:
        """Fair mode: this call's turn, begun now; None by default or inside a turn."""
        if not self._turns.fair or (task is not None and task in self._turns.held):
            return None
        return self._turns.early.register(ids)

    def _ids(self, keys: Iterable[Hashable]) -> dict[int, Hashable]:
        """Each key's advisory-lock id, mapped to the key (which errors name)."""
        return {lock_id(self._namespace, key): key for key in keys}

    async def _turn(
        self,
        keys: Mapping[int, Hashable],
        fn: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        deadline: float | None,
        early: EarlyTurn | None = None,
    ) -> T:
        """Run ``fn`` in a transaction holding ``keys`` (the process's own turn is held)."""
        task: Task = asyncio.current_task()  # type: ignore[assignment]
        turn, keeper = await self._turns.enter(task, keys, deadline, early)
        record = enter_turn(task, turn, tuple(keys), fn)
        try:
            result = await called(fn, args, kwargs)
        except BaseException as exc:
            leave_turn(task, record)
            await self._turns.leave(task, turn, keeper, failed=True, early=early)
            error = turn_error(exc, turn, keeper)
            if error is exc:
                raise
            raise error from exc
        leave_turn(task, record)
        await self._turns.leave(task, turn, keeper, failed=False, early=early)
        return result

    def run(
        self, key: Hashable, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs
    ) -> Coroutine[Any, Any, T]:
        """Run ``await fn(*args, **kwargs)`` in a transaction holding ``key``'s turn.

        The function's statements on [connection][keyserial.postgres.connection] commit
        when it returns, and roll back when it raises or is cancelled.

        Raises:
            TypeError: ``key`` is not a str, bytes, int or a tuple of them.
            PostgresUnavailable: the database could not be reached, or the turn's
                transaction could not be committed (nothing of it was kept).
            DeadlockError: PostgreSQL broke a cycle of turns waiting for each other.
            RuntimeError: the pool is not open (open it before the first call).
            QueueClosed, QueueFull: as for [KeyedSerialQueue][keyserial.KeyedSerialQueue].
            psycopg.Error: the server's own error, from the function's statements or from
                its commit, or while the turn waited for its locks on a connection that
                still works (an operator cancelled the wait); nothing of the turn was kept.
        """
        check_function(fn, "run")
        return self._call(key, fn, args, kwargs, None, None)

    async def _call(
        self,
        key: Hashable,
        fn: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None,
        group: Hashable | None,
    ) -> T:
        """``run`` with a bound on the wait for the turn (in the process and in the database).

        On expiry the built-in ``TimeoutError`` is raised, ``fn`` never starts, and the
        server-side wait is cancelled (``lock_timeout``).

        Raises:
            ValueError: ``group`` is given (coalescing is in-process only).
            TimeoutError: the turn did not come within ``timeout`` seconds.
            TypeError, PostgresUnavailable, DeadlockError, QueueClosed, QueueFull: as
                for ``run``.
        """
        if group is not None:  # with_options takes no group here: only call() passes one
            raise ValueError("PostgresKeyedQueue does not coalesce: group= is in-process only")
        ids = self._ids((key,))
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        # Without a bound, the in-process queue's own run: its fastest path.
        local = self._local if timeout is None else self._local.with_options(timeout=timeout)
        early = self._early_turn(ids, asyncio.current_task())
        try:
            return await local.run(key, self._turn, ids, fn, args, kwargs, deadline, early)
        finally:
            if early is not None:
                await self._turns.early.withdraw(early)  # nothing to do once the call took it up

    call = deprecated_call

    def submit(
        self, key: Hashable, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs
    ) -> asyncio.Task[T]:
        """Start ``run`` as a new task, registered in this process before returning."""
        check_function(fn, "submit")
        return self._submit(key, fn, args, kwargs, None, None)

    def _submit(
        self,
        key: Hashable,
        fn: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None,
        group: Hashable | None,
    ) -> asyncio.Task[T]:
        if group is not None:  # with_options takes no group here
            raise ValueError(f"{type(self).__name__} does not coalesce: group= is in-process only")
        ids = self._ids((key,))
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        local = self._local.with_options(timeout=timeout)
        early = self._early_turn(ids, None)  # a task of its own: never inside a turn
        try:
            task = local.submit(key, self._turn, ids, fn, args, kwargs, deadline, early)
        except BaseException:
            if early is not None:
                self._turns.early.withdraw_soon(early)
            raise
        if early is not None:
            turn = early
            task.add_done_callback(lambda _: self._turns.early.withdraw_soon(turn))
        return task

    def with_options(self, *, timeout: float | None = None) -> MultiKeyWaitOptions:
        """This queue's ``run``, ``submit``, ``lock``, ``run_all`` and ``lock_all``, each with
        ``timeout`` bounding the wait for the turn, in this process and in the database
        together (``0``: try, never wait). See [WaitOptions][keyserial.WaitOptions].

        Raises:
            ValueError: ``timeout`` is negative or not a number.
        """
        return MultiKeyWaitOptions(
            self,
            call=self._call,
            submit=self._submit,
            lock=self._lock,
            lock_all=self.lock_all,
            timeout=timeout,
        )

    async def run_all(
        self,
        keys: Iterable[Hashable],
        fn: Callable[P, Awaitable[T]],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> T:
        """Run ``fn`` in one transaction holding the turns of all ``keys``.

        In the process, the call registers on every key in one step; in the database, the
        locks are taken in ascending order of their ids, so calls naming the same keys in
        different orders cannot deadlock each other.

        Raises:
            ValueError: ``keys`` is empty.
            TypeError, PostgresUnavailable, DeadlockError, QueueClosed, QueueFull: as for
                ``run``.
        """
        check_function(fn, "run_all")
        ids = self._ids(keys)
        early = self._early_turn(ids, asyncio.current_task())
        try:
            return await self._local.run_all(
                ids.values(), self._turn, ids, fn, args, kwargs, None, early
            )
        finally:
            if early is not None:
                await self._turns.early.withdraw(early)

    def lock(self, key: Hashable, timeout: float | None = None) -> KeyLock:
        """Hold ``key``'s turn, and its transaction, for the body of an ``async with`` block.

        ``timeout`` bounds the wait, as in
        [with_options][keyserial.postgres.PostgresKeyedQueue.with_options].
        """
        return self._lock(key, timeout, None)

    def _lock(self, key: Hashable, timeout: float | None, group: Hashable | None) -> KeyLock:
        if group is not None:  # with_options takes no group here
            raise ValueError("PostgresKeyedQueue does not coalesce: group= is in-process only")
        ids = self._ids((key,))
        return PostgresLock(self._turns, self._local.lock(key, timeout), ids, timeout)

    def lock_all(self, keys: Iterable[Hashable], timeout: float | None = None) -> KeyLock:
        """Hold the turns of all ``keys`` in one transaction for an ``async with`` block."""
        ids = self._ids(keys)
        return PostgresLock(self._turns, self._local.lock_all(ids.values(), timeout), ids, timeout)

    def stats(self) -> QueueStats:
        """This process's share of the queue, as for ``KeyedSerialQueue.stats``."""
        return self._local.stats()

    async def join(self) -> None:
        """Wait until this process has no registered work."""
        await self._local.join()

    async def aclose(self) -> None:
        """Refuse new work here and wait for the registered work (the pool stays open)."""
        await self._local.aclose()
        await self._turns.early.settle()
