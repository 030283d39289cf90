"""The records a queue keeps for waiting and running calls; it imports nothing of keyserial.

A key used by one call at a time is a single dict entry, the holding task. The first time
a call has to wait for the key, the entry becomes a ``KeyState`` holding the waiters in
registration order. A waiter is a future (one key) or a ``MultiTurn`` (several keys,
registered on all of them in one step). The future is an exact ``asyncio.Future`` for a
call without a timeout, whose frame says what it waits for (``keyserial._waiting``), and
a ``Waiter`` otherwise.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Hashable
from typing import Any, NamedTuple, Protocol

Task = asyncio.Task[Any]

#: ``KeyState.holder`` while the turn has been handed to a single-key waiter that has not
#: resumed yet.
GRANTED = object()
#: The owner passed for ``submit``: its task does not exist yet, so it holds nothing.
NEW_TASK = object()


class KeyHolders(Protocol):
    """What the deadlock check asks of a loop's share: who holds a key's turn."""

    def holding_task(self, key: Hashable) -> Task | None: ...


#: What a waiting call awaits: an exact ``asyncio.Future`` or a ``Waiter``. Its result is
#: True once granted, False on timeout, None if superseded, or the error the wait was
#: refused with after registering (a ``DeadlockError`` found once an eager step ended, a
#: key that broke).
Wait = asyncio.Future[Any]


class Waiter(asyncio.Future[Any]):
    """A wait that says itself what it waits for: one with a timeout, or registered by
    ``submit`` before its task exists (no frame awaits it yet to say so).

    The deadlock check follows a blocked task's ``_fut_waiter`` to it.
    """

    __slots__ = ("key", "share", "since")
    since: float  # when the call registered, on the loop's clock
    share: KeyHolders  # whose keys
    key: Hashable  # the key it waits for (the key itself: a 1-tuple would cost 48 bytes)


class TimedWaiter(Waiter):
    """What a call with a ``timeout`` awaits: the timer is a slot only such waiters pay for."""

    __slots__ = ("timer",)
    timer: asyncio.TimerHandle  # ends the wait with False when it fires


class MultiWaiter(Waiter):
    """What a call waiting for several keys awaits (``MultiTurn.future``)."""

    __slots__ = ("keys",)
    keys: tuple[Hashable, ...]  # the keys it waits for


def new_waiter(
    loop: asyncio.AbstractEventLoop,
    share: KeyHolders,
    key: Hashable,
    timeout: float | None,
    since: float,
) -> Waiter:
    """A waiter for ``key``, registered at ``since``; with a timeout, a ``TimedWaiter``
    whose timer is already set."""
    if timeout is None:
        waiter = Waiter(loop=loop)
    else:
        # The timer never fires before the loop runs again: setting it first is safe.
        waiter = timed = TimedWaiter(loop=loop)
        timed.timer = loop.call_later(timeout, expire, timed)
    waiter.since = since
    waiter.share = share
    waiter.key = key
    return waiter


def expire(future: asyncio.Future[Any]) -> None:
    """A wait's timer fired: end the wait with False (timed out) unless it ended already."""
    if not future.done():
        future.set_result(False)


def new_multi_waiter(
    loop: asyncio.AbstractEventLoop, share: KeyHolders, keys: tuple[Hashable, ...]
) -> MultiWaiter:
    waiter = MultiWaiter(loop=loop)
    waiter.since = loop.time()
    waiter.share = share
    waiter.key = None
    waiter.keys = keys
    return waiter


class MultiTurn:
    """A call waiting for several keys; it runs once it holds all of them."""

    __slots__ = ("future", "missing", "since", "task")

    def __init__(self, future: MultiWaiter, task: Task) -> None:
        self.future = future
        self.task = task
        self.missing = 0  # keys still to be handed to it
        self.since = future.since


class MultiRegistration(NamedTuple):
    """A multi-key call: the keys it had to acquire (not those it already held)."""

    turn: MultiTurn | None  # None: every key was free and is held like an uncontended call
    keys: tuple[Hashable, ...]
    timer: asyncio.TimerHandle | None


class KeyState:
    """A key that saw contention during its current busy period."""

    __slots__ = ("holder", "latest", "pending", "since", "waiters")

    def __init__(self, holder: object, now: float) -> None:
        # The running task, GRANTED, a MultiTurn collecting its keys, or None when the turn
        # is free and only dead waiters (not yet resumed) keep the state alive.
        self.holder = holder
        # Running plus waiting calls, counting dead waiters that have not resumed yet.
        self.pending = 1
        # Waiters in registration order; a done future marks a dead one, skipped on hand-off.
        self.waiters: deque[Wait | MultiTurn] = deque()
        # The waiting call of each coalescing group, which the group's next call supersedes.
        self.latest: dict[Hashable, Wait] | None = None
        # When the current turn started; for a turn that began uncontended, when the first
        # call queued behind it (the turn is at least that old).
        self.since = now


def is_dead(waiter: Wait | MultiTurn) -> bool:
    """Whether a queued waiter has stopped waiting (cancelled, timed out, superseded)."""
    return (waiter.future if type(waiter) is MultiTurn else waiter).done()  # type: ignore[union-attr]


class Counts:
    """Cumulative counts of one loop's share, for ``stats()``.

    Failures and the outcomes of waits are counted off the uncontended path (in an
    ``except`` clause, or on the wait's own path), so they are always counted. Ended turns
    are counted only when asked (``count_calls=True``): an increment on every uncontended
    call is a measurable share of its cost (benchmarks: uncontended).
    """

    __slots__ = (
        "cancelled",
        "cancelled_running",
        "counting",
        "ended",
        "failed",
        "rejected",
        "superseded",
        "timed_out",
    )

    def __init__(self, counting: bool) -> None:
        self.counting = counting
        self.ended = self.failed = self.cancelled = self.cancelled_running = 0
        self.timed_out = self.rejected = self.superseded = 0

    def failure(self, exc: BaseException) -> None:
        """Count a turn that ended by raising ``exc``."""
        if isinstance(exc, asyncio.CancelledError):
            self.cancelled += 1
            self.cancelled_running += 1
        else:
            self.failed += 1

    def end(self, exc: BaseException | None) -> None:
        """Count a turn that ended, with ``exc`` if it raised."""
        if self.counting:
            self.ended += 1
        if exc is not None:
            self.failure(exc)
