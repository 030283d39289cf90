"""A queue's counters, and the snapshots ``KeyedSerialQueue.stats()`` makes of them."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass

from ._asyncio_internals import is_task
from ._deadlock import waited_since
from ._records import Counts, KeyState, MultiTurn


@dataclass(frozen=True)
class QueueStats:
    """What a queue (the running event loop's share of it) is doing, and has done.

    Attributes:
        keys: keys with registered work.
        running: calls holding their turn (a multi-key call counts once).
        waiting: calls waiting for their turn.
        started: turns that started; ``None`` unless the queue was made with
            ``count_calls=True``.
        completed: turns that returned; ``None`` unless the queue counts calls.
        failed: turns that raised.
        cancelled: calls cancelled while waiting or running.
        timed_out: calls that gave up waiting on their timeout.
        rejected: calls that ``max_pending`` refused.
        superseded: calls that a newer call of their coalescing group replaced.
        longest_wait: ``(key, seconds)`` of the call waiting longest, or None.
        longest_running: ``(key, seconds)`` of the turn running longest, or None.
    """

    keys: int
    running: int
    waiting: int
    started: int | None
    completed: int | None
    failed: int
    cancelled: int
    timed_out: int
    rejected: int
    superseded: int
    longest_wait: tuple[Hashable, float] | None
    longest_running: tuple[Hashable, float] | None


def _live(waiter: object) -> bool:
    future = waiter.future if type(waiter) is MultiTurn else waiter
    return not future.done()  # type: ignore[attr-defined]


def snapshot(holders: Mapping[Hashable, object], counts: Counts, now: float) -> QueueStats:
    """The stats of a share whose key table is ``holders``, at ``now`` on the loop's clock."""
    running_tasks: set[int] = set()
    waiters: set[int] = set()
    longest_wait: tuple[Hashable, float] | None = None
    longest_running: tuple[Hashable, float] | None = None
    for key, held in holders.items():
        if type(held) is not KeyState:
            running_tasks.add(id(held))
            continue
        # Only a resumed task runs; a turn handed over but not resumed yet, or held by a
        # multi-key call still collecting its other keys, is not running.
        if is_task(held.holder):
            running_tasks.add(id(held.holder))
            if longest_running is None or now - held.since > longest_running[1]:
                longest_running = (key, now - held.since)
        first = True
        for waiter in held.waiters:
            if not _live(waiter):
                continue
            waiters.add(id(waiter))
            if first:  # FIFO: the first live waiter of a key has waited longest
                since = waiter.since if type(waiter) is MultiTurn else waited_since(waiter)  # type: ignore[arg-type]
                if since is None:
                    continue  # its frame cannot be read (an unusual awaitable): the next one
                first = False
                waited = now - since
                if longest_wait is None or waited > longest_wait[1]:
                    longest_wait = (key, waited)
    running = len(running_tasks)
    counted = counts.counting
    return QueueStats(
        keys=len(holders),
        running=running,
        waiting=len(waiters),
        started=counts.ended + running if counted else None,
        completed=counts.ended - counts.failed - counts.cancelled_running if counted else None,
        failed=counts.failed,
        cancelled=counts.cancelled,
        timed_out=counts.timed_out,
        rejected=counts.rejected,
        superseded=counts.superseded,
        longest_wait=longest_wait,
        longest_running=longest_running,
    )
