"""The grant listener: one event loop's pub/sub subscription, and the tickets it waits for."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
from collections.abc import Callable
from typing import Any, cast

import redis.asyncio as redis_asyncio
from redis.exceptions import RedisError

from ._transport import text

logger = logging.getLogger("keyserial")


async def finished_within(task: asyncio.Task[Any], seconds: float) -> bool:
    """Wait for ``task`` at most ``seconds``, without cancelling it; True if it finished."""
    if task.done():
        return True
    finished = asyncio.get_running_loop().create_future()

    def wake(_: object = None) -> None:
        if not finished.done():
            finished.set_result(None)

    task.add_done_callback(wake)
    timer = asyncio.get_running_loop().call_later(seconds, wake)
    try:
        await finished
    finally:
        timer.cancel()
        task.remove_done_callback(wake)
    return task.done()


def time_up(granted: asyncio.Future[int | None]) -> None:
    if not granted.done():
        granted.set_result(None)


class GrantListener:
    """One event loop's subscription to its own grant channel, and the tickets it waits for.

    Its tickets name it (``<n>@<listener>``), so Redis publishes their grants on this
    channel alone, and no process reads the grants of another. A ticket is registered here
    before its request is sent and forgotten once its wait ends: a grant for a ticket not
    registered (its waiter gave up, or the message was never Redis's) is dropped, and since
    tickets never repeat, no grant can ever be taken by a later wait.
    """

    def __init__(self, client: redis_asyncio.Redis | redis_asyncio.RedisCluster) -> None:
        self.client = client
        self.listener = secrets.token_hex(8)
        self.channel = f"keyserial:grants:{self.listener}"
        self.numbers = itertools.count(1)
        # ticket -> None (no grant yet), its fence (granted), or the future of its wait
        self.waiting: dict[str, int | asyncio.Future[int | None] | None] = {}
        #: ticket -> the lowest fence a grant of it may have: one registered again takes no
        #: grant of its earlier registration (see `registered_again`).
        self.floors: dict[str, int] = {}
        self.ready = asyncio.get_running_loop().create_future()
        #: Asked about a grant for a ticket whose call does not wait for it yet; True: the
        #: grant is being taken back (see keyserial.redis._tickets.Sender), drop it.
        self.unawaited: Callable[[str], bool] | None = None
        self.closing = False
        self.task = asyncio.get_running_loop().create_task(self._listen())

    def new_ticket(self) -> str:
        ticket = f"{next(self.numbers)}@{self.listener}"
        self.waiting[ticket] = None
        return ticket

    def expect(self, ticket: str) -> asyncio.Future[int | None]:
        """A future set to the ticket's fence when its grant arrives (None: time to poll)."""
        future: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        fence = self.waiting.get(ticket)
        if type(fence) is int:
            future.set_result(fence)
        else:
            self.waiting[ticket] = future
        return future

    def forget(self, ticket: str) -> None:
        """The wait of ``ticket`` is over: later grants for it are dropped."""
        self.waiting.pop(ticket, None)
        self.floors.pop(ticket, None)

    def registered_again(self, ticket: str, since: int) -> None:
        """``ticket`` was registered again when Redis's clock read ``since`` (µs): a grant
        with a lower fence was made to its earlier registration, and is dropped, whether it
        is kept here already or arrives later."""
        self.floors[ticket] = since
        fence = self.waiting.get(ticket)
        if type(fence) is int and fence < since:
            self.waiting[ticket] = None

    def _deliver(self, message: bytes | str) -> None:
        try:
            _base, ticket, fence_text = text(message).split("|")
            fence = int(fence_text)
        except ValueError:
            return  # not a grant of ours
        self.grant(ticket, fence)

    def grant(self, ticket: str, fence: int) -> None:
        """``ticket`` was granted with ``fence``: wake its wait, or keep the fence for it."""
        waiting = self.waiting.get(ticket, _NOT_WAITING)
        if waiting is _NOT_WAITING:
            return  # nobody waits for this ticket any more
        if fence < self.floors.get(ticket, 0):
            return  # a grant of a registration that was lost or taken back since
        if isinstance(waiting, asyncio.Future) and not waiting.done():
            cast("asyncio.Future[int | None]", waiting).set_result(fence)
        elif waiting is None and self.unawaited is not None and self.unawaited(ticket):
            pass  # the ticket waits again: a later grant of it counts
        else:  # its request has not returned yet, or its poll timer just fired
            self.waiting[ticket] = fence

    async def close(self, within: float) -> None:
        """Stop listening; wait for the listener at most ``within`` seconds."""
        self.closing = True
        self.task.cancel()
        await finished_within(self.task, within)
        if not self.task.done():
            logger.warning("keyserial: grant listener still stopping after %.1f s", within)

    async def _listen(self) -> None:
        backoff = 0.05
        while not self.closing:
            client: Any = self.client  # redis-py's pub/sub types are partly unknown
            pubsub: Any = None
            try:
                pubsub = client.pubsub()
                if isinstance(client, redis_asyncio.RedisCluster):
                    await client.initialize()  # its pub/sub needs the slot map it builds
                await pubsub.subscribe(self.channel)
                if not self.ready.done():
                    self.ready.set_result(None)
                backoff = 0.05
                async for message in pubsub.listen():
                    if message.get("type") in ("message", b"message"):
                        self._deliver(message["data"])
            except Exception as exc:
                if self.closing:
                    # Its cancellation, turned into another error by the client's cleanup
                    # (a connection dropped mid-read): stop, do not subscribe again.
                    return
                # Waiters fall back to polling meanwhile; subscribe again once Redis is back.
                # Any error, not only Redis's: a listener that stopped for good would leave
                # every waiter to the slow poll.
                if not isinstance(exc, (RedisError, OSError)):
                    logger.warning("keyserial: grant listener failed; retrying", exc_info=True)
                if not self.ready.done():
                    self.ready.set_result(None)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
            finally:
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        await pubsub.aclose()


_NOT_WAITING = object()
