"""One event loop's share of a queue: who holds each key's turn, and who waits for it.

A key used by one call at a time is a single entry of ``holders``, the holding task: the
uncontended path in ``KeyedSerialQueue.run`` touches that one plain dict and nothing else.
The first time a call has to wait, the entry becomes a ``KeyState`` with the waiters in
registration order; it is dropped with the key once the last registered call is gone.

Ending a wait has three verbs here: ``take_turn`` (the wait ended; use the turn or raise
why not), ``give_up`` (the waiting call was interrupted) and ``release`` (a turn ends: hand
it to the next live waiter). Everything else a call does to a key goes through them.
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys
import weakref
from asyncio import Future
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from ._asyncio_internals import (
    EAGER_NEEDS_FACTORY,
    EAGER_TASKS,
    finds_loop_by_thread,
    fut_waiter,
    has_asyncio_accessors,
    is_running,
    is_task,
    loop_closed,
    loop_task_factory,
)
from ._broken_keys import broken_key_error, pop_identical, refuse_waiters, refused_for_broken_key
from ._clock import loop_clock
from ._deadlock import check_later, check_no_cycle
from ._errors import BrokenKeyError, QueueFull, Superseded, closed_error, safe_repr
from ._fence import FenceBook
from ._records import (
    GRANTED,
    NEW_TASK,
    Counts,
    KeyState,
    MultiTurn,
    TimedWaiter,
    Wait,
    is_dead,
    new_waiter,
)
from ._turns import enter_wait, leave_turn

Task = asyncio.Task[Any]

#: From Python 3.12 a Future created without a loop finds the running one more cheaply
#: than the loop can be passed by keyword; before, that lookup makes a getpid() call.
_FUTURE_FINDS_LOOP_CHEAPLY = sys.version_info >= (3, 12)

#: Dead waiters (cancelled or timed out) are dropped lazily; the deque is rebuilt once
#: they outnumber the live ones by this much, so cancelling many stays linear.
COMPACT_SLACK = 32


class KeysFence:
    """The owner of a multi-key turn's record: the fence of the turn holding all its keys."""

    __slots__ = ("share",)

    def __init__(self, share: LoopShare) -> None:
        self.share = share

    def fence_of(self, key: Hashable) -> int | None:
        return self.share.fence_for(key)  # type: ignore[arg-type]  # the keys, as recorded


