"""A turn held by a PostgreSQL transaction, and the keeper that keeps its session alive."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from psycopg import AsyncConnection
from psycopg.pq import TransactionStatus


class PgTurn:
    """A turn: the connection whose open transaction holds the keys' advisory locks.

    ``fence`` is the first key's counter, bumped in the same transaction; ``keys`` are the
    lock ids this transaction holds (nested turns of the same task add to them).
    """

    __slots__ = ("connection", "fence", "keys")

    def __init__(self, connection: AsyncConnection[Any], fence: int, keys: set[int]) -> None:
        self.connection = connection
        self.fence = fence
        self.keys = keys


class SessionKeeper:
    """Keeps the turn's session from timing out while its call works outside the database.

    The session is ended by the server when its transaction sits idle longer than the lease
    (``idle_in_transaction_session_timeout``): that is what ends the turn of a stalled or
    stopped process. A live call that computes for longer than that between statements
    would be ended too, so every third of the lease, if the connection is idle in its
    transaction, a ``SELECT 1`` resets the server's timer. A stopped process sends nothing,
    and loses its turn.
    """

    __slots__ = ("connection", "lease", "loop", "ping", "stalled", "ticked", "timer")

    def __init__(self, connection: AsyncConnection[Any], lease: float) -> None:
        self.connection = connection
        self.lease = lease
        self.loop = asyncio.get_running_loop()
        self.ping: asyncio.Task[None] | None = None
        #: When the keeper last ran, and whether the process ever went a lease without it.
        self.ticked = self.loop.time()
        self.stalled = False
        self.timer = self.loop.call_later(lease / 3, self._due)

    def stalled_past_lease(self) -> bool:
        """Whether this process stopped running for longer than the lease during the turn.

        The keeper runs every third of the lease; a gap longer than the lease means the
        process was stopped or its loop blocked, and the server, seeing the transaction
        idle for that long, has ended the session.
        """
        return self.stalled or self.loop.time() - self.ticked > self.lease

    def _due(self) -> None:
        self.stalled = self.stalled_past_lease()
        self.ticked = self.loop.time()
        self.ping = self.loop.create_task(self._ping())

    async def _ping(self) -> None:
        status = self.connection.pgconn.transaction_status
        if status == TransactionStatus.INTRANS and not self.connection.closed:
            with contextlib.suppress(Exception):  # a broken session: the commit will say so
                await self.connection.execute("SELECT 1")
        self.timer = self.loop.call_later(self.lease / 3, self._due)

    async def stop(self) -> None:
        """Stop pinging; a ping under way is let finish (cancelling it would abort the
        transaction)."""
        self.timer.cancel()
        if self.ping is not None and not self.ping.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(self.ping)
