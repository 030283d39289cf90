"""Snapshots of a queue's load and history, for ``KeyedSerialQueue.stats()``."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from dataclasses import dataclass

from ._state import KeyState, MultiTurn, Partition


@dataclass(frozen=True)
class QueueStats:
    """What a queue (the running event loop's share of it) is doing, and has done.

    Attributes:
        keys: keys with registered work.
        running: calls holding their turn (a multi-key call counts once).
        waiting: calls waiting for their turn.
        started, completed: turns that started; that returned. ``None`` unless
            the queue was made with ``count_calls=True``.
        failed, cancelled: turns that raised; calls cancelled while waiting or
            running.
        timed_out, rejected, superseded: calls that gave up waiting on their
            timeout; that ``max_pending`` refused; that a newer call replaced.
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


def snapshot(part: Partition, now: float) -> QueueStats:
    holders: set[int] = set()
    waiters: set[int] = set()
    longest_wait: tuple[Hashable, float] | None = None
    longest_running: tuple[Hashable, float] | None = None
    for key, held in part.items():
        if type(held) is not KeyState:
            holders.add(id(held))
            continue
        # Only a resumed task runs; a turn handed over but not resumed yet, or held by a
        # multi-key call still collecting its other keys, is not running.
        if isinstance(held.holder, asyncio.Task):
            holders.add(id(held.holder))
            if longest_running is None or now - held.since > longest_running[1]:
                longest_running = (key, now - held.since)
        first = True
        for waiter in held.waiters:
            if not _live(waiter):
                continue
            waiters.add(id(waiter))
            if first:  # FIFO: the first live waiter of a key has waited longest
                first = False
                waited = now - waiter.since
                if longest_wait is None or waited > longest_wait[1]:
                    longest_wait = (key, waited)
    running = len(holders)
    counted = part.counting
    return QueueStats(
        keys=len(part),
        running=running,
        waiting=len(waiters),
        started=part.ended + running if counted else None,
        completed=part.ended - part.failed - part.cancelled_running if counted else None,
        failed=part.failed,
        cancelled=part.cancelled,
        timed_out=part.timed_out,
        rejected=part.rejected,
        superseded=part.superseded,
        longest_wait=longest_wait,
        longest_running=longest_running,
    )
