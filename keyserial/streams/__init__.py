"""Keyed stream consumers on Redis Streams or PostgreSQL: per-key order at any concurrency,
across processes.

Extra: ``pip install "keyserial[redis]"`` for a stream on Redis, ``"keyserial[postgres]"``
for one on PostgreSQL. See [KeyedStream][keyserial.streams.KeyedStream].

The modules: ``_stream`` (the stream and its consumer's partitions), ``_partition`` (one
ownership of one partition: takeover, reads, per-key handling, acks), ``_assignment``
(which partitions each consumer owns), ``_source`` (the broker protocol),
``_redis_source`` and ``_redis_scripts`` (Redis Streams behind it), ``_postgres_source``
(PostgreSQL tables behind it: messages, acks in the handler's transaction) and
``_postgres_owners`` (partition ownership and notifications on PostgreSQL), ``_message``
(what handlers and ``stats()`` see).
"""

from typing import TYPE_CHECKING, Any

from .._extras import require_extra
from ._message import DeadLetter, StreamMessage, StreamStats
from ._source import AttemptFailed, Entry, PartitionLost, StreamSource
from ._stream import KeyedStream

if TYPE_CHECKING:
    from ._redis_source import RedisStreamSource, acl_rules

__all__ = [
    "AttemptFailed",
    "DeadLetter",
    "Entry",
    "KeyedStream",
    "PartitionLost",
    "RedisStreamSource",
    "StreamMessage",
    "StreamSource",
    "StreamStats",
    "acl_rules",
]

_REDIS_NAMES = frozenset({"RedisStreamSource", "acl_rules"})


def __getattr__(name: str) -> Any:
    """``RedisStreamSource`` and ``acl_rules``, imported when first used: they need the
    ``redis`` extra, which a stream on PostgreSQL does without."""
    if name in _REDIS_NAMES:
        require_extra("keyserial.streams on Redis", "redis", "redis")
        from . import _redis_source

        return getattr(_redis_source, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
