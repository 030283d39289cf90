"""The broker behind a ``KeyedStream``: partitions that one owner at a time reads and acks.

A source keeps the broker's own words out of the consumer. Redis Streams is the first
(``RedisStreamSource``); a NATS JetStream or Kafka adapter implements the same methods.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from ._message import DeadLetter


class PartitionLost(Exception):
    """The broker refused a fenced request: another owner holds the partition now."""


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
    """

    partitions: int

    def partition_of(self, key: Hashable) -> int:
        """The partition ``key``'s messages go to."""
        ...

    async def publish(self, key: Hashable, fields: Mapping[str, str | bytes | int | float]) -> str:
        """Append a message to ``key``'s partition; its id."""
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
