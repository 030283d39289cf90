"""``submit()``: a call registered at once, run in a task of its own."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from types import CoroutineType
from typing import TYPE_CHECKING, Any, TypeVar, cast

from ._deadlock import check_later, check_no_cycle
from ._errors import DeadlockError, called, closed_error, key_error
from ._records import GRANTED, NEW_TASK, KeyState, Wait, new_waiter
from ._turns import enter_turn, leave_turn

if TYPE_CHECKING:
    from ._share import LoopShare

T = TypeVar("T")
Task = asyncio.Task[Any]


class Submission:
    """The registration made by ``submit``, and its withdrawal if the task never starts."""

    __slots__ = ("key", "share", "started", "waiter")

    def __init__(self, share: LoopShare, key: Hashable, waiter: Wait) -> None:
        self.share = share
        self.key = key
        self.waiter = waiter
        self.started = False

    async def execute(
        self, fn: Callable[..., Awaitable[T]], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> T:
        self.started = True
        share, key, waiter = self.share, self.key, self.waiter
        task: Task = asyncio.current_task()  # type: ignore[assignment]
        if not waiter.done() and share.detect_deadlocks:
            # Checked now rather than in submit(): by its first step, a holder that submitted
            # this task may already be awaiting it, which is a cycle.
            try:
                recheck = check_no_cycle(share, task, (key,), fn)
            except DeadlockError:
                share.give_up(key, waiter)
                raise
            if recheck:
                check_later(share, task, (key,), waiter, waiter.set_result)
        await share.await_turn(key, waiter, task, fn)
        record = enter_turn(task, share, key, fn)
        error: BaseException | None = None
        try:
            return await called(fn, args, kwargs)
        except BaseException as exc:
            error = exc
            raise
        finally:
            leave_turn(task, record)
            share.counts.end(error)
            try:
                state = share.holders[key]
            except Exception as exc:  # the key broke during the turn: never leave it stuck
                raise share.remove_broken(key, exc) from exc
            share.release(key, state)  # type: ignore[arg-type]

    def withdraw_if_unstarted(self, task: Task) -> None:
        # A task cancelled before its first step never runs execute()'s cleanup.
        if not self.started:
            self.share.give_up(self.key, self.waiter)


def submit(
    share: LoopShare,
    key: Hashable,
    fn: Callable[..., Awaitable[T]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    max_pending: int | None,
    timeout: float | None = None,
    group: Hashable | None = None,
) -> asyncio.Task[T]:
    """Register a call of ``fn`` on ``key`` now, and start a task that runs it in its turn.

    ``timeout`` bounds the task's wait for the turn; ``group`` makes it coalescing.
    """
    loop: asyncio.AbstractEventLoop = share.loop  # type: ignore[assignment]
    if share.closed:
        raise closed_error(key)
    try:
        holder = share.holders.get(key)
    except Exception as exc:
        raise key_error(key, exc) from exc
    if holder is None:
        # The task may start eagerly inside create_task, so the turn is reserved first.
        share.holders[key] = KeyState(GRANTED, share.clock())
        waiter: Wait | None = new_waiter(loop, share, key, None, share.clock())
        waiter.set_result(True)  # type: ignore[union-attr]
    else:
        waiter = share.register(key, holder, NEW_TASK, timeout, max_pending, group)
    assert waiter is not None  # a task that does not exist yet holds nothing
    submission = Submission(share, key, waiter)
    coroutine = cast("CoroutineType[Any, Any, T]", submission.execute(fn, args, kwargs))  # pyright: ignore[reportUnnecessaryCast]  # mypy sees a Coroutine
    # The task shows the caller's function, not Submission.execute.
    coroutine.__qualname__ = getattr(fn, "__qualname__", coroutine.__qualname__)
    task = loop.create_task(coroutine)
    task.add_done_callback(submission.withdraw_if_unstarted)
    return task
