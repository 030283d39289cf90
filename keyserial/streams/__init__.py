"""Keyed stream consumers on Redis Streams: per-key order at any concurrency, across processes.

Extra: ``pip install "keyserial[redis]"``. See [KeyedStream][keyserial.streams.KeyedStream].

The modules: ``_stream`` (the stream and its consumer's partitions), ``_partition`` (one
ownership of one partition: takeover, reads, per-key handling, acks), ``_assignment``
(which partitions each consumer owns), ``_source`` (the broker protocol),
``_redis_source`` and ``_redis_scripts`` (Redis Streams behind it), ``_message`` (what
handlers and ``stats()`` see).
"""

from .._extras import require_extra

require_extra("keyserial.streams", "redis", "redis")
from ._message import DeadLetter, StreamMessage, StreamStats
from ._redis_source import RedisStreamSource, acl_rules
from ._source import Entry, PartitionLost, StreamSource
from ._stream import KeyedStream

__all__ = [
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
