"""Fair mode's tickets: a waiting call holds a row of the ticket table, not a connection.

In the default mode only the first call of a key in a process waits in the database, so a
later call of another process can take the lock before an earlier call still queued here.
With ``fair=True`` every call takes a ticket when it registers: one row ``(lock, ticket,
owner, seen)`` per key in the ticket table, ``<table>_tq``, the ticket drawn from the
queue's sequence. Tickets order the calls of all processes by when their registration
reached the server. A call begins its turn's transaction only once its ticket is at the
head of each of its keys' lines, as the ticket's *verdict* says:

* ``go``: no live ticket is ahead, or only one, whose transaction is already in the
  server's lock queue for the key (holding it or waiting for it). The turn begins and waits
  in the server right behind it, so the hand-off itself is the server's grant, as in the
  default mode;
* ``wait``: two or more live tickets are ahead. A notification (a call gave its ticket
  back, in its commit or later: ``pg_notify`` on the queue's channel, with the key's lock id
  and the ticket that may now go as payload) or the next heartbeat asks again;
* ``soon``: one ticket is ahead, and its transaction is not in the server's lock queue yet
  (it is on its way): asked again shortly, then less and less often;
* ``lost``: the row is gone (its process was stopped for so long that another process
  cleared it): it registers again, with its process's later waiting tickets, in call order.

A ticket is live while its process's desk (below) holds its session's advisory lock, the
*owner lock*, and its heartbeat refreshes ``seen`` every third of the lease: the tickets of
a process that died are skipped at once (its sessions end with it), those of a process
that stopped a lease later. So at most two transactions of a key are open at a time, the
holder's and the next call's; every other waiting call holds only its row. Whether a
ticket's transaction is in the server's lock queue is read in ``pg_locks``: the transaction
first takes a try-lock whose two-int key is its ticket, then the keys' locks, on the same
backend.

Each process keeps one connection of its own for its tickets (the *desk*): it registers,
asks verdicts, gives tickets back, beats the heartbeat and LISTENs, one batch at a time.
It is opened on first use and closed once the process has had no ticket for a lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Callable, Hashable, Mapping
from typing import Any

from psycopg_pool import AsyncConnectionPool

from .._background import Background
from ._desk import EarlyTurn, TicketDesk
from ._errors import naming
from ._turn import PgTurn

Task = asyncio.Task[Any]


class EarlyTurns:
    """Fair mode's turns of one queue in this process, from the calls' side.

    Its ``desk`` keeps the tickets. ``begin`` begins a ticket's transaction
    (``PostgresTurns.begin_ticket``), ``rollback`` ends one without keeping anything.
    """

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        table: str,
        schema: str | None,
        lease: float,
        begin: Callable[[EarlyTurn], Awaitable[PgTurn]],
        rollback: Callable[[PgTurn], Awaitable[None]],
    ) -> None:
        self.lease = lease
        self.begin = begin
        self.rollback = rollback
        self.desk = TicketDesk(pool, table, schema, lease)
        self.numbers = itertools.count()
        #: Turns given up and being rolled back, running on their own.
        self.background = Background("fair mode's background work")

    def register(self, keys: Mapping[int, Hashable]) -> EarlyTurn:
        """Take a ticket for a call registering now, and begin its turn once the ticket's
        verdict says so.

        The call takes it up with `take_up` when its turn in this process comes, or gives it
        up with `withdraw`; one of the two must follow, then `withdraw` gives the ticket back.
        """
        early = EarlyTurn(keys, next(self.numbers))
        self.desk.enrol(early)
        early.begin = asyncio.get_running_loop().create_task(self._begin_early(early))
        return early

    async def _begin_early(self, early: EarlyTurn) -> PgTurn:
        loop = asyncio.get_running_loop()
        while True:
            verdict = await early.next_verdict()
            if verdict == "go":
                early.begun = True
                early.since = loop.time()
                return await self.begin(early)
            if verdict == "lost":
                self.desk.register_again(early)
            # wait: the desk parked it, and a notification or the heartbeat asks again;
            # soon: the desk asks again shortly

    async def withdraw(self, early: EarlyTurn) -> None:
        """The call of ``early`` ended: stop its turn, roll back its transaction if it holds
        the locks but was not taken up, and give its ticket back.

        Returns once its connection is back in the pool; cancelled again meanwhile, it still
        waits for that, and is cancelled all the same.
        """
        giving_up = self.withdraw_soon(early)
        if giving_up is None:
            return
        try:
            await asyncio.wait([giving_up])
        except asyncio.CancelledError:
            while not giving_up.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([giving_up])
            raise

    def withdraw_soon(self, early: EarlyTurn) -> Task | None:
        """`withdraw`, in the background; the task doing it, or None if nothing is to do."""
        if early.withdrawn:
            return None
        early.withdrawn = True
        return self.background.spawn(self._give_up(early))

    async def _give_up(self, early: EarlyTurn) -> None:
        begin = early.begin
        if begin is not None and not early.taken:
            begin.cancel()  # a wait for the locks is cancelled in the server too
            await asyncio.wait([begin])
            if not begin.cancelled() and begin.exception() is None:
                await self.rollback(begin.result())  # it had the locks already
        self.desk.give_back(early)

    async def take_up(
        self, early: EarlyTurn, deadline: float | None, loop: asyncio.AbstractEventLoop
    ) -> PgTurn:
        """The turn ``early`` began, once it holds its locks, within ``deadline``.

        Its wait has no timeout of its own (the call's wait in this process is bounded by
        the deadline too, and two timers racing could cancel the statement twice): past the
        deadline, or cancelled, the call withdraws it.
        """
        begin = early.begin
        assert begin is not None
        try:
            if deadline is None:
                await asyncio.wait([begin])
            else:
                await asyncio.wait([begin], timeout=max(0.0, deadline - loop.time()))
        except BaseException:
            await self.withdraw(early)
            raise
        if not begin.done():
            await self.withdraw(early)
            raise TimeoutError(f"timed out waiting for the turn of {naming(early.keys)}")
        early.taken = True
        return begin.result()

    async def settle(self) -> None:
        """Wait, at most a lease, until this process's tickets are given back and turns given
        up are rolled back, then close the desk's connection."""
        await self.background.wait(self.lease)
        await self.desk.close()
