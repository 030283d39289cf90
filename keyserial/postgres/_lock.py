"""``PostgresKeyedQueue.lock()``: the process's own turn, then the transaction, for a block."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Hashable, Mapping
from contextvars import Token
from types import TracebackType
from typing import Any

from .._fence import enter_lock_block, exit_lock_block
from .._protocols import KeyLock
from ._connection import enter_connection_block, exit_connection_block
from ._turn import PgTurn, SessionKeeper
from ._turns import PostgresTurns

Task = asyncio.Task[Any]


class PostgresLock:
    """A block holding keys' turns in one transaction: it commits when the block ends.

    The block's statements on ``connection()`` commit together with the end of the turn
    when the block exits normally, and roll back when it raises.
    """

    __slots__ = (
        "_connection_token",
        "_entered",
        "_fence_token",
        "_keys",
        "_local",
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
        self._fence_token: Token[Any] | None = None
        self._connection_token: Token[Any] | None = None

    async def __aenter__(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = None if self._timeout is None else loop.time() + self._timeout
        task: Task = asyncio.current_task()  # type: ignore[assignment]
        turns = self._turns
        # Fair mode: the block's transaction asks for its locks as it registers (see _early).
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
            await self._local.__aexit__(None, None, None)
            raise
        self._entered = (task, turn, keeper)
        owner = sys._getframe(1)  # pyright: ignore[reportPrivateUsage]  # the block's coroutine
        self._fence_token = enter_lock_block(owner, lambda: turn.fence)
        self._connection_token = enter_connection_block(owner, turn)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._fence_token is not None:
            exit_lock_block(self._fence_token)
            self._fence_token = None
        if self._connection_token is not None:
            exit_connection_block(self._connection_token)
            self._connection_token = None
        entered, self._entered = self._entered, None
        try:
            if entered is not None:
                task, turn, keeper = entered
                await self._turns.leave(task, turn, keeper, failed=exc is not None)
        finally:
            # The process's own turn is given back whatever became of the transaction.
            await self._local.__aexit__(exc_type, exc, tb)
