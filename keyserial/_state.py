"""One event loop's share of a queue: who holds each key's turn, and who waits for it.

A key used by one call at a time is a single dict entry, the holding task. The
first time a call has to wait for the key, the entry becomes a ``KeyState``
holding the waiters in registration order; it is dropped with the key once the
last registered call is gone. A waiter is a future (one key) or a ``MultiTurn``
(several keys, registered on all of them in one step).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

from ._deadlock import check_no_cycle
from ._errors import QueueClosed, QueueFull, Superseded

Task = asyncio.Task[Any]

#: ``KeyState.holder`` while the turn has been handed to a single-key waiter that has not
#: resumed yet.
GRANTED = object()
#: The owner passed for ``submit``: its task does not exist yet, so it holds nothing.
NEW_TASK = object()
#: Dead waiters (cancelled or timed out) are dropped lazily; the deque is rebuilt once
#: they outnumber the live ones by this much, so cancelling many stays linear.
COMPACT_SLACK = 32


class Waiter(asyncio.Future):  # type: ignore[type-arg]
    """What a waiting call awaits: True once granted, False on timeout, None if superseded.

    It also says what it waits for: the deadlock check follows a blocked task's
    ``_fut_waiter`` to it, so waiting costs no extra bookkeeping.
    """

    __slots__ = ("keys", "part", "since", "timer")
    since: float  # when the call registered
    part: Partition  # whose keys
    keys: tuple[Hashable, ...]  # the keys it waits for
    timer: asyncio.TimerHandle | None  # bounds the wait, if it has a timeout


def new_waiter(part: Partition, keys: tuple[Hashable, ...]) -> Waiter:
    waiter = Waiter(loop=part.loop)
    waiter.since = time.monotonic()
    waiter.part = part
    waiter.keys = keys
    waiter.timer = None
    return waiter


def granted_waiter(part: Partition, key: Hashable) -> Waiter:
    """A waiter for a turn that was free: already granted, awaiting it does not suspend."""
    waiter = new_waiter(part, (key,))
    waiter.set_result(True)
    return waiter


class MultiTurn:
    """A call waiting for several keys; it runs once it holds all of them."""

    __slots__ = ("future", "missing", "since", "task")

    def __init__(self, future: asyncio.Future[bool | None], task: Task) -> None:
        self.future = future
        self.task = task
        self.missing = 0  # keys still to be handed to it
        self.since = time.monotonic()


class KeyState:
    """A key that saw contention during its current busy period."""

    __slots__ = ("holder", "latest", "pending", "since", "waiters")

    def __init__(self, holder: object) -> None:
        # The running task, GRANTED, a MultiTurn collecting its keys, or None when the turn
        # is free and only dead waiters (not yet resumed) keep the state alive.
        self.holder = holder
        # Running plus waiting calls, counting dead waiters that have not resumed yet.
        self.pending = 1
        # Waiters in registration order; a done future marks a dead one, skipped on hand-off.
        self.waiters: deque[asyncio.Future[bool | None] | MultiTurn] = deque()
        # The waiting call of each coalescing group, which the group's next call supersedes.
        self.latest: dict[Hashable, asyncio.Future[bool | None]] | None = None
        # When the current turn started; for a turn that began uncontended, when the first
        # call queued behind it (the turn is at least that old).
        self.since = time.monotonic()


class MultiRegistration(NamedTuple):
    """A multi-key call: the keys it had to acquire (not those it already held)."""

    turn: MultiTurn | None  # None: every key was free and is held like an uncontended call
    keys: tuple[Hashable, ...]
    timer: asyncio.TimerHandle | None


def closed_error(key: Hashable) -> QueueClosed:
    return QueueClosed(f"queue is closed; cannot register key {key!r}")


def _expire(future: asyncio.Future[bool | None]) -> None:
    if not future.done():
        future.set_result(False)


def _dead(waiter: asyncio.Future[bool | None] | MultiTurn) -> bool:
    return (waiter.future if type(waiter) is MultiTurn else waiter).done()  # type: ignore[union-attr]


class Partition(dict[Hashable, "Task | KeyState"]):
    """One event loop's share of a queue: key -> holding task, or ``KeyState`` once contended."""

    __slots__ = (
        "attention",
        "cancelled",
        "cancelled_running",
        "closed",
        "counting",
        "detect_deadlocks",
        "ended",
        "failed",
        "fence_counter",
        "fences",
        "idle_waiters",
        "loop",
        "rejected",
        "superseded",
        "timed_out",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop | None,
        detect_deadlocks: bool,
        count_calls: bool = False,
    ) -> None:
        super().__init__()
        self.loop = loop
        self.closed = False
        self.idle_waiters: list[asyncio.Future[None]] = []
        # Fences handed out by current_fence() to turns still running, by key.
        self.fences: dict[Hashable, int] = {}
        self.fence_counter = 0
        # Whether every ended turn is counted. An increment on every uncontended call costs
        # it about 8%, so only a queue asked to count (count_calls=True) pays it.
        self.counting = count_calls
        # True while a turn's end has more to do than free the key: count it, wake join(),
        # drop a fence. The uncontended path checks this one flag instead of each reason.
        self.attention = count_calls
        self.detect_deadlocks = detect_deadlocks
        # Cumulative counts for stats(); "started" and "completed" are derived from them.
        # Failures and the outcomes of waits are counted off the uncontended path (in an
        # except clause, or on the wait's own path), so they are always counted.
        self.ended = self.failed = self.cancelled = self.cancelled_running = 0
        self.timed_out = self.rejected = self.superseded = 0

    def count_failure(self, exc: BaseException) -> None:
        """Count a turn that ended by raising ``exc``."""
        if isinstance(exc, asyncio.CancelledError):
            self.cancelled += 1
            self.cancelled_running += 1
        else:
            self.failed += 1

    def count_end(self, exc: BaseException | None) -> None:
        if self.counting:
            self.ended += 1
        if exc is not None:
            self.count_failure(exc)

    # -- bookkeeping ----------------------------------------------------------------------

    def forget(self, key: Hashable) -> None:
        """Drop a key whose last registered call is gone, waking ``join`` if now idle."""
        del self[key]
        if not self and self.idle_waiters:
            self.wake_idle()

    def wake_idle(self) -> None:
        waiters, self.idle_waiters = self.idle_waiters, []
        self._update_attention()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def fence_for(self, keys: Sequence[Hashable]) -> int | None:
        """The fence of the running turn holding ``keys``, handed out on first request."""
        if not keys:
            return None  # a nested multi-key turn that needed no key of its own
        fence = self.fences.get(keys[0])
        if fence is None:
            self.fence_counter += 1
            fence = self.fence_counter
            for key in keys:
                self.fences[key] = fence
            self.attention = True
        return fence

    def _drop_fence(self, key: Hashable) -> None:
        if self.fences.pop(key, None) is not None:
            self._update_attention()

    def _update_attention(self) -> None:
        self.attention = self.counting or bool(self.fences or self.idle_waiters)

    def holder_of(self, key: Hashable) -> object:
        held = self.get(key)
        return held.holder if type(held) is KeyState else held

    def holding_task(self, key: Hashable) -> Task | None:
        """The task holding ``key``'s turn, or waiting to collect it with other keys."""
        holder = self.holder_of(key)
        if type(holder) is MultiTurn:
            return holder.task
        return holder if isinstance(holder, asyncio.Task) else None

    def waiting_for(self, task: Task) -> tuple[Hashable, ...]:
        """The keys of this partition that ``task`` is waiting for, if any."""
        awaited = getattr(task, "_fut_waiter", None)
        if type(awaited) is Waiter and awaited.part is self and not awaited.done():
            return awaited.keys
        return ()

    def pending_of(self, key: Hashable) -> int:
        held = self.get(key)
        if held is None:
            return 0
        return held.pending if type(held) is KeyState else 1

    def _contended(self, key: Hashable, held: Task | KeyState) -> KeyState:
        if type(held) is KeyState:
            return held
        state = self[key] = KeyState(held)
        return state

    # -- single-key registration ----------------------------------------------------------

    def register(
        self,
        key: Hashable,
        held: Task | KeyState,
        owner: object,
        timeout: float | None,
        max_pending: int | None,
        group: Hashable | None = None,
    ) -> Waiter | None:
        """Register ``owner`` on the busy ``key``; ``None`` if ``owner`` holds it (re-entry).

        A call with a ``group`` supersedes the waiting call of the same key and group.
        Raises QueueClosed, QueueFull, or DeadlockError if waiting would close a cycle.
        """
        holder = held.holder if type(held) is KeyState else held
        if holder is owner:
            return None
        if self.closed:
            raise closed_error(key)
        pending = held.pending if type(held) is KeyState else 1
        replaced = None
        if group is not None and type(held) is KeyState and held.latest is not None:
            replaced = held.latest.get(group)
            if replaced is not None and replaced.done():
                replaced = None
        if max_pending is not None and pending - (replaced is not None) >= max_pending:
            self.rejected += 1
            raise QueueFull(key, max_pending)
        detect = holder is not None and owner is not NEW_TASK and self.detect_deadlocks
        if detect:
            # Walk only if the holder itself waits on something: usually it is running.
            blocking = holder.task if type(holder) is MultiTurn else holder
            awaited = getattr(blocking, "_fut_waiter", None)
            if type(awaited) is Waiter or isinstance(awaited, asyncio.Task):
                check_no_cycle(self, owner, (key,))  # type: ignore[arg-type]
        state = self._contended(key, held)
        state.pending += 1
        if state.holder is None:
            state.holder = GRANTED
            return granted_waiter(self, key)
        waiter = new_waiter(self, (key,))
        state.waiters.append(waiter)
        if group is not None:
            if replaced is not None:
                replaced.set_result(None)  # superseded: it never starts
                self.superseded += 1
                self._drop_dead_waiter(key, state)
            if state.latest is None:
                state.latest = {}
            state.latest[group] = waiter
        if timeout is not None:
            waiter.timer = self.loop.call_later(timeout, _expire, waiter)  # type: ignore[union-attr]
        return waiter

    def give_up(self, key: Hashable, waiter: Waiter) -> None:
        """The wait for the turn was interrupted (cancelled, or another BaseException)."""
        self.cancelled += 1
        if waiter.timer is not None:
            waiter.timer.cancel()
        self.abandon(key, self[key], waiter)  # type: ignore[arg-type]

    def take_turn(self, key: Hashable, waiter: Waiter, task: Task) -> None:
        """The wait ended: take the turn, or raise TimeoutError if the timer ended it."""
        if waiter.timer is not None:
            waiter.timer.cancel()
        state: KeyState = self[key]  # type: ignore[assignment]
        if (outcome := waiter.result()) is not True:
            self.abandon(key, state, waiter)
            if outcome is None:
                raise Superseded(key)
            self.timed_out += 1
            raise TimeoutError(f"timed out waiting for the turn of key {key!r}")
        state.holder = task
        state.since = time.monotonic()

    def abandon(
        self, key: Hashable, state: KeyState, waiter: asyncio.Future[bool | None] | None
    ) -> None:
        """A registered call gives up before running; ``waiter=None`` means it had the turn."""
        if self.loop.is_closed():  # type: ignore[union-attr]
            return  # a coroutine finalized after its loop closed: that share is gone
        done = waiter is not None and waiter.done() and not waiter.cancelled()
        outcome = waiter.result() if done else False  # type: ignore[union-attr]
        if waiter is None or outcome is True:
            # The turn was handed over but its owner stopped before using it: pass it on.
            self.release(key, state)
            return
        if outcome is None:
            return  # superseded: accounted for when it was superseded
        if not waiter.done():
            waiter.cancel()
        self._drop_dead_waiter(key, state)

    def _drop_dead_waiter(self, key: Hashable, state: KeyState) -> None:
        state.pending -= 1
        if state.pending == 0:
            self.forget(key)
        elif len(state.waiters) > 2 * state.pending + COMPACT_SLACK:
            state.waiters = deque(w for w in state.waiters if not _dead(w))

    def release(self, key: Hashable, state: KeyState) -> None:
        """End the current turn of a contended key: hand it to the next live waiter, if any."""
        if self.loop.is_closed():  # type: ignore[union-attr]
            return  # a coroutine finalized after its loop closed: that share is gone
        if self.fences:
            self._drop_fence(key)
        state.pending -= 1
        waiters = state.waiters
        while waiters:
            waiter = waiters.popleft()
            if type(waiter) is MultiTurn:
                if waiter.future.done():
                    continue
                state.holder = waiter
                waiter.missing -= 1
                if waiter.missing == 0:
                    waiter.future.set_result(True)
                return
            if not waiter.done():  # type: ignore[union-attr]
                state.holder = GRANTED
                waiter.set_result(True)  # type: ignore[union-attr]
                return
        state.holder = None
        if state.pending == 0:
            self.forget(key)

    def leave(self, key: Hashable, task: Task) -> None:
        """End ``task``'s turn of ``key``."""
        held = self.pop(key)
        if held is not task or self.attention:
            self.after_turn(key, held, task)

    def end_turn(self, key: Hashable, held: Task | KeyState, task: Task) -> None:
        """End a ``run``/``call`` turn whose entry ``held`` was popped: count it, hand it on."""
        if self.counting:
            self.ended += 1
        self.after_turn(key, held, task)

    def after_turn(self, key: Hashable, held: Task | KeyState, task: Task) -> None:
        """Finish a turn whose entry ``held`` was popped: hand it on, or wake ``join``."""
        if held is task:
            if self.fences:
                self._drop_fence(key)
            if not self and self.idle_waiters:
                self.wake_idle()
        else:
            self[key] = held
            self.release(key, held)  # type: ignore[arg-type]

    # -- multi-key registration -----------------------------------------------------------

    def register_all(
        self,
        keys: Sequence[Hashable],
        task: Task,
        timeout: float | None,
        max_pending: int | None,
    ) -> MultiRegistration:
        """Register ``task`` on every key it does not hold yet, in one step.

        Because a multi-key call takes its place in all its keys' queues at
        once, registration order is one order across keys, and the earliest
        registered call is always first in line for every key it needs: no
        cycle of multi-key calls can wait on itself.
        """
        if not self.closed and all(key not in self for key in keys):
            # Every key is free: hold each as an uncontended call would, nothing else.
            for key in keys:
                self[key] = task
            return MultiRegistration(None, tuple(keys), None)
        needed = tuple(key for key in keys if self.holder_of(key) is not task)
        if needed and self.closed:
            raise QueueClosed(f"queue is closed; cannot register keys {list(needed)!r}")
        for key in needed:
            if max_pending is not None and self.pending_of(key) >= max_pending:
                self.rejected += 1
                raise QueueFull(key, max_pending)
        busy = tuple(key for key in needed if self.holder_of(key) is not None)
        if busy and self.detect_deadlocks:
            check_no_cycle(self, task, busy)
        loop: asyncio.AbstractEventLoop = self.loop  # type: ignore[assignment]
        turn = MultiTurn(new_waiter(self, busy), task)
        for key in needed:
            held = self.get(key)
            if held is None:
                self[key] = KeyState(turn)
                continue
            state = self._contended(key, held)
            state.pending += 1
            if state.holder is None:
                state.holder = turn
            else:
                state.waiters.append(turn)
                turn.missing += 1
        if turn.missing == 0:
            turn.future.set_result(True)
        timer = None
        if timeout is not None and turn.missing:
            timer = loop.call_later(timeout, _expire, turn.future)
        return MultiRegistration(turn, needed, timer)

    def take_all(self, registration: MultiRegistration) -> None:
        """The multi-key wait ended: take every turn, or raise TimeoutError."""
        turn, keys, timer = registration
        if turn is None:
            return
        if timer is not None:
            timer.cancel()
        if turn.future.result() is not True:
            self.give_up_all(registration)
            self.cancelled -= 1  # counted by give_up_all, but this was a timeout
            self.timed_out += 1
            raise TimeoutError(f"timed out waiting for the turns of keys {list(keys)!r}")
        now = time.monotonic()
        for key in keys:
            state: KeyState = self[key]  # type: ignore[assignment]
            state.holder = turn.task
            state.since = now

    def give_up_all(self, registration: MultiRegistration) -> None:
        """A multi-key call stops before running: pass on what it holds, leave the rest."""
        turn, keys, timer = registration
        assert turn is not None  # only a call that had to wait can give up
        self.cancelled += 1
        if timer is not None:
            timer.cancel()
        if self.loop.is_closed():  # type: ignore[union-attr]
            return
        if not turn.future.done():
            turn.future.cancel()
        for key in keys:
            state: KeyState = self[key]  # type: ignore[assignment]
            if state.holder is turn or state.holder is turn.task:
                self.release(key, state)
            else:
                self._drop_dead_waiter(key, state)

    def leave_all(self, registration: MultiRegistration, task: Task) -> None:
        for key in registration.keys:
            self.leave(key, task)
