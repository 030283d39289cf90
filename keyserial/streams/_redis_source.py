"""``RedisStreamSource``: partitions as Redis streams, owned through the Redis backend's turns.

Partition ``p`` of stream ``name`` is a turn of ``RedisKeyedQueue(namespace="keyserial.streams/
<name>")`` for the key ``p``: the owner waits for it like any caller, holds it under a lease
renewed in the background, and loses it (its task cancelled) when the lease runs out. The
partition's stream and dead letters share the turn's hash tag, so each fenced script checks
the turn's holder in the same slot it reads and acknowledges in.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncGenerator, Hashable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, cast

import redis.asyncio as redis_asyncio
from redis.exceptions import MaxConnectionsError, RedisError

from .._errors import LeaseLost
from .._keycodec import deserialize_key, serialize_key
from ..redis._lock import RedisLock
from ..redis._names import acl_rules as redis_acl_rules
from ..redis._names import base_name, encode_key, encoded_namespace
from ..redis._queue import RedisKeyedQueue
from ..redis._transport import LuaScript, ScriptRunner, text
from . import _redis_scripts as scripts
from ._message import DeadLetter
from ._source import (
    RESERVED_PREFIX,
    Entry,
    PartitionLost,
    StreamSource,
    Value,
    check_stream,
    checked_fields,
    partition_for,
)

#: The field that carries a message's key; user fields may not use the ``keyserial.`` prefix.
KEY_FIELD = "keyserial.key"

#: Seconds an idle partition waits before reading again when no connection was free to block on.
POLL_WITHOUT_CONNECTION = 0.05
#: Idle partitions that wait on a blocking read at once, at most (each holds a connection).
MAX_BLOCKING_WAITS = 16


def key_field_of(data: bytes) -> str:
    """The ``KEY_FIELD`` value of a message whose key serializes to ``data``."""
    return base64.b64encode(data).decode()


def _as_text(value: object) -> str:
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else str(value)


#: Commands a consumer and a producer send beyond the Redis backend's (see acl_rules).
_STREAM_COMMANDS = (
    "xadd xread xreadgroup xack xautoclaim xclaim xpending xrange xrevrange xtrim "
    "xinfo|groups xinfo|consumers xgroup|create xgroup|delconsumer xlen zrange zremrangebyscore"
)


def acl_rules(name: str) -> str:
    """The ACL rules a Redis user needs to publish to and consume the ``KeyedStream`` ``name``.

    The stream's keys (partitions, their turns and dead letters, its members), the
    partitions' grant channels, and the commands used. A user with these rules can
    neither read nor write another stream's keys.

    Example:
        ```pycon
        >>> "+xautoclaim" in acl_rules("transcripts").split()
        True

        ```
    """
    commands = " ".join(f"+{command}" for command in _STREAM_COMMANDS.split())
    return f"{redis_acl_rules(stream_namespace(name))} {commands}"


def stream_namespace(name: str) -> str:
    """The Redis backend namespace of ``name``'s partitions (they are its turns)."""
    return f"keyserial.streams/{name}"


