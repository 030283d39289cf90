"""Counting only the deliveries that may have run: how a message that kills its consumer is told
apart from the messages that were unlucky enough to be pending beside it.

Redis counts every hand-out of a message: the first read, and each claim by a new owner
after the previous one died or lost the partition. Bounding that count
(``max_deliveries``) is what stops a message that crashes its process from taking down
every consumer in turn. But a claim hands out *all* the dead owner's unacknowledged
messages, and counting them all would charge the innocent ones with the crash too: they
would reach the bound together with the culprit and be dead-lettered with it.

Two facts of the worker narrow the blame:

* A key's next message starts only after the previous one is acknowledged, so of a
  key's unacknowledged messages only the oldest (its *head*) can have been running. The
  others (*followers*) never started: the claim's count is taken back for them.
* A head claimed again after it had already been claimed ``solo_from - 1`` times is a
  *suspect*. Suspects run one at a time, in stream order. So when an owner dies while
  its suspects are pending, only the first pending suspect can have been running: the
  next claim counts that one and takes the count back for the other suspects.

So a message that keeps killing its consumers is counted once per death, while a message
pending beside it is counted at most until it becomes a suspect, and afterwards only
when it ran alone. The first crashes of a takeover are replayed concurrently (they are
usually not caused by a message at all); only a message that has been pending through
``solo_from - 1`` deaths is isolated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

from ._source import Entry

#: A head handed out this often (at most ``max_deliveries``) runs alone: two deaths while
#: it was pending make it a suspect.
SOLO_FROM = 3


class Redeliveries:
    """The delivery counts of one takeover's claimed messages, and which of them run alone."""

    __slots__ = ("_first_suspect_seen", "_heads", "max_deliveries", "solo_from", "suspects")

    def __init__(self, max_deliveries: int | None) -> None:
        self.max_deliveries = max_deliveries
        # At least 2: a first read (1) was never run alone.
        limit = SOLO_FROM if max_deliveries is None else max_deliveries
        self.solo_from = max(2, min(SOLO_FROM, limit))
        self.suspects: set[str] = set()  # ids of the claimed messages that run alone
        self._heads: set[Hashable] = set()  # keys whose oldest unacknowledged entry was seen
        self._first_suspect_seen = False

    def refusal(self, entry: Entry) -> str | None:
        """Why ``entry`` must not run again (handed out more than ``max_deliveries``
        times: taken for a message that kills its consumer), or None."""
        if self.max_deliveries is None or entry.deliveries <= self.max_deliveries:
            return None
        return (
            f"delivered {entry.deliveries} times, more than max_deliveries="
            f"{self.max_deliveries}: every earlier owner stopped before finishing it "
            "(a crash, a kill or a lost partition), so it was not run again"
        )

    def recount(self, entries: Sequence[Entry]) -> tuple[list[Entry], list[tuple[str, int]]]:
        """``entries`` (a claim's next page, in stream order) with their counts corrected,
        and the ``(id, deliveries)`` to set in the broker for those whose count changed."""
        kept: list[Entry] = []
        corrected: list[tuple[str, int]] = []
        for entry in entries:
            if entry.malformed is not None:  # no key: dead-lettered at once, never run
                kept.append(entry)
                continue
            head = entry.key not in self._heads
            if head:
                self._heads.add(entry.key)
                # Its count before this claim: had it made it a suspect for the last owner?
                was_suspect = entry.deliveries - 1 >= self.solo_from
                taken_back = was_suspect and self._first_suspect_seen
                self._first_suspect_seen |= was_suspect
            else:
                taken_back = True  # a follower: it never started
            if taken_back and entry.deliveries > 1:
                entry = dataclasses.replace(entry, deliveries=entry.deliveries - 1)
                corrected.append((entry.id, entry.deliveries))
            if head and entry.deliveries >= self.solo_from:
                self.suspects.add(entry.id)
            kept.append(entry)
        return kept, corrected
