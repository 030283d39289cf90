"""The broker behind a ``KeyedStream``: partitions that one owner at a time reads and acks.

A source keeps the broker's own words out of the consumer. Redis Streams
(``RedisStreamSource``) and PostgreSQL (``PostgresStreamSource``) implement it; a NATS
JetStream or Kafka adapter implements the same methods.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Hashable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from ._message import DeadLetter

#: What a message's field values may be; handlers see them all as str.
Value = str | bytes | int | float
#: User fields may not start with it: the sources keep their own fields under it.
RESERVED_PREFIX = "keyserial."


class PartitionLost(Exception):
    """The broker refused a fenced request: another owner holds the partition now."""


class AttemptFailed(Exception):
    """The broker failed around a handler's attempt, not the handler: the attempt's
    transaction could not begin, or its commit (with the acknowledgement) failed or was
    not confirmed. The message stays unacknowledged as far as this owner knows, so its key
    must not move on here; a new ownership runs it again first (or finds it acknowledged).
    """


def check_stream(name: object, partitions: object) -> None:
    """Refuse a stream's name or partition count before anything is sent.

    Raises:
        TypeError: ``name`` is not a str.
        ValueError: ``name`` is empty, or ``partitions`` is not a positive int.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, not {type(name).__name__}")
    if not name:
        raise ValueError("name must be a non-empty string")
    if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
        raise ValueError(f"partitions must be a positive int, got {partitions!r}")


def partition_for(data: bytes, partitions: int) -> int:
    """The partition of a key serialized to ``data``: a stable hash, the same everywhere."""
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return int.from_bytes(digest, "big") % partitions


def checked_fields(fields: Mapping[str, Value]) -> dict[str, Value]:
    """``fields`` as a dict, once every name and value is one a stream can carry.

    Raises:
        TypeError: ``fields`` is not a mapping, or a name or value has another type.
        ValueError: a name starts with ``keyserial.``, or a float is not finite.
    """
    if not isinstance(fields, Mapping):
        raise TypeError(f"fields must be a mapping, not {type(fields).__name__}")
    checked: dict[str, Value] = {}
    for name, value in fields.items():
        if not isinstance(name, str):
            raise TypeError(f"field names must be str, not {type(name).__name__}")
        if name.startswith(RESERVED_PREFIX):
            raise ValueError(f"field names starting with {RESERVED_PREFIX!r} are reserved")
        if isinstance(value, bool) or not isinstance(value, (str, bytes, int, float)):
            raise TypeError(
                f"field {name!r} must be str, bytes, int or float, not {type(value).__name__}"
            )
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"field {name!r} is not a finite number: {value!r}")
        checked[name] = value
    return checked


@dataclass(frozen=True, slots=True)
class Entry:
    """One message as the broker holds it: its id, key, fields and how often it was delivered.

    ``malformed`` says why an entry that was not published by a ``KeyedStream`` (no key, or
    one that cannot be read) cannot be handled; such an entry is dead-lettered at once.
    """

    id: str
    key: Hashable
    fields: Mapping[str, str]
    deliveries: int = 1
    malformed: str | None = None


class StreamSource(Protocol):
    """What a ``KeyedStream`` needs of a broker.

    Guarantees a source must give: ``partition_of`` is the same in every process; one
    ``own`` block at a time holds a partition across all processes, and its fence is larger
    than every earlier owner's; ``claim``, ``read``, ``ack`` and ``dead_letter`` raise
    ``PartitionLost`` instead of acting for an owner whose fence is no longer current;
    ``read`` hands out each message once, in partition order, after every message ``claim``
    could still return.

    A source whose ``acks_in_attempt`` is True acknowledges a message in ``attempt``'s
    block, in the same transaction as the handler's writes; ``ack`` is then never called.
    """

    partitions: int
    #: The exceptions by which the broker says it is unreachable or failed a request.
    errors: tuple[type[Exception], ...]
    #: Whether ``attempt``'s block acknowledges the message when the handler returns.
    acks_in_attempt: bool

    def partition_of(self, key: Hashable) -> int:
        """The partition ``key``'s messages go to."""
        ...

    async def publish(
        self, key: Hashable, fields: Mapping[str, Value], connection: object = None
    ) -> str:
        """Append a message to ``key``'s partition; its id.

        ``connection``: a connection of the broker's whose open transaction the message
        joins; None to publish on its own. A source without transactions refuses any other.
        """
        ...

    def attempt(
        self, partition: int, fence: int, entry: Entry
    ) -> AbstractAsyncContextManager[bool]:
        """The block one attempt of ``entry``'s handler runs in.

        Its value is False when the message needs no handling any more (an earlier
        attempt's transaction did commit its acknowledgement). Raises ``PartitionLost``
        on entering when ``fence`` is no longer current, and ``AttemptFailed`` when the
        broker fails around the handler; the handler's own exception passes through.
        """
        ...

    def own(self, partition: int) -> AbstractAsyncContextManager[int]:
        """Wait for, then hold, ``partition``: the block's value is its fence.

        A lost lease cancels the block's task, and leaving the block then raises
        ``keyserial.LeaseLost``.
        """
        ...

    def holds(self, partition: int, fence: int) -> bool:
        """Whether this process surely still owns ``partition`` with ``fence``, judged
        locally and at once: False from the moment its lease may have run out (measured
        from before the request that granted or last renewed it), or once it was lost."""
        ...

    async def lag(self, partition: int) -> int:
        """How many of ``partition``'s messages no consumer has been handed yet."""
        ...

    async def claim(
        self, partition: int, fence: int, consumer: str, start: str, count: int
    ) -> tuple[str, Sequence[Entry]]:
        """Up to ``count`` unacknowledged messages of earlier owners, oldest first.

        Returns the position to continue from, ``"0-0"`` once there are no more.
        """
        ...

    async def set_deliveries(
        self, partition: int, fence: int, consumer: str, deliveries: Sequence[tuple[str, int]]
    ) -> None:
        """Set the delivery counts of claimed messages: ``(id, deliveries)`` pairs."""
        ...

    async def read(
        self, partition: int, fence: int, consumer: str, count: int
    ) -> Sequence[Entry] | str:
        """Up to ``count`` new messages, or, with none, the id of the newest message."""
        ...

    async def wait(self, partition: int, after: str, timeout: float) -> None:
        """Return when a message newer than ``after`` may be there, or after ``timeout``."""
        ...

    async def ack(self, partition: int, fence: int, ids: Sequence[str]) -> int:
        """Acknowledge finished messages; returns the partition's lag (unread messages)."""
        ...

    async def dead_letter(self, partition: int, fence: int, entry: Entry, error: str) -> None:
        """Move ``entry`` with ``error`` to the dead letters, acknowledging it."""
        ...

    async def dead_letters(self, partition: int, count: int) -> Sequence[DeadLetter]:
        """Up to ``count`` of ``partition``'s dead letters, oldest first."""
        ...

    async def members(self, member: str, ttl: float, *, leaving: bool = False) -> list[str]:
        """Renew ``member``'s membership for ``ttl`` seconds (or end it); the live members."""
        ...

    async def aclose(self) -> None:
        """Give back what the source holds (ownerships end with their blocks)."""
        ...
