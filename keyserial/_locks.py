"""The context manager of ``lock()``: a key's turn held for an ``async with`` block."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ._errors import check_timeout, closed_error, key_error
from ._turns import BlockTurn, TurnRecord, enter_turn, leave_turn

if TYPE_CHECKING:
    from ._loops import LoopShares
    from ._share import LoopShare

Task = asyncio.Task[Any]


class SingleKeyLock:
    """What ``KeyedSerialQueue.lock()`` returns: ``key``'s turn, for the block."""

    __slots__ = (
        "_fn",
        "_group",
        "_key",
        "_max_pending",
        "_record",
        "_share",
        "_shares",
        "_task",
        "_timeout",
    )

    def __init__(
        self,
        shares: LoopShares,
        key: Hashable,
        timeout: float | None,
        group: Hashable | None,
        max_pending: int | None,
        fn: Any = None,
    ) -> None:
        check_timeout(timeout)  # refused when the block is made, before anything registers
        self._shares = shares
        self._fn = fn  # the function the block runs (``with_options().run``), for messages
        self._key = key
        self._timeout = timeout
        self._group = group
        self._max_pending = max_pending
        self._share: LoopShare | None = None
        self._task: Task | None = None
        self._record: TurnRecord | None = None

    async def __aenter__(self) -> None:
        if self._share is not None:
            raise RuntimeError("a keyserial lock() object cannot be entered twice at once")
        key = self._key
        share, task = self._shares.running()
        try:
            holder = share.holders.get(key)
        except Exception as exc:
            raise key_error(key, exc) from exc
        if holder is None:
            if share.closed:
                raise closed_error(key)
            share.holders[key] = task
        else:
            waiter = share.register(
                key, holder, task, self._timeout, self._max_pending, self._group, self._fn
            )
            if waiter is None:
                return  # re-entry: the outer turn stays in charge of releasing
            await share.await_turn(key, waiter, task, self._fn)
        self._share, self._task = share, task
        self._record = enter_turn(task, BlockTurn(share), key, self._fn)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        share, task = self._share, self._task
        if share is not None and task is not None:
            self._share = self._task = None
            if self._record is not None:
                leave_turn(task, self._record)
                self._record = None
            share.counts.end(exc)
            share.leave(self._key, task)
