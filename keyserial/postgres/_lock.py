"""``PostgresKeyedQueue.lock()``: the process's own turn, then the transaction, for a block."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Mapping
from types import TracebackType
from typing import Any

from .._protocols import KeyLock
from .._turns import BlockTurn, TurnRecord, enter_turn, leave_turn
from ._desk import EarlyTurn
from ._turn import PgTurn, SessionKeeper
from ._turns import PostgresTurns

Task = asyncio.Task[Any]


class PostgresLock:
    """A block holding keys' turns in one transaction: it commits when the block ends.

    The block's statements on ``connection()`` commit together with the end of the turn
    when the block exits normally, and roll back when it raises.
    """

    __slots__ = (
        "_early",
        "_entered",
        "_keys",
        "_local",
        "_record",
        "_timeout",
        "_turns",
    )

    def __init__(
        self,
        turns: PostgresTurns,
        local: KeyLock,
        keys: Mapping[int, Hashable],
        timeout: float | None,
    ) -> None:
        self._turns = turns
        self._local = local  # the in-process queue's lock of the keys
        self._keys = keys
        self._timeout = timeout
        self._entered: tuple[Task, PgTurn, SessionKeeper | None] | None = None
        self._early: EarlyTurn | None = None  # fair mode: the block's ticket, while open
        self._record: TurnRecord | None = None  # the block's turn, while open

    async def __aenter__(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = None if self._timeout is None else loop.time() + self._timeout
        task: Task = asyncio.current_task()  # type: ignore[assignment]
        turns = self._turns
        # Fair mode: the block takes its ticket as it registers (see _early).
        early = turns.early.register(self._keys) if turns.fair and task not in turns.held else None
        try:
            await self._local.__aenter__()
        except BaseException:
            if early is not None:
                await turns.early.withdraw(early)
            raise
        try:
            turn, keeper = await turns.enter(task, self._keys, deadline, early)
        except BaseException:
            try:
                await self._local.__aexit__(None, None, None)
            finally:
                if early is not None:
                    await turns.early.withdraw(early)
            raise
        self._early = early
        self._entered = (task, turn, keeper)
        self._record = enter_turn(task, BlockTurn(turn), tuple(self._keys))

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        entered, self._entered = self._entered, None
        if entered is not None and self._record is not None:
            leave_turn(entered[0], self._record)
            self._record = None
        try:
            if entered is not None:
                task, turn, keeper = entered
                await self._turns.leave(
                    task, turn, keeper, failed=exc is not None, early=self._early
                )
        finally:
            # The process's own turn is given back whatever became of the transaction.
            await self._local.__aexit__(exc_type, exc, tb)
            early, self._early = self._early, None
            if early is not None:
                await self._turns.early.withdraw(early)  # gives its ticket back
