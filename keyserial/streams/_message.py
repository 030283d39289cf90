"""What a stream handler is given, and what ``KeyedStream.stats()`` reports."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class StreamMessage:
    """One message, as its handler sees it.

    ``id`` is the message's id in its partition (ids grow with publication order, so a
    handler can refuse a message older than one it already applied); ``attempt`` counts
    this owner's attempts (1 on the first); ``deliveries`` how often the message was handed
    out while it may have been running: 1 on its first read, one more for each owner that
    crashed or lost the partition while it was its key's oldest unfinished message (past
    ``max_deliveries``, it is dead-lettered instead of run); ``fence`` the
    partition owner's fencing token, larger for every new owner: a store that refuses
    writes with a lower fence than it has seen refuses a stale owner's writes.

    Example:
        ```pycon
        >>> message = StreamMessage("seg-1", {"text": "hello"}, "1-0", 3, 1, 1, 42)
        >>> message.fields["text"], message.fence
        ('hello', 42)

        ```
    """

    key: Hashable
    fields: Mapping[str, str]
    id: str
    partition: int
    attempt: int
    deliveries: int
    fence: int


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A message that failed ``max_attempts`` times, with the error of its last attempt, or
    that was handed out more than ``max_deliveries`` times, with that as its error.

    ``deliveries`` is the message's count when it was dead-lettered, counted as for
    ``StreamMessage.deliveries``.
    """

    key: Hashable
    fields: Mapping[str, str]
    id: str
    partition: int
    error: str
    dead_letter_id: str
    deliveries: int = 1


@dataclass(slots=True)
class StreamCounts:
    """Counters of one consumer since it started (mutable; ``stats()`` copies them)."""

    handled: int = 0
    failed_attempts: int = 0
    retries: int = 0
    dead_lettered: int = 0
    ownerships_lost: int = 0
    lag: dict[int, int] = field(default_factory=lambda: {})


@dataclass(frozen=True, slots=True)
class StreamStats:
    """A snapshot of one consumer: what it owns, runs and has done.

    ``lag`` is, per owned partition, how many of its messages no consumer has been handed
    yet (the consumer group's lag), read from the broker about every second while the
    partition is owned here (less often, up to every minute, where counting takes long:
    on PostgreSQL, a large backlog); ``in_flight`` the messages read but not yet
    acknowledged or dead-lettered here; ``retries`` the attempts made again after a failure.

    Example:
        ```pycon
        >>> StreamStats((0, 1), 3, 10, 2, 2, 0, 0, {0: 5}).in_flight
        3

        ```
    """

    partitions: tuple[int, ...]
    in_flight: int
    handled: int
    failed_attempts: int
    retries: int
    dead_lettered: int
    ownerships_lost: int
    lag: Mapping[int, int]