class LoopShare:
    """One event loop's share of a queue: the key table and single-key hand-off."""

    __slots__ = (
        "__weakref__",
        "accessors_inline",
        "attention",
        "clock",
        "closed",
        "counts",
        "detect_deadlocks",
        "fences",
        "holders",
        "idle_waiters",
        "loop",
        "new_future",
        "open_loop",
        "quick_loop",
        "quick_waits",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop | None,
        detect_deadlocks: bool,
        count_calls: bool = False,
    ) -> None:
        self.loop = loop
        self.open_loop = loop  # None once closed (see close)
        #: The loop, where run() may tell it runs by its thread (see
        #: _asyncio_internals.FIND_LOOP_BY_THREAD); None elsewhere and once closed.
        self.quick_loop = loop if finds_loop_by_thread(loop) else None
        if self.quick_loop is not None:
            _QUICK_LOOPS.add(self)
        self.clock = loop_clock(loop)
        # Whether the hand-off may read the loop's fields through the C getters of
        # _asyncio_internals instead of calling its Python methods.
        self.accessors_inline = has_asyncio_accessors(loop)
        # A waiter's future, on this loop (only ever called while it runs).
        self.new_future: Callable[[], Future[Any]] = (
            Future if _FUTURE_FINDS_LOOP_CHEAPLY else functools.partial(Future, loop=loop)
        )
        # Whether run() may queue a call without options behind a running holder
        # on an open share themselves, as register() would, a frame fewer: where the loop's
        # task factory is asyncio's field and only a factory starts tasks eagerly. The
        # behaviour suites run with it on and off (tests/conftest.py).
        self.quick_waits = self.accessors_inline and EAGER_NEEDS_FACTORY
        #: key -> the task holding its turn, or its KeyState once contended.
        self.holders: dict[Hashable, Task | KeyState] = {}
        self.closed = False
        self.detect_deadlocks = detect_deadlocks
        self.counts = Counts(count_calls)
        self.fences = FenceBook()
        # join() calls waiting for the table to empty.
        self.idle_waiters: list[asyncio.Future[None]] = []
        # True while a turn's end has more to do than free the key: count it, wake join(),
        # drop a fence. The uncontended path checks this one flag instead of each reason.
        self.attention = count_calls

    def update_attention(self) -> None:
        self.attention = self.counts.counting or bool(self.fences or self.idle_waiters)

    # -- closing ----------------------------------------------------------------------------

    def close(self) -> None:
        """Refuse new calls from now on; registered ones still run."""
        self.closed = True
        # run() takes this share when its loop is the running one by open_loop or
        # quick_loop: those tests fail now, so it looks the share up and finds it closed.
        self.open_loop = None
        self.quick_loop = None

    # -- reading ----------------------------------------------------------------------------

    def holder_of(self, key: Hashable) -> object:
        held = self.holders.get(key)
        return held.holder if type(held) is KeyState else held

    def holding_task(self, key: Hashable) -> Task | None:
        """The task holding ``key``'s turn, or waiting to collect it with other keys."""
        holder = self.holder_of(key)
        if type(holder) is MultiTurn:
            return holder.task
        return holder if is_task(holder) else None

    def pending_of(self, key: Hashable) -> int:
        held = self.holders.get(key)
        return held.pending if type(held) is KeyState else int(held is not None)

    def fence_of(self, key: Hashable) -> int | None:
        """The fence of the running turn of ``key`` (a record's owner: see ``_turns``)."""
        return self.fence_for((key,))

    def fence_for(self, keys: Sequence[Hashable]) -> int | None:
        """The fence of the running turn holding ``keys`` (see ``FenceBook``)."""
        fence = self.fences.fence_of(keys)
        if fence is not None:
            self.attention = True  # the turn's end must drop it
        return fence

    # -- idle -------------------------------------------------------------------------------

    def forget(self, key: Hashable) -> None:
        """Drop a key whose last registered call is gone, waking ``join`` if now idle."""
        del self.holders[key]
        if not self.holders and self.idle_waiters:
            self.wake_idle()

    def wake_idle(self) -> None:
        waiters, self.idle_waiters = self.idle_waiters, []
        self.update_attention()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def forget_idle_waiter(self, idle: asyncio.Future[None]) -> None:
        """A ``join()`` stopped waiting (cancelled, timed out): drop its future."""
        self.idle_waiters = [waiter for waiter in self.idle_waiters if waiter is not idle]
        self.update_attention()

    # -- registering ------------------------------------------------------------------------

    def contended(self, key: Hashable, held: Task | KeyState) -> KeyState:
        """``key``'s state, made a KeyState if it was a plain holding task."""
        if type(held) is not KeyState:
            held = self.holders[key] = KeyState(held, self.clock())
        return held

    def register(
        self,
        key: Hashable,
        held: Task | KeyState,
        owner: object,
        timeout: float | None,
        max_pending: int | None,
        group: Hashable | None = None,
        fn: Any = None,
    ) -> Wait | None:
        """Register ``owner`` on the busy ``key``; ``None`` if ``owner`` holds it (re-entry).

        The wait of a task without a timeout is an exact future: whoever awaits it records
        what it waits for in ``keyserial._turns`` first (`await_turn` does). A call
        with a ``group`` supersedes the waiting call of the same
        key and group. Raises QueueClosed, QueueFull, or DeadlockError if waiting would
        close a cycle. ``fn``: the function the call runs, for that error's message.
        """
        holder = held.holder if type(held) is KeyState else held
        if holder is owner:
            return None
        if self.closed:
            raise closed_error(key)
        if timeout == 0 and holder is not None:
            # A try never waits, so it can close no cycle: it fails as a busy key, even
            # when the holder awaits the caller (as anyio's acquire_nowait does).
            self.counts.timed_out += 1
            raise TimeoutError(f"the turn of key {safe_repr(key)} is held (timeout=0 never waits)")
        replaced = None
        if max_pending is not None or group is not None:
            replaced = self.admit(key, held, max_pending, group)
        recheck = False
        if self.detect_deadlocks and holder is not None and owner is not NEW_TASK:
            # Walk only if the holder itself waits on something: usually it is running.
            blocking = holder.task if type(holder) is MultiTurn else holder
            # A holder can be mid-step only if tasks start eagerly: that is asked first
            # because testing the holder costs far more (`may_start_eagerly`, inlined: a
            # call here shows in contended traffic; the eager-task tests cover both).
            if fut_waiter(blocking) is not None or (
                EAGER_TASKS
                and (
                    not EAGER_NEEDS_FACTORY
                    or (
                        loop_task_factory(self.loop)
                        if self.accessors_inline
                        else self.loop.get_task_factory()  # type: ignore[union-attr]
                    )
                    is not None
                )
                and is_task(blocking)
                and is_running(blocking)
            ):
                recheck = check_no_cycle(self, owner, (key,), fn)  # type: ignore[arg-type]
        state = held if type(held) is KeyState else self.contended(key, held)
        state.pending += 1
        waiter: Wait
        if timeout is None and owner is not NEW_TASK:
            waiter = self.new_future()  # its awaiter records what it waits for: see _turns
        else:
            waiter = new_waiter(self.loop, self, key, timeout, self.clock())  # type: ignore[arg-type]
        if state.holder is None:
            state.holder = GRANTED
            waiter.set_result(True)
            return waiter
        state.waiters.append(waiter)
        if group is not None:
            if replaced is not None:
                replaced.set_result(None)  # superseded: it never starts
                self.counts.superseded += 1
                self.drop_dead_waiter(key, state)
            if state.latest is None:
                state.latest = {}
            state.latest[group] = waiter
        if recheck:
            check_later(self, owner, (key,), waiter, waiter.set_result)  # type: ignore[arg-type]
        return waiter

    def admit(
        self, key: Hashable, held: Task | KeyState, max_pending: int | None, group: Hashable | None
    ) -> Wait | None:
        """Enforce ``max_pending`` on ``key``; the waiting call of ``group`` to supersede, if any.

        A call that supersedes another does not add to the pending count. Raises QueueFull.
        """
        replaced = None
        if group is not None and type(held) is KeyState and held.latest is not None:
            replaced = held.latest.get(group)
            if replaced is not None and replaced.done():
                replaced = None
        pending = held.pending if type(held) is KeyState else 1
        if max_pending is not None and pending - (replaced is not None) >= max_pending:
            self.counts.rejected += 1
            raise QueueFull(key, max_pending)
        return replaced

    # -- ending a wait ------------------------------------------------------------------------

    async def await_turn(self, key: Hashable, waiter: Wait, task: Task, fn: Any = None) -> None:
        """Wait for the turn ``waiter`` stands for, then take it (or raise why not).

        ``fn``: the function the turn will run, for messages (None for a block).
        """
        record = enter_wait(task, self, key, fn, waiter, self.clock())
        try:
            await waiter
        except BaseException:
            leave_turn(task, record)
            self.give_up(key, waiter)
            raise
        leave_turn(task, record)
        self.take_turn(key, waiter, task)

    def take_turn(self, key: Hashable, waiter: Wait, task: Task) -> None:
        """The wait ended: take the turn, or raise TimeoutError if the timer ended it."""
        if type(waiter) is TimedWaiter:
            waiter.timer.cancel()
        if (outcome := waiter.result()) is not True and type(outcome) is BrokenKeyError:
            raise outcome
        state: KeyState = self.holders[key]  # type: ignore[assignment]
        if outcome is not True:
            self.abandon(key, state, waiter)
            if outcome is None:
                raise Superseded(key)
            if isinstance(outcome, BaseException):
                raise outcome  # refused after registering: see check_later
            self.counts.timed_out += 1
            raise TimeoutError(f"timed out waiting for the turn of key {safe_repr(key)}")
        state.holder = task
        state.since = self.clock()

    def give_up(self, key: Hashable, waiter: Wait) -> None:
        """The wait for the turn was interrupted (cancelled, or another BaseException)."""
        self.counts.cancelled += 1
        if type(waiter) is TimedWaiter:
            waiter.timer.cancel()
        if refused_for_broken_key(waiter):
            return  # the key's entry is gone already
        self.abandon(key, self.holders[key], waiter)  # type: ignore[arg-type]

    def abandon(self, key: Hashable, state: KeyState, waiter: Wait | None) -> None:
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
        self.drop_dead_waiter(key, state)

    def drop_dead_waiter(self, key: Hashable, state: KeyState) -> None:
        state.pending -= 1
        if state.pending == 0:
            self.forget(key)
        elif len(state.waiters) > 2 * state.pending + COMPACT_SLACK:
            state.waiters = deque(w for w in state.waiters if not is_dead(w))

    # -- ending a turn ------------------------------------------------------------------------

    def release(self, key: Hashable, state: KeyState) -> None:
        """End the current turn of a contended key: hand it to the next live waiter, if any.

        The key's entry may have been popped (a ``run`` turn's end pops it): it is put back.
        """
        self.holders[key] = state
        loop: Any = self.loop
        if loop_closed(loop) if self.accessors_inline else loop.is_closed():
            return  # a coroutine finalized after its loop closed: that share is gone
        if self.fences.by_key:  # not bool(self.fences): a __bool__ call costs a frame
            self.drop_fence(key)
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

    def drop_fence(self, key: Hashable) -> None:
        self.fences.drop(key)
        if not self.fences:
            self.update_attention()

    def leave(self, key: Hashable, task: Task) -> None:
        """End ``task``'s turn of ``key`` (a lock block's, or a key of a multi-key turn)."""
        try:
            held = self.holders.pop(key)
        except Exception as exc:
            raise self.remove_broken(key, exc) from exc
        if held is not task or self.attention:
            self.after_turn(key, held, task)

    def end_turn(self, key: Hashable, held: Task | KeyState, task: Task) -> None:
        """End a ``run``/``call`` turn whose entry ``held`` was popped: count it, hand it on.

        Called only when the share needs attention; otherwise ``run`` and ``call`` hand a
        contended turn on with ``release`` themselves.
        """
        if self.counts.counting:
            self.counts.ended += 1
        if held is task:
            self.after_turn(key, held, task)
        else:  # a contended turn that needs attention: hand it on without after_turn's frame
            self.release(key, held)  # type: ignore[arg-type]

    def after_turn(self, key: Hashable, held: Task | KeyState, task: Task) -> None:
        """Finish a turn whose entry ``held`` was popped: hand it on, or wake ``join``."""
        if held is task:
            if self.fences:
                self.drop_fence(key)
            if not self.holders and self.idle_waiters:
                self.wake_idle()
        else:
            self.release(key, held)  # type: ignore[arg-type]

    def remove_broken(self, key: Hashable, error: BaseException) -> BrokenKeyError:
        """Drop ``key``, whose hash or equality just failed, and refuse its waiting calls;
        the error to raise.

        A key that cannot be looked up any more cannot be handed on either: rather than
        stay registered for ever, its entry is removed by identity (never compared with
        another key), and every call waiting for it gets the same error.
        """
        broken = broken_key_error(key, error)
        refuse_waiters(pop_identical(self.holders, key), broken)
        if self.fences:
            self.fences.drop_identical(key)
            self.update_attention()
        if not self.holders and self.idle_waiters:
            self.wake_idle()
        return broken


#: The shares whose ``quick_loop`` is set, for `_forget_quick_loops`.
_QUICK_LOOPS: weakref.WeakSet[LoopShare] = weakref.WeakSet()


def _forget_quick_loops() -> None:
    """In a child forked while a loop ran: the child's copy of that loop still names this
    thread in its ``_thread_id``, but never runs here; ``run`` must not take it for the
    running loop, so the child's shares made before the fork find their loop the slow way."""
    for share in list(_QUICK_LOOPS):
        share.quick_loop = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_quick_loops)
