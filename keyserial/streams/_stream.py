"""``KeyedStream``: publish keyed messages; consume them per key in order, across processes."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import os
import secrets
import socket
from collections.abc import Awaitable, Callable, Generator, Hashable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import redis.asyncio as redis_asyncio
    from psycopg_pool import AsyncConnectionPool

from .._errors import LeaseLost
from .._extras import require_extra
from .._observation import QueueObserver
from .._queue import KeyedSerialQueue
from ._assignment import assigned
from ._message import DeadLetter, StreamCounts, StreamMessage, StreamStats
from ._partition import Handler, InFlight, PartitionWorker
from ._source import PartitionLost, StreamSource, Value

H = TypeVar("H", bound=Callable[[StreamMessage], Awaitable[Any]])

logger = logging.getLogger("keyserial.streams")

#: Seconds to wait before asking a broker that failed again.
RETRY_BROKER = 0.5
#: The shortest ``lease`` accepted, in seconds.
MIN_STREAM_LEASE = 0.2
#: A dead consumer is taken over within ``lease``: its partitions' own leases and its
#: membership last this share of it, and a waiting owner or a rebalance looks again every
#: fifth of that, so the last look falls before ``lease`` has passed.
OWNERSHIP_SHARE = 0.6
#: Hand-outs of a message after which it is dead-lettered unrun. A message is handed out
#: again only when its owner stopped before finishing it, and a rebalance lets running
#: handlers finish first: twenty owners lost in a row while it ran is a message that kills
#: its consumer, not bad luck, while a flapping connection stays well below it.
DEFAULT_MAX_DELIVERIES = 20


class _Slot:
    """A partition this consumer wants: the task that waits for it, then serves it."""

    __slots__ = ("owning", "stop", "task")

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.owning = False
        self.task: asyncio.Task[None] | None = None


class KeyedStream:
    """A stream of keyed messages, consumed per key in order by any number of processes.

    Messages are published with a key; keys map to ``partitions`` partitions by a stable
    hash, each one Redis stream (or, on PostgreSQL, rows of one table). Each partition has
    one owner at a time among the running consumers, under a lease and a fence. The owner
    runs its messages through an in-process keyed queue: different keys concurrently, the
    same key strictly one after the other in stream order.

    Guarantees:

    * a message's handler starts only after every earlier message of its key finished,
      was dead-lettered, or (after a crash) is being run again first;
    * at least once: a message is acknowledged only after its handler returned, and
      before the next message of its key starts; a handler that raises is retried
      (``max_attempts``) while its key waits, then dead-lettered with its error;
    * a message whose owners keep dying while it runs (it crashes its process) is
      dead-lettered unrun once it was handed out more than ``max_deliveries`` times
      while it may have been running, so it cannot take every consumer down in turn
      (the messages pending beside it are not charged with its crashes);
    * a new owner first runs the previous owner's unacknowledged messages, in stream
      order; a message runs twice only when its owner crashed or lost its lease, and
      [StreamMessage.fence][keyserial.streams.StreamMessage] lets a store refuse the
      stale owner's writes;
    * consumers share the partitions evenly, and a dead consumer's partitions are taken
      over within ``lease`` seconds;
    * reading stops while ``max_in_flight`` messages are unfinished, and resumes once
      an eighth of them finished; each partition keeps at most an even share of
      ``max_in_flight`` (among the partitions this consumer owns) unfinished, and reads
      again once half of that is left, so one partition whose keys are stuck cannot
      take the room of the others;
    * on PostgreSQL, the handler's statements on ``keyserial.postgres.connection()``
      run in the transaction that acknowledges its message: they commit once per
      message, with the acknowledgement, and a stale owner can commit neither.

    Args:
        client: a ``redis.asyncio.Redis`` client (Redis 7.0 or later), a
            ``redis.asyncio.RedisCluster`` (redis-py 8.0 or later), or a
            ``psycopg_pool.AsyncConnectionPool`` (PostgreSQL 13 or later; the page
            "Keyed streams on PostgreSQL" says what it adds).
        name: the stream's name; producers and consumers use the same one.
        partitions: how many partitions; fixed for the stream's life (it decides
            where each key's messages go), and the most consumers that can share the work.
        lease: seconds within which a dead consumer's partitions are taken over
            by the others; at least 0.2. A consumer paused (or cut off from Redis)
            for more than about half of it loses its partitions.

    Raises:
        TypeError: ``client`` is not a ``redis.asyncio.Redis`` (or ``RedisCluster``) nor a
            ``psycopg_pool.AsyncConnectionPool``, or ``name`` not a str.
        ValueError: ``name`` is empty, ``partitions`` is not a positive int, or
            ``lease`` is not a finite number of seconds of at least 0.2.

    Example:
        ```python
        stream = KeyedStream(redis.Redis(), "transcripts", partitions=16)
        await stream.publish("seg-1", {"kind": "partial", "text": "hello"})

        @stream.consumer(max_in_flight=1000, max_attempts=5)
        async def handle(message: StreamMessage) -> None:
            await save(message.key, message.fields["text"], fence=message.fence)

        await stream.run()  # until cancelled or stop(); drains gracefully
        ```
    """

    def __init__(
        self,
        client: redis_asyncio.Redis | redis_asyncio.RedisCluster | AsyncConnectionPool[Any],
        name: str,
        partitions: int = 16,
        *,
        lease: float = 10.0,
    ) -> None:
        if not (
            isinstance(lease, (int, float)) and math.isfinite(lease) and lease >= MIN_STREAM_LEASE
        ):
            raise ValueError(
                f"lease must be a finite number of seconds >= {MIN_STREAM_LEASE}, got {lease!r}"
            )
        self.lease = float(lease)
        #: How long a partition's ownership and a consumer's membership last unrenewed.
        self._held_for = OWNERSHIP_SHARE * self.lease
        self._source = _source_for(client, name, partitions, self._held_for)
        self.name = name
        self.member = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self._handler: Handler | None = None
        self._max_in_flight = 1000
        self._max_attempts = 5
        self._max_deliveries: int | None = DEFAULT_MAX_DELIVERIES
        self._retry_delay = 0.1
        self._drain_timeout = 30.0
        self._observer: QueueObserver | None = None
        self._counts = StreamCounts()
        self._in_flight = InFlight(self._max_in_flight)
        self._slots: dict[int, _Slot] = {}
        self._stopping: asyncio.Event | None = None
        self._stop_asked = False  # stop() called while run() was not running
        self._ended: asyncio.Future[None] | None = None  # set once the running run() returns

    @property
    def partitions(self) -> int:
        """How many partitions the stream has."""
        return self._source.partitions

    @property
    def source(self) -> StreamSource:
        """The broker behind the stream."""
        return self._source

    def partition_of(self, key: Hashable) -> int:
        """The partition ``key``'s messages go to (the same in every process).

        Raises:
            TypeError: ``key`` is not a str, bytes, int or a tuple of them.
        """
        return self._source.partition_of(key)

    async def publish(
        self, key: Hashable, fields: Mapping[str, Value], *, connection: object = None
    ) -> str:
        """Append a message for ``key``; returns its id in its partition.

        Messages of one key are consumed in the order their ``publish`` calls
        completed (on PostgreSQL: the order their transactions committed in).
        ``fields`` values are str, bytes, int or float; a handler sees them all as
        str (bytes decoded as UTF-8, undecodable bytes kept as surrogate escapes).

        On PostgreSQL, ``connection`` (a psycopg ``AsyncConnection``) makes the
        message part of that connection's open transaction: it exists if and only
        if the transaction commits (a transactional outbox).

        Raises:
            TypeError: ``key`` is not a str, bytes, int or a tuple of them, a
                field name or value has another type, or ``connection`` is given
                to a stream on Redis or is not a psycopg ``AsyncConnection``.
            ValueError: a field name starts with ``keyserial.`` (reserved), or a
                float value is not finite.
        """
        return await self._source.publish(key, fields, connection)

    def consumer(
        self,
        *,
        max_in_flight: int = 1000,
        max_attempts: int = 5,
        max_deliveries: int | None = DEFAULT_MAX_DELIVERIES,
        retry_delay: float = 0.1,
        drain_timeout: float = 30.0,
        observer: QueueObserver | None = None,
    ) -> Callable[[H], H]:
        """Register the stream's handler: ``async def handle(message: StreamMessage)``.

        ``max_in_flight`` bounds the messages read but not finished in this
        process; ``max_attempts`` the attempts per message before it is
        dead-lettered, waiting ``retry_delay`` seconds (doubled each time) in
        between; ``max_deliveries`` how often a message may be handed out while
        it may have been running (each earlier owner died or lost the partition
        before finishing it, see ``StreamMessage.deliveries``) before the next
        owner dead-letters it without running it, ``None`` for no bound;
        ``drain_timeout`` how long a graceful stop, or the hand-over of a
        partition to another consumer, lets running handlers finish. ``observer``
        receives the in-process queue's hooks, with the message key as key.

        Raises:
            ValueError: a bound is not a positive int (``max_deliveries`` may
                also be ``None``), a delay is negative, or a handler is already
                registered.
            TypeError: the handler is not an ``async def`` function.
        """
        for label, bound in (("max_in_flight", max_in_flight), ("max_attempts", max_attempts)):
            if isinstance(bound, bool) or not isinstance(bound, int) or bound < 1:
                raise ValueError(f"{label} must be a positive int, got {bound!r}")
        if max_deliveries is not None and (
            isinstance(max_deliveries, bool)
            or not isinstance(max_deliveries, int)
            or max_deliveries < 1
        ):
            raise ValueError(
                f"max_deliveries must be a positive int or None, got {max_deliveries!r}"
            )
        for label, seconds in (("retry_delay", retry_delay), ("drain_timeout", drain_timeout)):
            if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0):
                raise ValueError(
                    f"{label} must be a finite number of seconds >= 0, got {seconds!r}"
                )

        def register(handler: H) -> H:
            function: Callable[..., object] = handler  # checked without narrowing ``handler``
            if not inspect.iscoroutinefunction(function):
                raise TypeError(
                    f"the stream's handler must be an async def function, not {handler!r}"
                )
            if self._handler is not None:
                raise ValueError(f"stream {self.name!r} already has a handler")
            self._handler = handler
            self._max_in_flight, self._max_attempts = max_in_flight, max_attempts
            self._max_deliveries = max_deliveries
            self._retry_delay, self._drain_timeout = float(retry_delay), float(drain_timeout)
            self._observer = observer
            self._in_flight = InFlight(max_in_flight)
            return handler

        return register

    def stats(self) -> StreamStats:
        """What this consumer owns and has done since it started."""
        counts = self._counts
        owned = tuple(sorted(p for p, slot in self._slots.items() if slot.owning))
        return StreamStats(
            owned,
            self._in_flight.messages,
            counts.handled,
            counts.failed_attempts,
            counts.retries,
            counts.dead_lettered,
            counts.ownerships_lost,
            {p: lag for p, lag in counts.lag.items() if p in owned},
        )

    async def dead_letters(self, count: int = 100) -> list[DeadLetter]:
        """Up to ``count`` dead letters of each partition, partition by partition, oldest first.

        A dead letter stays until deleted: on Redis from its partition's dead-letter
        stream (``XDEL``, or ``XTRIM`` to keep the newest), on PostgreSQL from the table
        ``keyserial_stream_dead``.
        """
        found: list[DeadLetter] = []
        for partition in range(self.partitions):
            found += await self._source.dead_letters(partition, count)
        return found

    def stop(self) -> Awaitable[None]:
        """Ask ``run()`` to stop reading, let running handlers finish, and return.

        A plain method: calling it is enough, from anywhere in the loop (a signal handler,
        a handler of the stream). What it returns may also be awaited, from outside the
        stream's handlers: ``await stream.stop()`` returns once ``run()`` has drained and
        returned (at once if it was not running).

        A stop asked for while ``run()`` is not running is kept: the next ``run()``
        returns at once (and the stop is used up).

        Example:
            ```python
            consuming = asyncio.create_task(stream.run())
            ...
            await stream.stop()  # or stream.stop(), then await consuming
            ```
        """
        if self._stopping is not None:
            self._stopping.set()
        else:
            self._stop_asked = True
        return _Ended(self._ended)

    async def run(self) -> None:
        """Consume until cancelled or ``stop()``: own partitions, run their messages.

        On the way out (cancelled or stopped) it stops reading, lets running
        handlers finish for up to ``drain_timeout`` and acknowledges them, then
        gives its partitions and its membership back.

        Raises:
            RuntimeError: no handler is registered, or ``run()`` is already running.
        """
        handler = self._handler
        if handler is None:
            raise RuntimeError(f"stream {self.name!r} has no handler: decorate one with consumer()")
        if self._stopping is not None:
            raise RuntimeError(f"stream {self.name!r} is already running")
        if self._stop_asked:
            self._stop_asked = False
            return
        stopping = self._stopping = asyncio.Event()
        ended = self._ended = asyncio.get_running_loop().create_future()
        queue = KeyedSerialQueue(observer=self._observer)
        try:
            while not stopping.is_set():
                await self._rebalance(handler, queue)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stopping.wait(), self._held_for / 5)
        finally:
            try:
                await self._leave()
            finally:
                self._stopping = self._ended = None
                ended.set_result(None)

    async def _rebalance(self, handler: Handler, queue: KeyedSerialQueue) -> None:
        """Renew membership, then start serving the partitions now ours and hand off the rest."""
        try:
            members = await self._source.members(self.member, self._held_for)
        except self._source.errors as exc:
            logger.warning("stream %r: membership not renewed (%s)", self.name, exc)
            return
        mine = assigned(self.partitions, members, self.member)
        for partition in mine - self._slots.keys():
            slot = self._slots[partition] = _Slot()
            slot.task = asyncio.get_running_loop().create_task(
                self._serve(partition, slot, handler, queue)
            )
        for partition, slot in list(self._slots.items()):
            if partition not in mine:
                self._let_go(slot)
            if slot.task is not None and slot.task.done():
                del self._slots[partition]

    def _let_go(self, slot: _Slot) -> None:
        slot.stop.set()
        if not slot.owning and slot.task is not None:
            slot.task.cancel()  # still waiting for the partition: withdraw

    async def _serve(
        self, partition: int, slot: _Slot, handler: Handler, queue: KeyedSerialQueue
    ) -> None:
        """Wait for the partition, serve it; after a lost lease or a broker error, again."""
        self._in_flight.readers += 1
        try:
            await self._serve_while_assigned(partition, slot, handler, queue)
        finally:
            self._in_flight.readers -= 1

    async def _serve_while_assigned(
        self, partition: int, slot: _Slot, handler: Handler, queue: KeyedSerialQueue
    ) -> None:
        while not slot.stop.is_set():
            try:
                async with self._source.own(partition) as fence:
                    slot.owning = True
                    worker = PartitionWorker(
                        self._source,
                        partition,
                        fence,
                        self.member,
                        handler,
                        queue,
                        self._in_flight,
                        self._counts,
                        self._max_attempts,
                        self._max_deliveries,
                        self._retry_delay,
                    )
                    await worker.run(slot.stop, self._drain_timeout)
            except (LeaseLost, PartitionLost) as exc:
                self._counts.ownerships_lost += 1
                detail = (
                    f"its lease (fence {exc.fence}) ran out"
                    if isinstance(exc, LeaseLost)
                    else str(exc)
                )
                logger.warning("stream %r: partition %d lost: %s", self.name, partition, detail)
            except self._source.errors as exc:
                logger.warning("stream %r: partition %d: %s", self.name, partition, exc)
                await asyncio.sleep(RETRY_BROKER)
            except Exception:
                # Not the broker's: a bug. Logged with its traceback; the partition is
                # served again rather than left without an owner for ever.
                logger.exception("stream %r: partition %d failed", self.name, partition)
                await asyncio.sleep(RETRY_BROKER)
            finally:
                slot.owning = False

    async def _leave(self) -> None:
        """Hand every partition back (running handlers drain), then leave the members."""
        slots = list(self._slots.values())
        for slot in slots:
            self._let_go(slot)
        tasks = [slot.task for slot in slots if slot.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._slots.clear()
        with contextlib.suppress(*self._source.errors):
            await self._source.members(self.member, self._held_for, leaving=True)

    async def aclose(self) -> None:
        """Give back the connections the stream keeps (after ``run()`` returned)."""
        await self._source.aclose()


def _source_for(client: object, name: str, partitions: int, held_for: float) -> StreamSource:
    """The source for ``client``'s broker: a Redis client or a PostgreSQL pool.

    Raises:
        TypeError: ``client`` is neither.
    """
    module = type(client).__module__
    if module.startswith("psycopg_pool"):
        require_extra("KeyedStream on PostgreSQL", "postgres", "psycopg", "psycopg_pool")
        from ._postgres_source import PostgresStreamSource

        return PostgresStreamSource(client, name, partitions, held_for)  # type: ignore[arg-type]
    if module.startswith("redis"):
        require_extra("KeyedStream on Redis", "redis", "redis")
        from ._redis_source import RedisStreamSource

        return RedisStreamSource(client, name, partitions, held_for)  # type: ignore[arg-type]
    raise TypeError(
        "KeyedStream needs a redis.asyncio.Redis or redis.asyncio.RedisCluster client, or a "
        f"psycopg_pool.AsyncConnectionPool, not {module}.{type(client).__qualname__}"
    )


class _Ended:
    """What ``KeyedStream.stop()`` returns: awaiting it waits until ``run()`` has returned.

    Not a coroutine, so a caller that does not await it leaves no warning behind.
    """

    __slots__ = ("_ended",)

    def __init__(self, ended: asyncio.Future[None] | None) -> None:
        self._ended = ended

    def __await__(self) -> Generator[Any, None, None]:
        if self._ended is not None:
            # Shielded: a caller cancelled while it waits must not cancel run()'s own future.
            yield from asyncio.shield(self._ended).__await__()
