"""Who owns which partition of a keyed stream on PostgreSQL, and the news that wakes owners.

A partition's row in ``keyserial_stream_partitions`` names its owner and lease. A takeover
locks the row ``FOR UPDATE`` (waiting for the old owner's transactions, which hold it
``FOR KEY SHARE``), and only when its lease ran out raises the fence. An owner renews its
lease, and reads its messages, on a connection of its own (the control connection), so that
handlers holding every connection of the pool cannot starve either. A listening
connection takes the ``NOTIFY`` of publications and releases to the partitions' news
events, while anything is owned or waited for here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any

import psycopg
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from .._cancels import cancel_count, withdraw_cancel
from .._errors import LeaseLost
from ..postgres._desk import connect_beside
from ._source import AttemptFailed

logger = logging.getLogger("keyserial.streams")

#: The channel publications and releases are notified on; the payload names the stream.
CHANNEL = "keyserial_streams"
#: Seconds before a lost listening connection is made again.
RECONNECT = 0.5
#: How long a takeover waits for the old owner's transactions before it tries again later.
TAKEOVER_LOCK_TIMEOUT = 0.2
#: The exceptions by which the server says it is unreachable or failed a request.
ERRORS: tuple[type[Exception], ...] = (psycopg.Error, OSError, TimeoutError, AttemptFailed)


class PartitionOwners:
    """The ownerships of one stream's partitions held or sought in this process."""

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        name: str,
        partitions: int,
        lease: float,
        prepare: Callable[[], Awaitable[None]],
    ) -> None:
        self.lease = lease
        self._pool = pool
        self._name = name
        self._prepare = prepare
        self.held: dict[int, _Ownership] = {}  # written by hold() and let_go() only
        #: Per partition: set when a publication or a release may have happened since cleared.
        self.news = [asyncio.Event() for _ in range(partitions)]
        self._listeners = 0
        self._listener: asyncio.Task[None] | None = None
        self._control: AsyncConnection[Any] | None = None
        self._connecting = asyncio.Lock()

    def own(self, partition: int) -> AbstractAsyncContextManager[int]:
        """Wait for, then hold, ``partition`` (see ``_Ownership``)."""
        return _Ownership(self, partition)

    def holds(self, partition: int, fence: int) -> bool:
        """Whether this process surely still owns ``partition`` with ``fence``."""
        ownership = self.held.get(partition)
        return ownership is not None and ownership.fence == fence and ownership.holds()

    def nothing_to_claim(self, partition: int, fence: int) -> bool:
        """Whether this process's ownership of ``partition`` with ``fence`` found no message
        handed out before it: a claim (which comes before its first read) would find none."""
        ownership = self.held.get(partition)
        return ownership is not None and ownership.fence == fence and not ownership.handed_out

    def forget_news(self, partition: int) -> None:
        """Clear ``partition``'s news: a read or a takeover is about to look for itself, and
        a notification from now on sets it again."""
        self.news[partition].clear()

    def hold(self, partition: int, ownership: _Ownership) -> None:
        """Record ``ownership`` as this process's hold of ``partition``."""
        self.held[partition] = ownership

    def let_go(self, partition: int, ownership: _Ownership) -> None:
        """Forget ``ownership`` of ``partition`` (if it is still the one recorded)."""
        if self.held.get(partition) is ownership:
            del self.held[partition]

    async def news_of(self, partition: int, timeout: float) -> None:
        """Return once ``partition`` has news, or after ``timeout`` seconds."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.news[partition].wait(), timeout)

    async def aclose(self) -> None:
        """Stop listening and close the control connection."""
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.cancel()
            await asyncio.gather(listener, return_exceptions=True)
        control, self._control = self._control, None
        if control is not None:
            await control.close()

    async def take_over(self, partition: int, owner: str) -> tuple[int, bool] | None:
        """Take ``partition`` if it has no live owner: its new fence, and whether any of its
        messages was handed out before (a claim has something to find); or None."""
        await self._prepare()
        async with self._pool.connection() as conn:
            try:
                async with conn.transaction():
                    await conn.execute(
                        "SELECT set_config('lock_timeout', %s, true)",
                        (f"{int(TAKEOVER_LOCK_TIMEOUT * 1000)}ms",),
                    )
                    # FOR UPDATE waits for the old owner's transactions (FOR KEY SHARE).
                    found = await conn.execute(
                        "SELECT fence FROM keyserial_stream_partitions "
                        "WHERE stream = %s AND partition = %s "
                        "AND (owner IS NULL OR lease_until < clock_timestamp()) FOR UPDATE",
                        (self._name, partition),
                    )
                    if await found.fetchone() is None:
                        return None
                    found = await conn.execute(
                        "UPDATE keyserial_stream_partitions SET fence = fence + 1, owner = %s, "
                        "lease_until = clock_timestamp() + %s * interval '1 second' "
                        "WHERE stream = %s AND partition = %s RETURNING fence, EXISTS ("
                        "SELECT 1 FROM keyserial_stream_messages WHERE stream = %s "
                        "AND partition = %s AND deliveries > 0)",
                        (owner, self.lease, self._name, partition, self._name, partition),
                    )
                    row = await found.fetchone()
            except psycopg.errors.LockNotAvailable:
                return None  # a transaction of the old owner still runs: later
        assert row is not None
        return int(row[0]), bool(row[1])

    async def on_control(self, statement: str, args: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        """Run one statement on the control connection (made again if lost); its rows.

        The control connection is in autocommit mode: each statement is a transaction of
        its own. Renewals, reads and lag queries go there rather than to the pool, whose
        connections the handlers' transactions hold: one per key being handled."""
        async with self._connecting:
            if self._control is None or self._control.closed:
                self._control = await connect_beside(self._pool, autocommit=True)
            control = self._control
        try:
            found = await control.execute(statement, args)  # pyright: ignore[reportArgumentType]
            return await found.fetchall()
        except psycopg.OperationalError:
            if control.broken:
                self._control = None
            raise

    async def renew(self, partition: int, fence: int) -> bool:
        renewed = await self.on_control(
            "UPDATE keyserial_stream_partitions "
            "SET lease_until = clock_timestamp() + %(lease)s * interval '1 second' "
            "WHERE stream = %(stream)s AND partition = %(partition)s AND fence = %(fence)s "
            "RETURNING 1",
            {"lease": self.lease, "stream": self._name, "partition": partition, "fence": fence},
        )
        return bool(renewed)

    async def release(self, partition: int, fence: int) -> None:
        await self.on_control(
            "WITH r AS (UPDATE keyserial_stream_partitions SET owner = NULL, "
            "lease_until = '-infinity' WHERE stream = %(stream)s AND partition = %(partition)s "
            "AND fence = %(fence)s RETURNING 1) SELECT pg_notify(%(channel)s, %(payload)s) FROM r",
            {
                "stream": self._name,
                "partition": partition,
                "fence": fence,
                "channel": CHANNEL,
                "payload": f"r:{partition}:{self._name}",
            },
        )

    def listening(self, change: int) -> asyncio.Task[None] | None:
        """Count an ownership (waiting or held) in or out; the listener runs while any is.

        Returns the listener when the last one left: cancelled, for the caller to await
        (it closes its connection on the way out)."""
        self._listeners += change
        if self._listeners > 0 and self._listener is None:
            self._listener = asyncio.get_running_loop().create_task(self._listen())
        elif self._listeners == 0 and self._listener is not None:
            listener, self._listener = self._listener, None
            listener.cancel()
            return listener
        return None

    async def stop_listening(self) -> None:
        """Count an ownership out; once none is left, wait until the listener has ended."""
        listener = self.listening(-1)
        if listener is not None:
            await asyncio.gather(listener, return_exceptions=True)

    async def _listen(self) -> None:
        while True:
            try:
                conn = await connect_beside(self._pool, autocommit=True)
                try:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    for news in self.news:  # what was published while nobody listened
                        news.set()
                    async for note in conn.notifies():
                        self._noticed(note.payload)
                finally:
                    await conn.close()
            except (psycopg.Error, OSError) as exc:
                logger.debug("stream %r: listening again after %r", self._name, exc)
                await asyncio.sleep(RECONNECT)

    def _noticed(self, payload: str) -> None:
        """Take a notification ``<kind>:<partition>:<stream>`` to its partition's news.

        Anything else on the channel (another program's) is ignored: it must not end the
        listener."""
        _, _, rest = payload.partition(":")
        partition, _, name = rest.partition(":")
        if name == self._name and partition.isdigit() and int(partition) < len(self.news):
            self.news[int(partition)].set()


