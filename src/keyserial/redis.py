"""A keyed serial queue shared by processes and machines through Redis.

Extra: ``pip install "keyserial[redis]"``. See :class:`RedisKeyedQueue`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import itertools
import logging
import math
import secrets
import sys
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Mapping
from contextvars import Token
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

import redis.asyncio as redis_asyncio
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from . import _redis_scripts as scripts
from ._errors import LeaseLost
from ._fence import enter_lock_block, exit_lock_block, register_turn_code
from ._loops import drop_closed_loops
from ._protocols import KeyLock
from ._queue import KeyedSerialQueue
from ._redis_commands import LuaScript, ScriptRunner

__all__ = ["RedisKeyedQueue", "RedisUnavailable", "acl_rules", "encode_key"]

T = TypeVar("T")
P = ParamSpec("P")
Task = asyncio.Task[Any]

logger = logging.getLogger("keyserial")

#: Encoded keys longer than this are replaced by their SHA-256, so Redis key names stay short.
MAX_ENCODED_KEY = 200
#: Tuples in keys nest at most this deep.
MAX_KEY_DEPTH = 32
#: The shortest lease accepted, in seconds: a waiter polls every third of it.
MIN_LEASE = 0.1


class RedisUnavailable(ConnectionError):
    """Redis could not be reached (or answered with an error); the call did not run.

    A call never runs without holding its turn: when Redis is unreachable,
    registering or waiting fails with this error. Once Redis is back, the queue
    works again without being recreated.

    Example:
        >>> issubclass(RedisUnavailable, ConnectionError)
        True
    """


def _serialize(key: object, depth: int = 0) -> bytes:
    if isinstance(key, str):
        data = key.encode("utf-8", "surrogatepass")  # any str, lone surrogates included
        return b"s%d:%s" % (len(data), data)
    if isinstance(key, bytes):
        return b"b%d:%s" % (len(key), key)
    if isinstance(key, int):
        try:
            return b"i%d;" % key
        except ValueError:  # more digits than int() may print: hexadecimal has no such limit
            return b"x%s;" % format(key, "x").encode()
    if isinstance(key, tuple):
        if depth >= MAX_KEY_DEPTH:
            raise ValueError(
                f"RedisKeyedQueue keys are tuples nested at most {MAX_KEY_DEPTH} deep; "
                "this key is nested deeper"
            )
        return b"t%d:" % len(key) + b"".join(_serialize(item, depth + 1) for item in key)
    raise TypeError(
        f"RedisKeyedQueue keys must be str, bytes, int or tuples of them, not {type(key).__name__}"
    )


def encode_key(key: object) -> str:
    """The Redis-safe name of ``key``: distinct keys never share a name.

    The key is serialized with its type and length, so ``"1"``, ``1``,
    ``b"1"`` and ``("1",)`` all differ, then written in URL-safe base64, which
    has no character that could end the hash tag or leave the namespace. Long
    keys are replaced by their SHA-256 (prefixed so that no short key's name
    can equal a hashed one).

    Raises:
        TypeError: ``key`` is not a str, bytes, int or a tuple of them.
        ValueError: tuples in ``key`` nest deeper than ``MAX_KEY_DEPTH``.

    Example:
        >>> encode_key("seg-1") != encode_key(b"seg-1")
        True
    """
    data = _serialize(key)
    if len(data) > MAX_ENCODED_KEY:
        return "h" + hashlib.sha256(data).hexdigest()
    return "k" + base64.urlsafe_b64encode(data).decode().rstrip("=")


def _encoded_namespace(namespace: str) -> str:
    return base64.urlsafe_b64encode(namespace.encode()).decode().rstrip("=")


#: Commands the queue sends, and those its scripts run (ACLs apply inside scripts too).
_COMMANDS = (
    "evalsha eval subscribe unsubscribe ping config|get "
    "get set del exists llen lpop lpos lrem rpush pexpire time publish zadd zrem zscore"
)


def acl_rules(namespace: str) -> str:
    """The ACL rules a Redis user needs to run a ``RedisKeyedQueue`` of ``namespace``.

    The keys of the namespace (its name is base64-encoded in them), the grant channels,
    and the commands the queue and its scripts use; ``config|get`` only lets the queue
    check ``maxmemory-policy`` at start-up, and may be left out.

    Example:
        ```pycon
        >>> acl_rules("transcripts").split()[:2]
        ['resetkeys', '~keyserial:{dHJhbnNjcmlwdHM:*']

        ```
    """
    commands = " ".join(f"+{command}" for command in _COMMANDS.split())
    return (
        f"resetkeys ~keyserial:{{{_encoded_namespace(namespace)}:* resetchannels "
        f"&keyserial:grants:* -@all +hello +auth {commands}"
    )


class _Turn:
    """A turn held in Redis: its key's base name, ticket and fence, and whether it was lost."""

    __slots__ = ("base", "fence", "lost", "ticket")

    def __init__(self, base: str, ticket: str, fence: int) -> None:
        self.base = base
        self.ticket = ticket
        self.fence = fence
        self.lost = False


