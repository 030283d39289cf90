"""The queue's calls whose turn is held outside the caller's own coroutine frame.

``lock`` holds a key's turn for an ``async with`` block (``_locks``) and ``submit`` runs a
call in a task of its own (``_submit``); ``KeyedSerialQueue`` adds the hot path of ``run``
and ``call`` to them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, ParamSpec, TypeVar

from ._errors import check_function
from ._locks import TurnLock
from ._loops import running_loop
from ._multikey import MultiKeyCalls, check_timeout
from ._protocols import KeyLock
from ._submit import submit

T = TypeVar("T")
P = ParamSpec("P")


class DetachedTurns(MultiKeyCalls):
    """``lock`` and ``submit``: a turn held by a block, or by a task of its own."""

    __slots__ = ()

    def submit(
        self, key: Hashable, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs
    ) -> asyncio.Task[T]:
        """Start ``fn(*args, **kwargs)`` in ``key``'s turn as a new task; it is registered at once.

        The new task is a different task from the caller, so it queues even
        when the caller holds ``key`` (awaiting it from inside that turn would
        deadlock). Cancelling the task before its turn withdraws it without a
        trace; cancelling it during its turn passes the turn on when ``fn`` exits.

        Raises:
            QueueClosed: the queue is closed (for the running event loop).
            QueueFull: ``key`` already has ``max_pending`` pending calls.
            TypeError: ``key`` is not hashable or ``fn`` is not callable.
            RuntimeError: no event loop is running.

        Example:
            ```pycon
            >>> import asyncio
            >>> from keyserial import KeyedSerialQueue
            >>> async def main() -> list[int]:
            ...     queue = KeyedSerialQueue()
            ...     async def echo(i: int) -> int:
            ...         return i
            ...     tasks = [queue.submit("k", echo, i) for i in range(3)]
            ...     return list(await asyncio.gather(*tasks))
            >>> asyncio.run(main())
            [0, 1, 2]

            ```
        """
        check_function(fn, "submit")
        return self._submit(key, fn, args, kwargs, None)

    def _submit(
        self,
        key: Hashable,
        fn: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None,
    ) -> asyncio.Task[T]:
        loop = running_loop()
        return submit(self._shares.of(loop), key, fn, args, kwargs, self._max_pending, timeout)

    def lock(
        self, key: Hashable, timeout: float | None = None, group: Hashable | None = None
    ) -> KeyLock:
        """Hold ``key``'s turn for the body of an ``async with`` block.

        The block registers when it is entered. ``timeout`` bounds only the
        wait for the turn; entering from the task that already holds ``key``
        does not wait and does not release the outer turn on exit. ``group``
        coalesces as for [call][keyserial.KeyedSerialQueue.call].

        Raises:
            TimeoutError: the turn did not come within ``timeout`` seconds.
            Superseded: a newer block of the same ``group`` replaced this one.
            QueueClosed, QueueFull, TypeError, RuntimeError: as for
                [run][keyserial.KeyedSerialQueue.run].
            ValueError: ``timeout`` is negative.

        Example:
            ```pycon
            >>> import asyncio
            >>> from keyserial import KeyedSerialQueue
            >>> async def main() -> bool:
            ...     queue = KeyedSerialQueue()
            ...     async with queue.lock("seg-1", timeout=5):
            ...         return queue.locked("seg-1")
            >>> asyncio.run(main())
            True

            ```
        """
        check_timeout(timeout)
        return TurnLock(self._shares, key, timeout, group, self._max_pending)
