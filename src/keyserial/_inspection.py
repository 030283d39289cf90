"""Reading and closing a queue's shares: ``pending``, ``locked``, ``stats``, ``join``, ``aclose``.

``QueueShares`` is the base of ``KeyedSerialQueue``: it holds the queue's per-loop shares
and answers every question about them; the queue adds the calls that take turns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable

from ._errors import key_error
from ._loops import LoopShares, running_loop
from ._stats import QueueStats, snapshot


class QueueShares:
    """A queue's shares, one per event loop, and what can be read or awaited of them."""

    __slots__ = ("_max_pending", "_shares")

    def __init__(self, max_pending: int | None, detect_deadlocks: bool, count_calls: bool) -> None:
        self._max_pending = max_pending
        self._shares = LoopShares(detect_deadlocks, count_calls)

    def pending(self, key: Hashable) -> int:
        """Running plus waiting calls for ``key`` in the running loop's share (0 if unknown).

        Example:
            ```pycon
            >>> from keyserial import KeyedSerialQueue
            >>> KeyedSerialQueue().pending("nobody")
            0

            ```
        """
        try:
            return self._shares.inspected().pending_of(key)
        except Exception as exc:
            raise key_error(key, exc) from exc

    def locked(self, key: Hashable) -> bool:
        """Whether ``key``'s turn is currently held (granted to a call).

        Example:
            ```pycon
            >>> from keyserial import KeyedSerialQueue
            >>> KeyedSerialQueue().locked("nobody")
            False

            ```
        """
        try:
            return self._shares.inspected().holder_of(key) is not None
        except Exception as exc:
            raise key_error(key, exc) from exc

    def stats(self) -> QueueStats:
        """An immutable snapshot of the running loop's share: current load and cumulative counts.

        Counts are of turns (a re-entrant call runs inside its caller's turn and
        is not counted). ``started`` and ``completed`` are ``None`` unless the
        queue was made with ``count_calls=True``; the other counts are always
        kept. ``longest_wait`` is exact. ``longest_running`` is exact
        for turns handed over from a waiting call; a turn that began while no
        one waited is timed from when the first call queued behind it — how long
        it has been keeping others waiting — unless the queue has an observer or
        a ``slow_turn`` threshold, which time every turn.

        Example:
            ```pycon
            >>> from keyserial import KeyedSerialQueue
            >>> KeyedSerialQueue().stats().waiting
            0
            >>> print(KeyedSerialQueue().stats().started)
            None
            >>> KeyedSerialQueue(count_calls=True).stats().started
            0

            ```
        """
        share = self._shares.inspected()
        now = share.loop.time() if share.loop is not None else 0.0
        return snapshot(share.holders, share.counts, now)

    def __len__(self) -> int:
        """Number of keys with registered work in the running loop's share."""
        return len(self._shares.inspected().holders)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` has registered work in the running loop's share."""
        try:
            return key in self._shares.inspected().holders
        except Exception:
            return False  # a key that cannot be hashed or compared has no work registered

    @property
    def closed(self) -> bool:
        """Whether [aclose][keyserial.KeyedSerialQueue.aclose] was called (for the running loop)."""
        return self._shares.inspected().closed

    async def join(self) -> None:
        """Wait until no work is registered; work registered while waiting is waited for too.

        Example:
            ```pycon
            >>> import asyncio
            >>> from keyserial import KeyedSerialQueue
            >>> async def main() -> int:
            ...     queue = KeyedSerialQueue()
            ...     async def work() -> None:
            ...         await asyncio.sleep(0)
            ...     queue.submit("k", work)
            ...     await queue.join()
            ...     return len(queue)
            >>> asyncio.run(main())
            0

            ```
        """
        loop = running_loop()
        share = self._shares.of(loop)
        if not share.holders:
            return
        idle: asyncio.Future[None] = loop.create_future()
        share.idle_waiters.append(idle)
        share.attention = True
        try:
            await idle
        except BaseException:
            share.forget_idle_waiter(idle)  # cancelled or timed out: leave nothing behind
            raise

    async def aclose(self) -> None:
        """Refuse new work with [QueueClosed][keyserial.QueueClosed], then wait for registered work.

        Closing applies to the running event loop's share of the queue. Calls
        already registered, and re-entrant calls made inside their turns, still run.

        Example:
            ```pycon
            >>> import asyncio
            >>> from keyserial import KeyedSerialQueue
            >>> async def main() -> bool:
            ...     queue = KeyedSerialQueue()
            ...     await queue.aclose()
            ...     return queue.closed
            >>> asyncio.run(main())
            True

            ```
        """
        self._shares.close(running_loop())
        await self.join()

    def __repr__(self) -> str:
        share = self._shares.inspected()
        state = "closed" if share.closed else "open"
        keys = len(share.holders)
        return f"<KeyedSerialQueue {state} keys={keys} max_pending={self._max_pending}>"