#: Renews a turn's lease in Redis until a time: True if renewed, False if it was lost.
Renew = Callable[["_Turn", float], Awaitable[bool]]


class _LeaseKeeper:
    """Renews a turn's lease every third of it while its call runs; on loss, interrupts the call.

    A timer, not a task, waits between renewals: a call shorter than a third of the
    lease costs no renewal at all. Each renewal is bounded by what is left of the lease:
    a Redis that does not answer by then has let the lease expire, and the turn is lost.
    """

    __slots__ = ("expires", "lease", "loop", "renew", "renewal", "task", "timer", "turn")

    def __init__(self, turn: _Turn, task: Task, lease: float, renew: Renew) -> None:
        self.turn = turn
        self.task = task
        self.lease = lease
        self.renew = renew
        self.loop = asyncio.get_running_loop()
        self.expires = self.loop.time() + lease
        self.renewal: Task | None = None
        self.timer = self.loop.call_later(lease / 3, self._due)

    def expired(self) -> bool:
        """Whether the lease may have run out: no renewal was confirmed within it."""
        return self.loop.time() >= self.expires

    def _due(self) -> None:
        self.renewal = self.loop.create_task(self._renew())

    async def _renew(self) -> None:
        asked = self.loop.time()
        try:
            renewed: bool | None = await self.renew(self.turn, self.expires)
        except (RedisUnavailable, TimeoutError):
            renewed = None  # not confirmed: the lease may still hold
        if renewed:
            self.expires = asked + self.lease
        if renewed or (renewed is None and not self.expired()):
            # Renewed: again in a third of the lease. Not confirmed: try again soon.
            delay = self.lease / 3 if renewed else min(self.lease / 10, 0.5)
            self.timer = self.loop.call_later(delay, self._due)
            return
        self.turn.lost = True
        self.task.cancel(msg="keyserial: lease lost")

    def stop(self) -> None:
        self.timer.cancel()
        if self.renewal is not None:
            self.renewal.cancel()


def _time_up(granted: asyncio.Future[int | None]) -> None:
    if not granted.done():
        granted.set_result(None)


def _text(value: object) -> str:
    """A reply as text, from a client with or without ``decode_responses``."""
    return value.decode() if isinstance(value, bytes) else str(value)


class _Subscriber:
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
        self.ready = asyncio.get_running_loop().create_future()
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

    def _deliver(self, message: bytes | str) -> None:
        try:
            _base, ticket, text = _text(message).split("|")
            fence = int(text)
        except ValueError:
            return  # not a grant of ours
        waiting = self.waiting.get(ticket, _NOT_WAITING)
        if waiting is _NOT_WAITING:
            return  # nobody waits for this ticket any more
        if isinstance(waiting, asyncio.Future) and not waiting.done():
            waiting.set_result(fence)
        else:  # its request has not returned yet, or its poll timer just fired
            self.waiting[ticket] = fence

    async def _listen(self) -> None:
        backoff = 0.05
        while True:
            client = self.client
            pubsub = None
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
                        await pubsub.aclose()  # type: ignore[no-untyped-call]


_NOT_WAITING = object()