class RedisStreamSource(StreamSource):
    """Partitions of one keyed stream in Redis (see the module docstring).

    Raises:
        TypeError: ``client`` is not an asyncio Redis client, or ``name`` not a str.
        ValueError: ``name`` is empty, ``partitions`` is not a positive int, or ``lease``
            is below the Redis backend's ``MIN_LEASE``.
    """

    errors: tuple[type[Exception], ...] = (RedisError, ConnectionError, TimeoutError)
    acks_in_attempt = False

    def __init__(
        self,
        client: redis_asyncio.Redis | redis_asyncio.RedisCluster,
        name: str,
        partitions: int,
        lease: float,
    ) -> None:
        if not isinstance(client, (redis_asyncio.Redis, redis_asyncio.RedisCluster)):
            raise TypeError(
                "KeyedStream needs a redis.asyncio.Redis or redis.asyncio.RedisCluster "
                f"client, not {type(client).__module__}.{type(client).__qualname__}"
            )
        check_stream(name, partitions)
        namespace = stream_namespace(name)
        self.partitions = partitions
        self.lease = float(lease)
        self._client = client
        self._owners = RedisKeyedQueue(client, namespace, lease)
        encoded = encoded_namespace(namespace)
        self._bases = [base_name(encoded, encode_key(p)) for p in range(partitions)]
        # Inside the namespace's key pattern (see acl_rules); no encoded key starts with "m".
        self._members_key = f"keyserial:{{{encoded}:members}}"
        # The pool is shared with the partitions' turns (half of it for their scripts): a
        # quarter for reads and acks, and at most a quarter for idle partitions' waits.
        self._runner = ScriptRunner(client, share=0.25)
        # A cluster client has a pool per node, each bounded by its own max_connections.
        pool = getattr(client, "connection_pool", client)
        bound = getattr(pool, "max_connections", None) or 100
        self._waits = asyncio.Semaphore(max(1, min(MAX_BLOCKING_WAITS, bound // 4 - 1)))
        self._claim = LuaScript(scripts.CLAIM)
        self._read = LuaScript(scripts.READ)
        self._ack = LuaScript(scripts.ACK)
        self._dead = LuaScript(scripts.DEAD_LETTER)
        self._set_deliveries = LuaScript(scripts.SET_DELIVERIES)
        self._members = LuaScript(scripts.MEMBERS)
        self._lag = LuaScript(scripts.LAG)
        self._held: dict[int, _Ownership] = {}  # the partitions owned here, by their blocks

    def stream_name(self, partition: int) -> str:
        """The Redis key of ``partition``'s stream."""
        return self._bases[partition] + ":stream"

    def dead_letter_name(self, partition: int) -> str:
        """The Redis key of ``partition``'s dead-letter stream."""
        return self._bases[partition] + ":dead"

    def partition_of(self, key: Hashable) -> int:
        """A stable hash of the serialized key, the same in every process and version."""
        return partition_for(serialize_key(key, "KeyedStream"), self.partitions)

    async def publish(
        self, key: Hashable, fields: Mapping[str, Value], connection: object = None
    ) -> str:
        if connection is not None:
            raise TypeError(
                "a KeyedStream on Redis publishes on its own: connection= is for a stream "
                "on PostgreSQL, whose messages can join the caller's transaction"
            )
        data = serialize_key(key, "KeyedStream")
        message: dict[str, Value] = {KEY_FIELD: key_field_of(data), **checked_fields(fields)}
        partition = partition_for(data, self.partitions)
        reply = await self._client.xadd(self.stream_name(partition), message)  # type: ignore[arg-type]
        return text(reply)

    def attempt(
        self, partition: int, fence: int, entry: Entry
    ) -> AbstractAsyncContextManager[bool]:
        return _no_transaction()

    def own(self, partition: int) -> AbstractAsyncContextManager[int]:
        return _Ownership(self._owners, partition, self._held)

    def holds(self, partition: int, fence: int) -> bool:
        ownership = self._held.get(partition)
        return ownership is not None and ownership.fence == fence and ownership.holds()

    async def lag(self, partition: int) -> int:
        reply = await self._runner.call(self._lag, self._bases[partition])
        return int(reply)

    async def _script(self, script: LuaScript, partition: int, *args: str | int) -> Any:
        reply = await self._runner.call(script, self._bases[partition], *args)
        if text(reply[0]) == "fenced":
            raise PartitionLost(f"partition {partition} has another owner now")
        return reply

    async def claim(
        self, partition: int, fence: int, consumer: str, start: str, count: int
    ) -> tuple[str, Sequence[Entry]]:
        reply = await self._script(self._claim, partition, fence, consumer, start, count)
        entries = [
            entry_of(raw, int(deliveries))
            for raw, deliveries in zip(reply[2], reply[3], strict=True)
        ]
        return text(reply[1]), entries

    async def set_deliveries(
        self, partition: int, fence: int, consumer: str, deliveries: Sequence[tuple[str, int]]
    ) -> None:
        flat = [part for pair in deliveries for part in pair]
        await self._script(self._set_deliveries, partition, fence, consumer, *flat)

    async def read(
        self, partition: int, fence: int, consumer: str, count: int
    ) -> Sequence[Entry] | str:
        reply = await self._script(self._read, partition, fence, consumer, count)
        if text(reply[0]) == "empty":
            return text(reply[1])
        return [entry_of(raw, 1) for raw in reply[1]]

    async def wait(self, partition: int, after: str, timeout: float) -> None:
        if self._waits.locked():
            # As many idle partitions as the pool can spare wait on a connection each;
            # the others poll.
            await asyncio.sleep(POLL_WITHOUT_CONNECTION)
            return
        async with self._waits:
            try:
                block = max(1, int(timeout * 1000))
                await self._client.xread({self.stream_name(partition): after}, count=1, block=block)
            except MaxConnectionsError:
                # The pool's connections are out (the application's own calls): poll instead.
                await asyncio.sleep(POLL_WITHOUT_CONNECTION)

    async def ack(self, partition: int, fence: int, ids: Sequence[str]) -> int:
        reply = await self._script(self._ack, partition, fence, *ids)
        return int(reply[1])

    async def dead_letter(self, partition: int, fence: int, entry: Entry, error: str) -> None:
        flat: list[str | int] = []
        if entry.malformed is None:
            flat += [KEY_FIELD, key_field_of(serialize_key(entry.key, "KeyedStream"))]
        for name, value in entry.fields.items():
            flat += [name, value]
        await self._script(self._dead, partition, fence, entry.id, entry.deliveries, error, *flat)

    async def dead_letters(self, partition: int, count: int) -> Sequence[DeadLetter]:
        found: list[DeadLetter] = []
        rows: Any = await self._client.xrange(self.dead_letter_name(partition), count=count)
        for dead_id, flat in rows:
            entry = entry_of([dead_id, [part for pair in flat.items() for part in pair]], 1)
            fields = dict(entry.fields)
            found.append(
                DeadLetter(
                    entry.key,
                    {
                        name: value
                        for name, value in fields.items()
                        if not name.startswith(RESERVED_PREFIX)
                    },
                    fields["keyserial.id"],
                    partition,
                    fields["keyserial.error"],
                    entry.id,
                    int(fields.get("keyserial.deliveries", 1)),
                )
            )
        return found

    async def members(self, member: str, ttl: float, *, leaving: bool = False) -> list[str]:
        reply = await self._runner.call(
            self._members, self._members_key, member, max(1, int(ttl * 1000)), int(leaving)
        )
        return sorted(text(name) for name in reply)

    async def aclose(self) -> None:
        await self._owners.aclose()
        await self._runner.close()


@asynccontextmanager
async def _no_transaction() -> AsyncGenerator[bool, None]:
    """Redis has no transaction around a handler: the ack follows it, on its own."""
    yield True


class _Ownership:
    """``async with``: hold a partition's turn; its value is the turn's fence.

    On entering, a lease that may be short by the local measure (a turn granted after a
    long wait) is renewed first, so that the owner starts with a lease it can count on.
    """

    __slots__ = ("_held", "_lock", "_partition", "fence")

    def __init__(
        self, owners: RedisKeyedQueue, partition: int, held: dict[int, _Ownership]
    ) -> None:
        self._lock = cast("RedisLock", owners.lock(partition))
        self._partition = partition
        self._held = held
        self.fence: int | None = None

    def holds(self) -> bool:
        return self._lock.holds()

    async def __aenter__(self) -> int:
        await self._lock.__aenter__()
        fence = self._lock.fence
        assert fence is not None  # a partition's block is never a re-entry
        try:
            if not await self._lock.confirm():
                raise LeaseLost(encode_key(self._partition), fence)
        except BaseException:
            await self._lock.__aexit__(None, None, None)
            raise
        self.fence = fence
        self._held[self._partition] = self
        return fence

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        if self._held.get(self._partition) is self:
            del self._held[self._partition]
        return await self._lock.__aexit__(*exc_info)


def entry_of(raw: Sequence[Any], deliveries: int) -> Entry:
    """An ``Entry`` from a stream entry as Redis sends it: ``[id, [field, value, ...]]``."""
    flat = raw[1]
    fields: dict[str, str] = {}
    key: Hashable = None
    malformed: str | None = f"no {KEY_FIELD} field: not published by a KeyedStream"
    for i in range(0, len(flat), 2):
        name = _as_text(flat[i])
        if name == KEY_FIELD:
            try:
                key = deserialize_key(base64.b64decode(flat[i + 1], validate=True))
            except ValueError as exc:  # binascii.Error is a ValueError
                fields[name] = _as_text(flat[i + 1])  # kept as it was, for the dead letter
                malformed = f"{KEY_FIELD} is not a key serialized by KeyedStream ({exc})"
            else:
                malformed = None
        else:
            fields[name] = _as_text(flat[i + 1])
    return Entry(text(raw[0]), key, fields, deliveries, malformed)
