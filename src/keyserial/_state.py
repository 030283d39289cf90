"""One event loop's share of a queue: who holds each key's turn, and who waits for it.

A key used by one call at a time is a single dict entry, the holding task. The
first time a call has to wait for the key, the entry becomes a ``KeyState``
holding the waiters in registration order; it is dropped with the key once the
last registered call is gone. A waiter is a future (one key) or a ``MultiTurn``
(several keys, registered on all of them in one step).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import deque
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

from ._awaits import is_running, is_task
from ._deadlock import check_later, check_no_cycle
from ._errors import QueueClosed, QueueFull, Superseded
from ._records import GRANTED, NEW_TASK, KeyState, MultiTurn, Waiter

Task = asyncio.Task[Any]

#: Dead waiters (cancelled or timed out) are dropped lazily; the deque is rebuilt once
#: they outnumber the live ones by this much, so cancelling many stays linear.
COMPACT_SLACK = 32
#: Only Python 3.12 and later start tasks eagerly (``eager_task_factory``).
_EAGER_TASKS = sys.version_info >= (3, 12)

__all__ = ["GRANTED", "NEW_TASK", "KeyState", "MultiTurn", "Partition", "Waiter"]


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


class MultiRegistration(NamedTuple):
    """A multi-key call: the keys it had to acquire (not those it already held)."""

    turn: MultiTurn | None  # None: every key was free and is held like an uncontended call
    keys: tuple[Hashable, ...]
    timer: asyncio.TimerHandle | None


class BrokenKeyError(TypeError):
    """A registered key whose hash or equality failed; the calls waiting for it are refused."""


def _pop_identical(entries: dict[Any, Any], key: object) -> Any:
    """Remove the entry whose key *is* ``key`` without comparing it to any other key.

    ``popitem`` takes the newest entry without a lookup; the entries taken before ours
    are put back (they compared fine with each other when they were first inserted).
    """
    if not any(present is key for present in entries):
        return None
    taken: list[tuple[Any, Any]] = []
    try:
        while True:
            present, value = entries.popitem()
            if present is key:
                return value
            taken.append((present, value))
    finally:
        for present, value in reversed(taken):
            entries[present] = value


def closed_error(key: Hashable) -> QueueClosed:
    return QueueClosed(f"queue is closed; cannot register key {key!r}")


def _expire(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_result(False)


def _refused_for_broken_key(waiter: Waiter) -> bool:
    return waiter.done() and not waiter.cancelled() and type(waiter.result()) is BrokenKeyError


def safe_repr(key: object) -> str:
    """``repr(key)``, or a description of it when its ``__repr__`` fails too."""
    try:
        return repr(key)
    except Exception:
        return f"<{type(key).__name__} object>"


def key_error(key: object, error: Exception) -> TypeError:
    """The error for a key that cannot be hashed or compared, for every method that takes one."""
    if isinstance(error, TypeError) and "unhashable" in str(error):
        return TypeError(
            f"keyserial keys must be hashable, got {type(key).__name__}: {safe_repr(key)}"
        )
    return TypeError(
        f"keyserial keys must be hashable and comparable; {safe_repr(key)} raised {error!r}"
    )


def _dead(waiter: Waiter | MultiTurn) -> bool:
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

    def forget_idle_waiter(self, idle: asyncio.Future[None]) -> None:
        """A ``join()`` stopped waiting (cancelled, timed out): drop its future."""
        self.idle_waiters = [waiter for waiter in self.idle_waiters if waiter is not idle]
        self._update_attention()

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
        return holder if is_task(holder) else None

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
        recheck = False
        if holder is not None and owner is not NEW_TASK and self.detect_deadlocks:
            # Walk only if the holder itself waits on something: usually it is running.
            blocking = holder.task if type(holder) is MultiTurn else holder
            if getattr(blocking, "_fut_waiter", None) is not None or (
                _EAGER_TASKS and is_task(blocking) and is_running(blocking)
            ):
                recheck = check_no_cycle(self, owner, (key,))  # type: ignore[arg-type]
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
        if recheck:
            check_later(self, owner, (key,), waiter, waiter.set_result)  # type: ignore[arg-type]
        return waiter

    def give_up(self, key: Hashable, waiter: Waiter) -> None:
        """The wait for the turn was interrupted (cancelled, or another BaseException)."""
        self.cancelled += 1
        if waiter.timer is not None:
            waiter.timer.cancel()
        if _refused_for_broken_key(waiter):
            return  # the key's entry is gone already
        self.abandon(key, self[key], waiter)  # type: ignore[arg-type]

    def remove_broken(self, key: Hashable, error: BaseException) -> BrokenKeyError:
        """Drop ``key``, whose hash or equality just failed, and refuse the calls waiting for it.

        A key that cannot be looked up any more cannot be handed on either: rather than
        stay registered for ever, its entry is removed by identity and every waiting call
        gets the error that the caller here gets.
        """
        broken = BrokenKeyError(
            f"keyserial key {safe_repr(key)} failed to hash or compare while registered "
            f"({error!r}); its turn ended and the calls waiting for it were refused"
        )
        held = _pop_identical(self, key)
        if self.fences:
            self.fences = {k: v for k, v in self.fences.items() if k is not key}
            self._update_attention()
        if type(held) is KeyState:
            for waiter in held.waiters:
                future = waiter.future if type(waiter) is MultiTurn else waiter
                if not future.done():  # type: ignore[union-attr]
                    future.set_result(broken)  # type: ignore[union-attr]
        if not self and self.idle_waiters:
            self.wake_idle()
        return broken

    def take_turn(self, key: Hashable, waiter: Waiter, task: Task) -> None:
        """The wait ended: take the turn, or raise TimeoutError if the timer ended it."""
        if waiter.timer is not None:
            waiter.timer.cancel()
        if (outcome := waiter.result()) is not True and type(outcome) is BrokenKeyError:
            raise outcome
        state: KeyState = self[key]  # type: ignore[assignment]
        if outcome is not True:
            self.abandon(key, state, waiter)
            if outcome is None:
                raise Superseded(key)
            if isinstance(outcome, BaseException):
                raise outcome  # refused after registering: see check_later
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
        try:
            held = self.pop(key)
        except Exception as exc:
            raise self.remove_broken(key, exc) from exc
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
        recheck = bool(busy) and self.detect_deadlocks and check_no_cycle(self, task, busy)
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
        if recheck and turn.missing:
            check_later(self, task, busy, turn.future, turn.future.set_result)
        return MultiRegistration(turn, needed, timer)

    def take_all(self, registration: MultiRegistration) -> None:
        """The multi-key wait ended: take every turn, or raise TimeoutError."""
        turn, keys, timer = registration
        if turn is None:
            return
        if timer is not None:
            timer.cancel()
        if (outcome := turn.future.result()) is not True:
            self.give_up_all(registration)
            self.cancelled -= 1  # counted by give_up_all, but it was not cancelled
            if isinstance(outcome, BaseException):
                raise outcome  # refused after registering: see check_later
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
            try:
                state = self.get(key)
            except Exception:
                continue  # a broken key, removed with its waiters already
            if type(state) is not KeyState:
                continue
            if state.holder is turn or state.holder is turn.task:
                self.release(key, state)
            else:
                self._drop_dead_waiter(key, state)

    def leave_all(self, registration: MultiRegistration, task: Task) -> None:
        for key in registration.keys:
            self.leave(key, task)