class RedisKeyedQueue:
    """A keyed serial queue whose turns are granted by Redis, for many processes at once.

    Calls with the same key, made in any process connected to the same Redis
    with the same ``namespace``, run one at a time: at most one holds the turn
    while leases hold. Turns are granted first come, first served in the order
    requests reach Redis (a ticket queue per key), and within one process in
    registration order. A waiter is woken by a Redis pub/sub message on its
    process's own channel within one round trip of the release; a slow poll
    (``lease / 3``) is the fallback for a lost message and the heartbeat that
    keeps its ticket alive. Needs Redis 6.2 or later.

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
        self._client = client
        self._namespace = _encoded_namespace(namespace)
        self._lease = float(lease)
        self._lease_ms = max(1, int(lease * 1000))
        self._poll = lease / 3
        # How long a caller waits for its release before it goes on in the background.
        self._release_wait = min(lease / 3, max(0.1, lease / 10))
        self._local = KeyedSerialQueue(max_pending=max_pending)
        self._scripts = ScriptRunner(client)
        self._acquire_script = LuaScript(scripts.ACQUIRE)
        self._poll_script = LuaScript(scripts.POLL)
        self._release_script = LuaScript(scripts.RELEASE)
        self._renew_script = LuaScript(scripts.RENEW)
        self._subscribers: dict[asyncio.AbstractEventLoop, _Subscriber] = {}
        self._held: dict[tuple[Task, str], _Turn] = {}
        self._background: set[Task] = set()
        self._policy_checked = False

    @property
    def lease(self) -> float:
        """Seconds a turn is held without renewal."""
        return self._lease

    # -- Redis operations -----------------------------------------------------------------

    def _base(self, encoded: str) -> str:
        """The name the scripts derive the key's Redis keys from; its braces are a hash tag."""
        return f"keyserial:{{{self._namespace}:{encoded}}}"

    async def _script(
        self, script: LuaScript, base: str, *args: str | int, deadline: float | None = None
    ) -> Any:
        """Run ``script``; bounded by ``deadline`` (TimeoutError) and by a lease.

        A Redis that does not answer within a lease (stalled, paused, cut off) raises
        RedisUnavailable: no call waits on it for ever, whether or not it has a timeout.
        """
        loop = asyncio.get_running_loop()
        limit = loop.time() + self._lease
        times_out = deadline is not None and deadline <= limit
        task: Task = asyncio.current_task()  # type: ignore[assignment]
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            task.cancel()

        timer = loop.call_at(deadline if times_out else limit, expire)  # type: ignore[arg-type]
        try:
            return await self._scripts.call(script, base, *args)
        except asyncio.CancelledError:
            if not expired:
                raise
            if sys.version_info >= (3, 11):
                task.uncancel()
            if times_out:
                raise TimeoutError(f"timed out waiting for the turn of {base!r}") from None
            raise RedisUnavailable(
                f"Redis did not answer within the lease ({self._lease} s)"
            ) from None
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise RedisUnavailable(f"Redis is unreachable: {exc}") from exc
        except RedisError as exc:
            raise RedisUnavailable(f"Redis refused the request: {exc}") from exc
        finally:
            timer.cancel()

    def _in_background(self, work: Coroutine[Any, Any, Any]) -> Task:
        """Run ``work`` on its own, kept until it ends; its failure is only logged."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background_done)
        return task

    def _background_done(self, task: Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            logger.debug("keyserial: background release failed: %r", error)

    async def _subscriber(self) -> _Subscriber:
        loop = asyncio.get_running_loop()
        subscriber = self._subscribers.get(loop)
        if subscriber is None or subscriber.task.done():
            drop_closed_loops(self._subscribers)
            subscriber = self._subscribers[loop] = _Subscriber(self._client)
        if not subscriber.ready.done():
            # Bounded like any Redis request: a listener that cannot subscribe gives way to
            # polling, and the request itself then reports what is wrong.
            timer = loop.call_later(self._lease, _time_up, subscriber.ready)
            try:
                await asyncio.shield(subscriber.ready)
            finally:
                timer.cancel()
            if not self._policy_checked:
                self._policy_checked = True
                await self._check_eviction_policy()
        return subscriber

    async def _check_eviction_policy(self) -> None:
        """Warn once if Redis may evict keys: an evicted holder lets two callers in at once."""
        try:
            reply = await asyncio.wait_for(
                self._client.config_get("maxmemory-policy"), timeout=self._lease
            )
        except Exception:  # CONFIG not allowed (ACL, managed Redis) or not answered: unknown
            logger.debug("keyserial: could not read maxmemory-policy", exc_info=True)
            return
        values = list(reply.values()) if isinstance(reply, dict) else []
        policy = _text(values[0]) if values else "noeviction"
        if policy != "noeviction":
            logger.warning(
                "keyserial: Redis's maxmemory-policy is %r; it must be 'noeviction': an evicted "
                "turn lets two callers hold one key at once",
                policy,
            )

    async def _acquire(self, encoded: str, deadline: float | None) -> _Turn:
        subscriber = await self._subscriber()
        base = self._base(encoded)
        while True:  # once more each time Redis lost the ticket (a restart)
            ticket = subscriber.new_ticket()
            try:
                reply = _text(
                    await self._script(
                        self._acquire_script, base, self._lease_ms, ticket, deadline=deadline
                    )
                )
                if reply and reply != "-":
                    return _Turn(base, ticket, int(reply))
                fence = await self._wait(subscriber, base, ticket, deadline)
            except BaseException:
                # Leave the queue, passing the turn on if it came meanwhile: in the
                # background, so that a stalled Redis does not hold this caller too. If it
                # cannot be sent, the ticket's heartbeat stops and Redis skips it in time.
                self._in_background(self._leave(base, ticket))
                raise
            finally:
                subscriber.forget(ticket)
            if fence is not None:
                return _Turn(base, ticket, fence)

    async def _wait(
        self, subscriber: _Subscriber, base: str, ticket: str, deadline: float | None
    ) -> int | None:
        """The fence once ``ticket`` is granted; None if Redis forgot the ticket."""
        loop = asyncio.get_running_loop()
        while True:
            wait = self._poll
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - loop.time()))
            granted = subscriber.expect(ticket)
            # A timer rather than asyncio.wait(): every contended turn waits here once, and
            # the timer is the cheaper of the two.
            timer = loop.call_later(wait, _time_up, granted)
            try:
                fence = await granted
            finally:
                timer.cancel()
            if fence is not None:
                return fence
            if deadline is not None and loop.time() >= deadline:
                raise TimeoutError(f"timed out waiting for the turn of {base!r}")
            status, fence = await self._script(
                self._poll_script, base, ticket, self._lease_ms, deadline=deadline
            )
            status = _text(status)
            if status == "granted":
                return int(fence)
            if status == "lost":
                return None

    async def _leave(self, base: str, ticket: str) -> bool:
        """Take ``ticket`` out of the key's queue, passing the turn on; True if it held it."""
        return bool(await self._script(self._release_script, base, ticket, self._lease_ms))

    async def _renew(self, turn: _Turn, until: float) -> bool:
        """Extend ``turn``'s lease, bounded by when it expires; False if it was lost."""
        holder = f"{turn.ticket}:{turn.fence}"
        renewed = await self._script(
            self._renew_script, turn.base, holder, self._lease_ms, deadline=until
        )
        return bool(renewed)

    # -- running calls --------------------------------------------------------------------

    async def _take(
        self, encoded: str, deadline: float | None, task: Task
    ) -> tuple[_Turn, _LeaseKeeper]:
        """Acquire ``encoded``'s turn for ``task`` and keep its lease renewed."""
        turn = await self._acquire(encoded, deadline)
        self._held[(task, encoded)] = turn
        return turn, _LeaseKeeper(turn, task, self._lease, self._renew)

    async def _give_back(self, encoded: str, turn: _Turn, keeper: _LeaseKeeper, task: Task) -> bool:
        """End ``task``'s turn of ``encoded``; True if its lease was lost while it ran.

        The caller waits for the release only briefly: against a Redis that does not
        answer, the release goes on in the background (bounded by a lease, after which the
        turn has expired anyway) and the lease keeper's own account decides whether the
        lease held.
        """
        keeper.stop()
        del self._held[(task, encoded)]
        lost = turn.lost or keeper.expired()
        release = self._in_background(self._leave(turn.base, turn.ticket))
        if await _finished_within(release, self._release_wait):
            if release.cancelled() or release.exception() is not None:
                logger.warning(
                    "keyserial: could not release key %r; its lease will expire", encoded
                )
            elif not release.result():
                lost = True  # Redis no longer had it as the holder: the lease ran out
        return lost

    async def _turn(
        self,
        encoded: str,
        fn: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        deadline: float | None,
    ) -> T:
        task: Task = asyncio.current_task()  # type: ignore[assignment]
        turn = self._held.get((task, encoded))
        if turn is not None:  # re-entry: the outer turn holds the key
            return await fn(*args, **kwargs)
        turn, keeper = await self._take(encoded, deadline, task)
        try:
            result = await fn(*args, **kwargs)
        except asyncio.CancelledError:
            if turn.lost:
                if sys.version_info >= (3, 11):
                    task.uncancel()
                raise LeaseLost(encoded, turn.fence) from None
            raise
        finally:
            lost = await self._give_back(encoded, turn, keeper, task)
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
        return self.call(key, fn, args, kwargs)

    async def call(
        self,
        key: Hashable,
        fn: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None = None,
        group: Hashable | None = None,
    ) -> T:
        """[run][keyserial.redis.RedisKeyedQueue.run] with a bound on the wait for the turn.

        ``timeout`` bounds the local and the Redis waits together, whatever Redis does: on
        expiry the built-in ``TimeoutError`` is raised and ``fn`` never starts.

        Raises:
            ValueError: ``group`` is given (coalescing is in-process only).
            TimeoutError: the turn did not come within ``timeout`` seconds.
            TypeError, RedisUnavailable, LeaseLost, QueueClosed, QueueFull: as for ``run``.
        """
        if group is not None:
            raise ValueError("RedisKeyedQueue does not coalesce: group= is in-process only")
        encoded = encode_key(key)
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        return await self._local.call(
            encoded, self._turn, (encoded, fn, args, kwargs, deadline), {}, timeout
        )

    def submit(
        self, key: Hashable, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs
    ) -> asyncio.Task[T]:
        """Start ``run`` as a new task, registered in this process before returning."""
        encoded = encode_key(key)
        return self._local.submit(encoded, self._turn, encoded, fn, args, kwargs, None)

    def lock(self, key: Hashable, timeout: float | None = None) -> KeyLock:
        """Hold ``key``'s turn for the body of an ``async with`` block."""
        return _RedisLock(self, encode_key(key), timeout)

    async def join(self) -> None:
        """Wait until this process has no registered work."""
        await self._local.join()

    async def aclose(self) -> None:
        """Refuse new work here, wait for the registered work, and stop listening for grants.

        Releases still going on in the background are given up to a lease to finish.
        """
        await self._local.aclose()
        loop = asyncio.get_running_loop()
        pending = [task for task in self._background if task.get_loop() is loop]
        if pending:
            await asyncio.wait(pending, timeout=self._lease)
        subscriber = self._subscribers.pop(loop, None)
        if subscriber is not None:
            subscriber.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await subscriber.task
        await self._scripts.close()


