"""Multi-key turns: register on every key in one step, run once all are held, release all.

Because a multi-key call takes its place in all its keys' queues at once, registration
order is one order across keys, and the earliest registered call is always first in line
for every key it needs: no cycle of multi-key calls can wait on itself. The single-key
hand-off of ``LoopShare.release`` passes each key on, to a ``MultiTurn`` like to any other
waiter; the turn runs once the last of its keys arrives.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Iterable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from ._deadlock import check_later, check_no_cycle
from ._errors import (
    QueueClosed,
    QueueFull,
    check_timeout,
    key_error,
    safe_repr,
)
from ._records import KeyState, MultiRegistration, MultiTurn, expire, new_multi_waiter
from ._share import KeysFence
from ._turns import BlockTurn, TurnRecord, enter_turn, leave_turn

if TYPE_CHECKING:
    from ._loops import LoopShares
    from ._share import LoopShare

Task = asyncio.Task[Any]
T = TypeVar("T")
P = ParamSpec("P")


def unique_keys(keys: Iterable[Hashable]) -> tuple[Hashable, ...]:
    """``keys`` checked and deduplicated, in their first order.

    Raises:
        TypeError: ``keys`` is a str or bytes, or one of them cannot be hashed.
        ValueError: ``keys`` is empty.
    """
    if isinstance(keys, (str, bytes)):
        raise TypeError(f"keys must be an iterable of keys, not a single {type(keys).__name__}")
    unique: dict[Hashable, None] = {}
    for key in keys:
        try:
            unique[key] = None
        except Exception as exc:
            raise key_error(key, exc) from exc
    if not unique:
        raise ValueError("a multi-key call needs at least one key")
    return tuple(unique)


def register_all(
    share: LoopShare,
    keys: Sequence[Hashable],
    task: Task,
    timeout: float | None,
    max_pending: int | None,
) -> MultiRegistration:
    """Register ``task`` on every key it does not hold yet, in one step."""
    holders = share.holders
    if not share.closed and all(key not in holders for key in keys):
        # Every key is free: hold each as an uncontended call would, nothing else.
        for key in keys:
            holders[key] = task
        return MultiRegistration(None, tuple(keys), None)
    needed = tuple(key for key in keys if share.holder_of(key) is not task)
    if needed and share.closed:
        raise QueueClosed(f"queue is closed; cannot register keys {safe_repr(list(needed))}")
    for key in needed:
        if max_pending is not None and share.pending_of(key) >= max_pending:
            share.counts.rejected += 1
            raise QueueFull(key, max_pending)
    busy = tuple(key for key in needed if share.holder_of(key) is not None)
    if timeout == 0 and busy:  # a try never waits, so it can close no cycle
        share.counts.timed_out += 1
        raise TimeoutError(f"the turns of keys {safe_repr(list(busy))} are held (timeout=0)")
    recheck = bool(busy) and share.detect_deadlocks and check_no_cycle(share, task, busy)
    loop: asyncio.AbstractEventLoop = share.loop  # type: ignore[assignment]
    turn = MultiTurn(new_multi_waiter(loop, share, busy), task)
    for key in needed:
        held = holders.get(key)
        if held is None:
            holders[key] = KeyState(turn, loop.time())
            continue
        state = share.contended(key, held)
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
        timer = loop.call_later(timeout, expire, turn.future)
    if recheck and turn.missing:
        check_later(share, task, busy, turn.future, turn.future.set_result)
    return MultiRegistration(turn, needed, timer)


def take_all(share: LoopShare, registration: MultiRegistration) -> None:
    """The multi-key wait ended: take every turn, or raise why not (timeout, refusal)."""
    turn, keys, timer = registration
    if turn is None:
        return
    if timer is not None:
        timer.cancel()
    if (outcome := turn.future.result()) is not True:
        give_up_all(share, registration)
        share.counts.cancelled -= 1  # counted by give_up_all, but it was not cancelled
        if isinstance(outcome, BaseException):
            raise outcome  # refused after registering: see check_later
        share.counts.timed_out += 1
        raise TimeoutError(f"timed out waiting for the turns of keys {safe_repr(list(keys))}")
    now = share.loop.time()  # type: ignore[union-attr]
    for key in keys:
        state: KeyState = share.holders[key]  # type: ignore[assignment]
        state.holder = turn.task
        state.since = now


def give_up_all(share: LoopShare, registration: MultiRegistration) -> None:
    """A multi-key call stops before running: pass on what it holds, leave the rest."""
    turn, keys, timer = registration
    assert turn is not None  # only a call that had to wait can give up
    share.counts.cancelled += 1
    if timer is not None:
        timer.cancel()
    if share.loop.is_closed():  # type: ignore[union-attr]
        return
    if not turn.future.done():
        turn.future.cancel()
    for key in keys:
        try:
            state = share.holders.get(key)
        except Exception:
            continue  # a broken key, removed with its waiters already
        if type(state) is not KeyState:
            continue
        if state.holder is turn or state.holder is turn.task:
            share.release(key, state)
        else:
            share.drop_dead_waiter(key, state)


def leave_all(share: LoopShare, registration: MultiRegistration, task: Task) -> None:
    for key in registration.keys:
        share.leave(key, task)


async def acquire_all(
    share: LoopShare,
    task: Task,
    keys: Iterable[Hashable],
    timeout: float | None,
    max_pending: int | None,
) -> MultiRegistration:
    """Register on ``keys`` and wait until ``task`` holds all of them."""
    registration = register_all(share, unique_keys(keys), task, timeout, max_pending)
    if registration.turn is not None and registration.turn.missing:
        try:
            await registration.turn.future
        except BaseException:
            give_up_all(share, registration)
            raise
    take_all(share, registration)
    return registration


class MultiKeyLock:
    """What ``KeyedSerialQueue.lock_all()`` returns: the turns of all ``keys``, for the block."""

    __slots__ = ("_held", "_keys", "_max_pending", "_record", "_shares", "_timeout")

    def __init__(
        self,
        shares: LoopShares,
        keys: Iterable[Hashable],
        timeout: float | None,
        max_pending: int | None,
    ) -> None:
        check_timeout(timeout)  # refused when the block is made, before anything registers
        self._shares = shares
        self._keys = keys
        self._timeout = timeout
        self._max_pending = max_pending
        self._held: tuple[LoopShare, Task, MultiRegistration] | None = None
        self._record: TurnRecord | None = None

    async def __aenter__(self) -> None:
        if self._held is not None:
            raise RuntimeError("a keyserial lock_all() object cannot be entered twice at once")
        share, task = self._shares.running()
        registration = await acquire_all(share, task, self._keys, self._timeout, self._max_pending)
        self._held = (share, task, registration)
        self._record = enter_turn(task, BlockTurn(KeysFence(share)), registration.keys)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._held is not None:
            share, task, registration = self._held
            self._held = None
            if self._record is not None:
                leave_turn(task, self._record)
                self._record = None
            share.counts.end(exc)
            leave_all(share, registration, task)
