"""A turn held in Redis, and the keeper that renews its lease while its call runs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

from ._transport import RedisUnavailable

Task = asyncio.Task[Any]


class Turn:
    """A turn held in Redis: its key's base name, ticket and fence, and whether it was lost.

    ``asked`` is the loop's time just before the request that led to the grant was sent:
    Redis started the lease no earlier, so ``asked + lease`` never overstates it.
    """

    __slots__ = ("asked", "base", "fence", "lost", "ticket")

    def __init__(self, base: str, ticket: str, fence: int, asked: float) -> None:
        self.base = base
        self.ticket = ticket
        self.fence = fence
        self.asked = asked
        self.lost = False

    def fence_of(self, key: Hashable) -> int | None:
        """The turn's fence (a record's owner: see keyserial._turns)."""
        return self.fence


#: Renews a turn's lease in Redis until a time: True if renewed, False if it was lost.
Renew = Callable[["Turn", float], Awaitable[bool]]


class LeaseKeeper:
    """Renews a turn's lease every third of it while its call runs; on loss, interrupts the call.

    A timer, not a task, waits between renewals: a call shorter than a third of the
    lease costs no renewal at all. Each renewal is bounded by what is left of the lease:
    a Redis that does not answer by then has let the lease expire, and the turn is lost.
    """

    __slots__ = (
        "expires",
        "lease",
        "loop",
        "renew",
        "renewal",
        "stopped",
        "task",
        "timer",
        "turn",
    )

    def __init__(self, turn: Turn, task: Task, lease: float, renew: Renew) -> None:
        self.turn = turn
        self.task = task
        self.lease = lease
        self.renew = renew
        self.loop = asyncio.get_running_loop()
        # Measured from before the request was sent, never from its reply: a process paused
        # between the two would otherwise believe in a lease that already ran out.
        self.expires = turn.asked + lease
        self.renewal: Task | None = None
        self.stopped = False
        # A turn granted after a long wait may have little of its lease left by this
        # measure: renew it at once then, instead of a third of a lease later.
        self.timer = self.loop.call_later(lease / 3 if self.fresh() else 0, self._due)

    def expired(self) -> bool:
        """Whether the lease may have run out: no renewal was confirmed within it."""
        return self.loop.time() >= self.expires

    def fresh(self) -> bool:
        """Whether at least two thirds of the lease are left, by the local measure."""
        return self.expires - self.loop.time() >= self.lease * 2 / 3

    def holds(self) -> bool:
        """Whether the turn surely still holds its lease, judged locally (no round trip)."""
        return not self.turn.lost and not self.stopped and not self.expired()

    async def confirm(self) -> bool:
        """Whether the turn holds its lease, renewing it first if it may be short."""
        return self.holds() if self.fresh() else await self.renew_now()

    async def renew_now(self) -> bool:
        """Renew the lease now and wait for the answer; whether it is held (locally too)."""
        asked = self.loop.time()
        try:
            renewed = await self.renew(self.turn, asked + self.lease)
        except (RedisUnavailable, TimeoutError):
            return self.holds()
        if renewed:
            self.expires = max(self.expires, asked + self.lease)
        return bool(renewed) and self.holds()

    def _due(self) -> None:
        self.renewal = self.loop.create_task(self._renew())

    async def _renew(self) -> None:
        asked = self.loop.time()
        # Bounded by the lease's end, or, for a lease measured as nearly over at its start
        # (granted after a long wait; see __init__), by a third of a lease from now.
        until = max(self.expires, asked + self.lease / 3)
        try:
            renewed: bool | None = await self.renew(self.turn, until)
        except (RedisUnavailable, TimeoutError):
            renewed = None  # not confirmed: the lease may still hold
        if self.stopped:
            # The call ended while the renewal was out. Cancelling the renewal is not
            # enough to know that: a renewal whose own deadline fired in the same loop
            # iteration turns that cancellation into its TimeoutError. The task has moved
            # on, and interrupting it now would hit whatever it does next.
            return
        if renewed:
            self.expires = asked + self.lease
        if renewed or (renewed is None and not self.expired()):
            # Renewed: again in a third of the lease. Not confirmed: try again soon.
            delay = self.lease / 3 if renewed else min(self.lease / 10, 0.5)
            self.timer = self.loop.call_later(delay, self._due)
            return
        self.turn.lost = True
        self.task.cancel(msg="keyserial: lease lost")

    def stop(self) -> None:
        """The call ended: renew no more, and never interrupt the task again."""
        self.stopped = True
        self.timer.cancel()
        if self.renewal is not None:
            self.renewal.cancel()
