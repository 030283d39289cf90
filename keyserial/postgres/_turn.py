"""A turn held by a PostgreSQL transaction, and the keeper that keeps its session alive."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Hashable
from typing import Any

from psycopg import AsyncConnection
from psycopg.pq import TransactionStatus


class PgTurn:
    """A turn: the connection whose open transaction holds the keys' advisory locks.

    ``fence`` is the first key's counter, bumped in the same transaction; ``keys`` are the
    lock ids this transaction holds (nested turns of the same task add to them). In fair
    mode, ``ticket`` is the call's ticket while its rows are still to be given back (its
    commit does it, then sets it to None).
    """

    __slots__ = ("connection", "fence", "keys", "ticket")

    def __init__(
        self,
        connection: AsyncConnection[Any],
        fence: int,
        keys: set[int],
        ticket: int | None = None,
    ) -> None:
        self.connection = connection
        self.fence = fence
        self.keys = keys
        self.ticket = ticket

    def fence_of(self, key: Hashable) -> int | None:
        """The turn's fence (a record's owner: see keyserial._turns)."""
        return self.fence


class SessionKeeper:
    """Keeps the turn's session from timing out while its call works outside the database.

    The session is ended by the server when its transaction sits idle longer than the lease
    (``idle_in_transaction_session_timeout``): that is what ends the turn of a stalled or
    stopped process. A live call that computes for longer than that between statements
    would be ended too, so every third of the lease, if the connection is idle in its
    transaction, a ``SELECT 1`` resets the server's timer. A stopped process sends nothing,
    and loses its turn.
    """

    __slots__ = ("connection", "contact", "lease", "loop", "ping", "timer")

    def __init__(self, connection: AsyncConnection[Any], lease: float, since: float) -> None:
        self.connection = connection
        self.lease = lease
        self.loop = asyncio.get_running_loop()
        self.ping: asyncio.Task[None] | None = None
        #: A time no later than the start of the server's idle timer: when the turn's first
        #: query was sent, then when the keeper last found a statement running or sent a
        #: ping that the server answered.
        self.contact = since
        self.timer = self.loop.call_later(lease / 3, self._due)

    def stalled_past_lease(self) -> bool:
        """Whether the server has had time to end the session for idling: no contact with
        it for longer than the lease.

        A live process pings every third of the lease, so this holds only when the process
        was stopped or its loop blocked. It never misses a session the server ended for
        idling; it may also hold, within a third of the lease after a long wait for the
        locks, for a session lost otherwise (then too, nothing of the turn was kept).
        """
        return self.loop.time() - self.contact > self.lease

    def _due(self) -> None:
        self.ping = self.loop.create_task(self._ping())

    async def _ping(self) -> None:
        status = self.connection.pgconn.transaction_status
        now = self.loop.time()
        if status == TransactionStatus.ACTIVE:
            self.contact = now  # a statement of the turn runs: the idle timer starts later
        elif status == TransactionStatus.INTRANS and not self.connection.closed:
            with contextlib.suppress(Exception):  # a broken session: the commit will say so
                await self.connection.execute("SELECT 1")
                self.contact = now  # sent at or after now, and answered
        self.timer = self.loop.call_later(self.lease / 3, self._due)

    async def stop(self) -> None:
        """Stop pinging; a ping under way is let finish (cancelling it would abort the
        transaction)."""
        self.timer.cancel()
        if self.ping is not None and not self.ping.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(self.ping)