class _Ownership:
    """``async with``: wait for, then hold, a partition; its value is the fence.

    A keeper renews the lease every third of it; once the lease may have run out by the
    local clock (measured from before the request that granted or renewed it) or a
    renewal finds another fence, the block's task is cancelled, and leaving the block
    raises ``LeaseLost``.
    """

    def __init__(self, source: PartitionOwners, partition: int) -> None:
        self._source = source
        self._partition = partition
        self.fence: int | None = None
        #: Whether any message of the partition had been handed out when it was taken.
        self.handed_out = True
        self.until = 0.0
        self.lost = False
        self.ending = False  # the block is being left: the keeper stops
        self._task: asyncio.Task[Any] | None = None
        self._keeper: asyncio.Task[None] | None = None
        self._cancels_before = 0

    def holds(self) -> bool:
        return not self.lost and asyncio.get_running_loop().time() < self.until

    async def __aenter__(self) -> int:
        source, partition = self._source, self._partition
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        owner = f"{id(self):x}"
        source.listening(+1)
        try:
            while True:
                started = loop.time()
                source.forget_news(partition)
                try:
                    taken = await source.take_over(partition, owner)
                except ERRORS as exc:
                    logger.debug("partition %d: takeover failed (%r)", partition, exc)
                    taken = None
                if taken is not None:
                    break
                await source.news_of(partition, source.lease / 5)
        except BaseException:
            await source.stop_listening()
            raise
        fence, self.handed_out = taken
        self.fence, self.until = fence, started + source.lease
        self._task, self._cancels_before = task, cancel_count(task)
        self._keeper = loop.create_task(self._keep())
        source.hold(partition, self)
        return fence

    async def _keep(self) -> None:
        source, fence = self._source, self.fence
        assert fence is not None
        loop = asyncio.get_running_loop()
        # ``ending`` is checked after every await, not only left to the cancellation that
        # comes with it: before Python 3.12, wait_for can swallow a cancellation that
        # arrives as its inner request completes, and this loop would then run on.
        while not self.ending:
            await asyncio.sleep(max(0.0, min(source.lease / 3, self.until - loop.time())))
            started = loop.time()
            if self.ending or started >= self.until:
                break
            try:
                renewed = await asyncio.wait_for(
                    source.renew(self._partition, fence), self.until - started
                )
            except (asyncio.TimeoutError, *ERRORS) as exc:  # type: ignore[misc]
                logger.debug("partition %d: lease not renewed (%r)", self._partition, exc)
                continue
            if not renewed:
                break
            self.until = started + source.lease
        if self.ending:
            return
        self.lost = True
        assert self._task is not None
        self._task.cancel()

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        source, partition, fence = self._source, self._partition, self.fence
        assert fence is not None
        keeper, self._keeper = self._keeper, None
        self.ending = True
        if keeper is not None:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
        source.let_go(partition, self)
        try:
            if not self.lost:
                with contextlib.suppress(asyncio.TimeoutError, *ERRORS):
                    await asyncio.wait_for(source.release(partition, fence), source.lease)
        finally:
            await source.stop_listening()
        if self.lost:
            task = self._task
            assert task is not None
            if isinstance(exc, asyncio.CancelledError) and not withdraw_cancel(
                task, self._cancels_before
            ):
                return False  # cancelled from elsewhere: that cancellation goes on
            raise LeaseLost(f"partition {partition}", fence)
        return False