async def _finished_within(task: Task, seconds: float) -> bool:
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


class _RedisLock:
    """``RedisKeyedQueue.lock()``: the local turn, then the Redis turn, for a block."""

    __slots__ = (
        "_encoded",
        "_fence_token",
        "_keeper",
        "_local",
        "_queue",
        "_task",
        "_timeout",
        "_turn",
    )

    def __init__(self, queue: RedisKeyedQueue, encoded: str, timeout: float | None) -> None:
        self._queue = queue
        self._encoded = encoded
        self._timeout = timeout
        self._local = queue._local.lock(encoded, timeout)
        self._turn: _Turn | None = None
        self._task: Task | None = None
        self._keeper: _LeaseKeeper | None = None
        self._fence_token: Token[Any] | None = None

    async def __aenter__(self) -> None:
        queue, encoded = self._queue, self._encoded
        loop = asyncio.get_running_loop()
        deadline = None if self._timeout is None else loop.time() + self._timeout
        await self._local.__aenter__()
        task: Task = asyncio.current_task()  # type: ignore[assignment]
        turn = queue._held.get((task, encoded))
        if turn is None:  # not a re-entry: take the Redis turn for this block
            try:
                turn, self._keeper = await queue._take(encoded, deadline, task)
            except BaseException:
                await self._local.__aexit__(None, None, None)
                raise
            self._turn, self._task = turn, task
        held = turn
        self._fence_token = enter_lock_block(sys._getframe(1), lambda: held.fence)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if self._fence_token is not None:
            exit_lock_block(self._fence_token)
            self._fence_token = None
        turn, keeper, task, lost = self._turn, self._keeper, self._task, False
        self._turn = self._keeper = self._task = None
        try:
            if turn is not None and keeper is not None and task is not None:
                lost = await self._queue._give_back(self._encoded, turn, keeper, task)
        finally:
            # The process's own turn is given back whatever became of the Redis release
            # (cancelled, failed): a release that could not be sent is left to the lease.
            await self._local.__aexit__(exc_type, exc, tb)
        if turn is not None and task is not None and lost:
            if isinstance(exc, asyncio.CancelledError) and sys.version_info >= (3, 11):
                task.uncancel()
            raise LeaseLost(self._encoded, turn.fence)
        return False


def _redis_turn_fence(frame: Mapping[str, Any]) -> int | None:
    turn = frame.get("turn")
    return turn.fence if isinstance(turn, _Turn) else None


register_turn_code(RedisKeyedQueue._turn.__code__, _redis_turn_fence)
