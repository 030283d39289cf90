"""``RedisKeyedQueue``: the in-process queue's order, with turns granted by Redis."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Mapping
from typing import Any, ParamSpec, TypeVar

import redis.asyncio as redis_asyncio

from .._cancels import cancel_count, withdraw_cancel
from .._errors import LeaseLost, called, check_function
from .._options import WaitOptions, deprecated_call
from .._protocols import KeyLock
from .._queue import KeyedSerialQueue
from .._turns import enter_turn, leave_turn
from ._fair import FairTickets
from ._lock import RedisLock
from ._names import encode_key, encoded_namespace
from ._tickets import EarlyTicket
from ._turns import RedisTurns

T = TypeVar("T")
P = ParamSpec("P")
Task = asyncio.Task[Any]

#: The shortest lease accepted, in seconds: a waiter polls every third of it.
MIN_LEASE = 0.1


class RedisKeyedQueue:
    """A keyed serial queue whose turns are granted by Redis, for many processes at once.

    Calls with the same key, made in any process connected to the same Redis
    with the same ``namespace``, run one at a time: at most one holds the turn
    while leases hold. Within one process, turns follow registration order. Across
    processes, by default, they follow the order in which each process's next call
    reaches Redis (a ticket queue per key holds one ticket per process), so a later call
    of one process can run before an earlier call still queued inside another. With
    ``fair=True`` every call sends its ticket when it registers, and turns follow the
    order in which the calls reached Redis, whatever their process, as Redisson's
    ``FairLock`` does; each waiting call then keeps its ticket alive with a poll every
    third of a lease. A waiter is woken by a
    Redis pub/sub message on its process's own channel within one round trip of the
    release; a slow poll (``lease / 3``) is the fallback for a lost message and the
    heartbeat that keeps its ticket alive. Needs Redis 6.2 or later.

    Each turn holds a lease of ``lease`` seconds, renewed in the background
    while the call runs. A holder that dies loses its turn when the lease
    expires; a waiter that dies is skipped once its ticket's heartbeat stops.
    A holder paused past its lease loses the turn to the next caller, who gets
    a higher fencing token ([current_fence][keyserial.current_fence]); the paused
    call learns it with [LeaseLost][keyserial.LeaseLost]. Only tickets and fences
    go to Redis, never the calls' data.

    Every request to Redis is bounded by the call's ``timeout`` and by one lease:
    a Redis that does not answer fails a call with ``TimeoutError`` or
    [RedisUnavailable][keyserial.redis.RedisUnavailable], never hangs it. An
    uncontended call costs two Redis round trips (acquire, release).

    Args:
        client: a ``redis.asyncio.Redis`` client (with or without
            ``decode_responses``), whose pool lends the queue the connections it
            uses (closing the client closes them), or a ``redis.asyncio.RedisCluster``.
        namespace: separates queues sharing one Redis; all processes of one
            queue must use the same one.
        lease: seconds a turn is held without renewal, at least ``MIN_LEASE``
            (0.1); the longest a dead holder can stall a key.
        max_pending: per-key bound on this process's running plus waiting calls.
        fair: grant turns across processes in the order the calls reached Redis (see
            above). Every process of one queue should use the same setting: a process in
            the default mode still holds one ticket per key at a time.

    Raises:
        TypeError: ``client`` is not an asyncio Redis client (a synchronous
            ``redis.Redis``), or has no pub/sub (an asyncio ``RedisCluster``
            before redis-py 8), or ``namespace`` is not a ``str``.
        ValueError: ``namespace`` is empty, or ``lease`` is not a finite number
            of seconds of at least ``MIN_LEASE``.

    Example:
        ```pycon
        >>> import redis.asyncio as redis
        >>> from keyserial.redis import RedisKeyedQueue
        >>> queue = RedisKeyedQueue(redis.Redis(), namespace="transcripts", lease=10.0)

        ```
    """

    def __init__(
        self,
        client: redis_asyncio.Redis | redis_asyncio.RedisCluster,
        namespace: str,
        lease: float = 10.0,
        *,
        max_pending: int | None = None,
        fair: bool = False,
    ) -> None:
        if not isinstance(client, (redis_asyncio.Redis, redis_asyncio.RedisCluster)):
            raise TypeError(
                "RedisKeyedQueue needs an asyncio client (redis.asyncio.Redis or "
                f"redis.asyncio.RedisCluster), not {type(client).__module__}."
                f"{type(client).__qualname__}"
            )
        if not hasattr(client, "pubsub"):
            raise TypeError(
                "RedisKeyedQueue needs a redis.asyncio client with pub/sub, not "
                f"{type(client).__name__} (redis.asyncio.RedisCluster has it from redis-py 8.0)"
            )
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str, not {type(namespace).__name__}")
        if not namespace:
            raise ValueError("namespace must be a non-empty string")
        if not (isinstance(lease, (int, float)) and math.isfinite(lease) and lease >= MIN_LEASE):
            raise ValueError(
                f"lease must be a finite number of seconds >= {MIN_LEASE}, got {lease!r}"
            )
        if not isinstance(fair, bool):
            raise TypeError(f"fair must be True or False, not {fair!r}")
        self._client = client
        self._lease = float(lease)
        self._local = KeyedSerialQueue(max_pending=max_pending)
        self._turns = RedisTurns(client, encoded_namespace(namespace), self._lease)
        self._tickets = FairTickets(self._turns) if fair else None

    @property
    def lease(self) -> float:
        """Seconds a turn is held without renewal."""
        return self._lease

    @property
    def fair(self) -> bool:
        """Whether turns follow the order in which calls reached Redis, across processes."""
        return self._tickets is not None

    def _early_ticket(self, encoded: str, task: Task | None) -> EarlyTicket | None:
        """Fair mode: this call's ticket, sent now; None in the default mode or on re-entry."""
        tickets = self._tickets
        if tickets is None or (task is not None and (task, encoded) in self._turns.held):
            return None
        return tickets.register(encoded)

    # -- running calls --------------------------------------------------------------------

    async def _turn(
        self,
        encoded: str,
        fn: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        deadline: float | None,
        early: EarlyTicket | None,
    ) -> T:
        task: Task = asyncio.current_task()  # type: ignore[assignment]
        turns = self._turns
        turn = turns.held.get((task, encoded))
        if turn is not None:  # re-entry: the outer turn holds the key
            record = enter_turn(task, turn, encoded, fn)  # its fence is Redis's
            try:
                return await called(fn, args, kwargs)
            finally:
                leave_turn(task, record)
        if early is None or self._tickets is None:
            turn, keeper = await turns.take(encoded, deadline, task)
        else:
            turn, keeper = await self._tickets.take_early(early, encoded, deadline, task)
        before = cancel_count(task)
        record = enter_turn(task, turn, encoded, fn)
        try:
            result = await called(fn, args, kwargs)
        except asyncio.CancelledError:
            if turn.lost and withdraw_cancel(task, before):  # the keeper's own cancellation
                raise LeaseLost(encoded, turn.fence) from None
            raise
        finally:
            leave_turn(task, record)
            lost = await turns.give_back(encoded, turn, keeper, task)
        if lost:
            raise LeaseLost(encoded, turn.fence)
        return result

    def run(
        self, key: Hashable, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs
    ) -> Coroutine[Any, Any, T]:
        """Run ``await fn(*args, **kwargs)`` once this call holds ``key``'s turn in Redis.

        Raises:
            TypeError: ``key`` is not a str, bytes, int or a tuple of them.
            RedisUnavailable: Redis could not be reached, or did not answer within a
                lease; the call did not run.
            LeaseLost: the call ran, but its lease was lost meanwhile (it was
                paused or Redis lost its data); a later turn may have overlapped.
            QueueClosed, QueueFull: as for [KeyedSerialQueue][keyserial.KeyedSerialQueue].
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
        """[run][keyserial.redis.RedisKeyedQueue.run] with a bound on the wait for the turn.

        ``timeout`` bounds the local and the Redis waits together, whatever Redis does: on
        expiry the built-in ``TimeoutError`` is raised and ``fn`` never starts.

        Raises:
            ValueError: ``group`` is given (coalescing is in-process only).
            TimeoutError: the turn did not come within ``timeout`` seconds.
            TypeError, RedisUnavailable, LeaseLost, QueueClosed, QueueFull: as for ``run``.
        """
        if group is not None:  # with_options takes no group here: only call() passes one
            raise ValueError("RedisKeyedQueue does not coalesce: group= is in-process only")
        encoded = encode_key(key)
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        # Without a bound, the in-process queue's own run: its fastest path.
        local = self._local if timeout is None else self._local.with_options(timeout=timeout)
        early = self._early_ticket(encoded, asyncio.current_task())
        try:
            return await local.run(encoded, self._turn, encoded, fn, args, kwargs, deadline, early)
        finally:
            if early is not None and self._tickets is not None:
                self._tickets.withdraw(early)  # nothing to do once the call took it up

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
        encoded = encode_key(key)
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        local = self._local.with_options(timeout=timeout)
        early = self._early_ticket(encoded, None)  # a task of its own: never a re-entry
        try:
            task = local.submit(encoded, self._turn, encoded, fn, args, kwargs, deadline, early)
        except BaseException:
            if early is not None and self._tickets is not None:
                self._tickets.withdraw(early)
            raise
        if early is not None and self._tickets is not None:
            ticket, tickets = early, self._tickets
            task.add_done_callback(lambda _: tickets.withdraw(ticket))
        return task

    def with_options(self, *, timeout: float | None = None) -> WaitOptions:
        """This queue's ``run``, ``submit`` and ``lock``, each with ``timeout`` bounding the
        wait for the turn, in this process and in Redis together (``0``: try, never wait).

        See [WaitOptions][keyserial.WaitOptions].

        Raises:
            ValueError: ``timeout`` is negative or not a number.
        """
        return WaitOptions(
            self, call=self._call, submit=self._submit, lock=self._lock, timeout=timeout
        )

    def lock(self, key: Hashable, timeout: float | None = None) -> KeyLock:
        """Hold ``key``'s turn for the body of an ``async with`` block.

        ``timeout`` bounds the wait for the turn, as in
        [with_options][keyserial.redis.RedisKeyedQueue.with_options].
        """
        return self._lock(key, timeout, None)

    def _lock(self, key: Hashable, timeout: float | None, group: Hashable | None) -> KeyLock:
        if group is not None:  # with_options takes no group here
            raise ValueError("RedisKeyedQueue does not coalesce: group= is in-process only")
        encoded = encode_key(key)
        return RedisLock(
            self._turns, self._local.lock(encoded, timeout), encoded, timeout, self._tickets
        )

    async def join(self) -> None:
        """Wait until this process has no registered work."""
        await self._local.join()

    async def aclose(self) -> None:
        """Refuse new work here, wait for the registered work, and stop listening for grants.

        Releases still going on in the background are given up to a lease to finish.
        """
        await self._local.aclose()
        await self._turns.close()
