"""``RedisKeyedQueue.lock()``: the process's own turn, then the Redis turn, for a block."""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any

from .._cancels import cancel_count, withdraw_cancel
from .._errors import LeaseLost
from .._protocols import KeyLock
from .._turns import BlockTurn, TurnRecord, enter_turn, leave_turn
from ._fair import FairTickets
from ._lease import LeaseKeeper, Turn
from ._turns import RedisTurns

Task = asyncio.Task[Any]


class RedisLock:
    """``RedisKeyedQueue.lock()``: the local turn, then the Redis turn, for a block."""

    __slots__ = (
        "_cancels_before",
        "_encoded",
        "_keeper",
        "_local",
        "_record",
        "_task",
        "_tickets",
        "_timeout",
        "_turn",
        "_turns",
    )

    def __init__(
        self,
        turns: RedisTurns,
        local: KeyLock,
        encoded: str,
        timeout: float | None,
        tickets: FairTickets | None = None,
    ) -> None:
        self._turns = turns
        self._tickets = tickets  # fair mode's
        self._encoded = encoded
        self._timeout = timeout
        self._local = local  # the in-process queue's lock of the encoded key
        self._turn: Turn | None = None
        self._task: Task | None = None
        self._keeper: LeaseKeeper | None = None
        self._record: tuple[Task, TurnRecord] | None = None  # the block's turn, while open
        self._cancels_before = 0  # the task's pending cancellations when the turn began

    def holds(self) -> bool:
        """Whether this block surely still holds its Redis turn's lease (judged locally)."""
        keeper = self._keeper
        return keeper is not None and keeper.holds()

    async def confirm(self) -> bool:
        """Renew the lease now if it may be short, and say whether the block holds it."""
        keeper = self._keeper
        return keeper is not None and await keeper.confirm()

    @property
    def fence(self) -> int | None:
        """The fence of the Redis turn this block holds (None outside the block, or re-entered)."""
        return None if self._turn is None else self._turn.fence

    async def __aenter__(self) -> None:
        turns, encoded = self._turns, self._encoded
        loop = asyncio.get_running_loop()
        deadline = None if self._timeout is None else loop.time() + self._timeout
        task: Task = asyncio.current_task()  # type: ignore[assignment]
        # Fair mode: the block's ticket goes to Redis as it registers here (see _tickets).
        tickets = self._tickets
        early = (
            tickets.register(encoded)
            if tickets is not None and (task, encoded) not in turns.held
            else None
        )
        try:
            await self._local.__aenter__()
        except BaseException:
            if early is not None and tickets is not None:
                tickets.withdraw(early)
            raise
        turn = turns.held.get((task, encoded))
        if turn is None:  # not a re-entry: take the Redis turn for this block
            try:
                if early is None or tickets is None:
                    turn, self._keeper = await turns.take(encoded, deadline, task)
                else:
                    turn, self._keeper = await tickets.take_early(early, encoded, deadline, task)
            except BaseException:
                await self._local.__aexit__(None, None, None)
                raise
            self._turn, self._task = turn, task
            self._cancels_before = cancel_count(task)
        elif early is not None and tickets is not None:
            tickets.withdraw(early)
        self._record = (task, enter_turn(task, BlockTurn(turn), encoded))

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if self._record is not None:
            leave_turn(*self._record)
            self._record = None
        turn, keeper, task, lost = self._turn, self._keeper, self._task, False
        self._turn = self._keeper = self._task = None
        try:
            if turn is not None and keeper is not None and task is not None:
                lost = await self._turns.give_back(self._encoded, turn, keeper, task)
        finally:
            # The process's own turn is given back whatever became of the Redis release
            # (cancelled, failed): a release that could not be sent is left to the lease.
            await self._local.__aexit__(exc_type, exc, tb)
        if turn is not None and task is not None and lost:
            if isinstance(exc, asyncio.CancelledError) and not (
                turn.lost and withdraw_cancel(task, self._cancels_before)
            ):
                return False  # cancelled from elsewhere: that cancellation goes on
            raise LeaseLost(self._encoded, turn.fence)
        return False
