"""Fair mode's tickets: a waiting call holds a row of the ticket table, not a connection.

In the default mode only the first call of a key in a process waits in the database, so a
later call of another process can take the lock before an earlier call still queued here.

With ``fair=True`` a call whose process has no other call on its keys takes a *direct* turn:
its transaction asks, in the same round trip as its locks, whether a call of another process
holds a ticket on one of its keys' lines, and locks them only if none does. It then waits in
the server's queue, as in the default mode: that queue keeps the order in which such calls
reached the server, and each process has at most one of them on a key. If a ticket is
there, the call locks nothing and takes a ticket instead; so does a call whose pool has no
idle connection (until it reaches the server, calls made after it could go first), and, for
a lease, every call of the process on a key where a direct turn found a ticket.

Every other call takes a ticket when it registers: one row ``(lock, ticket, owner, seen)``
per key in the ticket table, ``<table>_tq``, the ticket drawn from the queue's sequence.
Tickets order the calls by when their registration reached the server: once a ticket waits
on a key, every process's new call on it takes a ticket after it. A ticket's turn begins its
transaction only once the ticket is at the head of each of its keys' lines, as its
*verdict* says, and once the direct turns its process made before it on the same keys hold
their locks (its transaction must not reach the server's queue ahead of theirs: it would
hold the keys while its call waits in this process for theirs):

* ``go``: no live ticket is ahead, or only one, whose transaction is already in the
  server's lock queue for the key (holding it or waiting for it). The turn begins and waits
  in the server right behind it, so the hand-off itself is the server's grant, as in the
  default mode;
* ``wait``: two or more live tickets are ahead. A word that the line moved (a call gave
  its ticket back, in its commit or later: ``pg_notify`` on the channel of the process whose
  ticket became second, if the first is another process's, with the key's lock id and that
  ticket as payload; the giving process's own share comes back as rows instead; see
  `TicketSql.give_back`) or the next heartbeat asks again;
* ``soon``: one ticket is ahead, and its transaction is not in the server's lock queue yet
  (it is on its way): asked again shortly, then less and less often;
* ``lost``: the row is gone (its process was stopped for so long that another process
  cleared it): it registers again, with its process's later waiting tickets, in call order.
  A direct turn that takes a ticket after all does the same: its process's later tickets
  register again after it.

Tickets of one process registered together on one key, one right after another, are next
to each other on the line, and each *follows* the one ahead: it is never asked a verdict
(``behind``). Its turn is begun by the commit of the turn ahead, on that turn's connection,
right after the ``COMMIT`` in the same round trip (`EarlyTurns.hand_over`): its locks are
tried, not waited for, so a transaction of another process that was already waiting in the
server for the key, and that the commit let through, keeps its place; the follower then
begins its turn on its own. No one needs telling about such a commit while the next two
tickets of the line both follow their own: it only deletes its ticket (`EarlyTurns.quiet`).

A ticket is live while its process's desk (below) holds its session's advisory lock, the
*owner lock*, and its heartbeat refreshes ``seen`` every third of the lease: the tickets of
a process that died are skipped at once (its sessions end with it), those of a process
that stopped a lease later. Rows of a process without its owner lock for a lease, and of
one stopped for three, are cleared by the others' heartbeats (`TicketSql.heartbeat`). So a
key has open transactions for at most its direct turns
(one per process) and two tickets (the first two of its line); every other waiting call
holds only its row. Whether a
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
from typing import Any, NamedTuple

from psycopg_pool import AsyncConnectionPool

from .._background import Background
from ._desk import EarlyTurn, TicketDesk
from ._errors import naming
from ._statements import UNBOUNDED, TurnSql
from ._turn import PgTurn

Task = asyncio.Task[Any]


class Closing(NamedTuple):
    """The statements of a fair-mode turn's commit (see `EarlyTurns.closing`)."""

    statements: list[str]
    #: The turn they begin right after the COMMIT (`EarlyTurns.hand_over`), if any.
    follower: EarlyTurn | None
    #: The place among them of the tell whose rows are this process's share, if it tells.
    told_at: int | None


class EarlyTurns:
    """Fair mode's turns of one queue in this process, from the calls' side.

    Its ``desk`` keeps the tickets. ``begin`` begins a ticket's transaction
    (``PostgresTurns.begin_ticket``), ``begin_direct`` a direct turn's
    (``PostgresTurns.begin_direct``), ``rollback`` ends one without keeping anything.
    """

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        table: str,
        schema: str | None,
        turn_sql: TurnSql,
        begin: Callable[[EarlyTurn], Awaitable[PgTurn]],
        begin_direct: Callable[
            [Mapping[int, Hashable], float | None, asyncio.AbstractEventLoop],
            Awaitable[PgTurn | None],
        ],
        rollback: Callable[[PgTurn], Awaitable[None]],
    ) -> None:
        lease = turn_sql.lease
        self.lease = lease
        self.turn_sql = turn_sql
        self.begin = begin
        self.begin_direct = begin_direct
        self.rollback = rollback
        self.pool = pool
        self.desk = TicketDesk(pool, table, schema, lease)
        self.numbers = itertools.count()
        #: lock id -> how many of this process's calls on it are registered and not withdrawn.
        self.calls_on: dict[int, int] = {}
        #: order -> direct turns not placed yet (see `EarlyTurn.placed`).
        self.unplaced: dict[int, EarlyTurn] = {}
        #: lock id -> when a direct turn of it last found another process's ticket: for a
        #: lease, calls on it take tickets at once (entries older than that are dropped
        #: whenever a direct turn takes a ticket).
        self.tickets_seen: dict[int, float] = {}
        #: Turns given up and being rolled back, running on their own.
        self.background = Background("fair mode's background work")

    def register(self, keys: Mapping[int, Hashable]) -> EarlyTurn:
        """The fair turn of a call registering now: direct if this process has no other call
        on its keys, else with a ticket, whose turn begins once its verdict says so.

        A call on keys where a direct turn found another process's ticket within a lease takes
        a ticket at once: it would most likely find one too.

        The call then takes its turn with `take_direct` (which may take a ticket after all)
        or `take_up`; in all cases `withdraw` follows when the call ends, and gives the
        ticket back.
        """
        early = EarlyTurn(keys, next(self.numbers))
        calls_on = self.calls_on
        if any(lock in calls_on for lock in keys) or self._tickets_seen(keys):
            early.after = [
                direct
                for direct in self.unplaced.values()
                if any(lock in direct.keys for lock in keys)
            ]
            self._ticket(early)
        else:
            early.direct = True
            self.unplaced[early.order] = early
        for lock in keys:
            calls_on[lock] = calls_on.get(lock, 0) + 1
        return early

    def _tickets_seen(self, keys: Mapping[int, Hashable]) -> bool:
        """Whether a direct turn found another process's ticket on one of ``keys`` within a
        lease."""
        seen = self.tickets_seen
        if not seen:
            return False
        since = asyncio.get_running_loop().time() - self.lease
        return any(seen.get(lock, since - 1) >= since for lock in keys)

    def _ticket(self, early: EarlyTurn) -> None:
        self.desk.enrol(early)
        early.begin = asyncio.get_running_loop().create_task(self._begin_early(early))

    async def take_direct(
        self, early: EarlyTurn, deadline: float | None, loop: asyncio.AbstractEventLoop
    ) -> PgTurn | None:
        """The direct turn of ``early``, or None once it took a ticket instead, because
        another process's call waits with one on its keys (`take_up` then takes its turn).

        A call that would wait for a connection of the pool takes a ticket at once: until it
        reaches the server, calls of other processes made after it could go first.

        Raises:
            As ``PostgresTurns.begin``.
        """
        if not self.pool.get_stats().get("pool_available"):
            self.take_ticket(early, seen=False)
            return None
        try:
            turn = await self.begin_direct(early.keys, deadline, loop)
        except BaseException:
            self.placed(early)
            raise
        if turn is None:
            self.take_ticket(early)
        else:
            self.placed(early)
        return turn

    def placed(self, early: EarlyTurn) -> None:
        """``early``'s direct turn holds its locks, or ended: the process's later tickets on
        its keys may begin their turns."""
        self.unplaced.pop(early.order, None)
        early.placed.set()

    def take_ticket(self, early: EarlyTurn, seen: bool = True) -> None:
        """``early``'s direct turn takes a ticket after all (it found another process's call
        waiting with one, if ``seen``); this process's later calls take theirs again after
        it, so that its tickets keep the order of its calls."""
        early.direct = False
        if seen:
            now = asyncio.get_running_loop().time()
            found = self.tickets_seen
            for lock in [lock for lock, when in found.items() if when < now - self.lease]:
                del found[lock]
            found.update(dict.fromkeys(early.keys, now))
        self._ticket(early)
        self.desk.register_again(early)
        self.placed(early)

    async def _begin_early(self, early: EarlyTurn) -> PgTurn:
        loop = asyncio.get_running_loop()
        while True:
            verdict = await early.next_verdict()
            if verdict == "behind":
                if not await self._follows(early):
                    continue  # a verdict will come
                verdict = "go"
            if verdict == "go":
                handed, early.handed = early.handed, None
                if handed is not None:
                    return handed
                if early.after and await self._held_back(early):
                    continue  # it took a new ticket meanwhile: the verdict was the old one's
                early.begun = True
                early.since = loop.time()
                return await self.begin(early)
            if verdict == "lost":
                self.desk.register_again(early)
            # wait: the desk parked it, and a notification or the heartbeat asks again;
            # soon: the desk asks again shortly

    async def _follows(self, early: EarlyTurn) -> bool:
        """Wait until the turn right ahead of ``early`` on its key's line held its locks and
        ended (its commit may have begun ``early``'s turn: `hand_over`); whether ``early``
        may begin now, as a ``go`` verdict would say.

        That turn is this process's, so no verdict needs to be asked: once it held its
        locks, no live ticket was ahead of ``early`` but its own. If it never held them,
        ``early`` is asked its verdict as any ticket is.
        """
        ahead = early.behind
        ticket = early.ticket
        assert ahead is not None and ahead.begin is not None
        await asyncio.wait([ahead.begin])
        if early.ticket != ticket or early.behind is not ahead:
            return False  # it took a new ticket meanwhile
        begin = ahead.begin
        if begin.cancelled() or begin.exception() is not None:
            self.desk.unchain(early)  # it never held them: ``early`` is asked about
            return False
        await ahead.ended.wait()  # its commit may have begun this turn (`hand_over`)
        return early.ticket == ticket and early.behind is ahead

    def closing(self, turn: PgTurn, early: EarlyTurn | None, server_version: int) -> Closing:
        """The statements of ``turn``'s commit (``early``: its call's), and the turn they begin
        right after the COMMIT, if any (`hand_over`).

        A ticket's commit gives the ticket back and tells its line (`TicketSql.give_back`),
        unless no one needs telling (`quiet`): then it only deletes the ticket's rows. Either
        way it first lifts any lock or statement timeout the function set (`UNBOUNDED`).
        """
        if turn.ticket is None:
            return Closing(["COMMIT"], None, None)
        tickets, locks = [turn.ticket], sorted(turn.keys)
        sql = self.desk.sql
        # A turn whose task locked more keys in it (a nested call) holds more than its line.
        alone = early if early is not None and turn.keys == set(early.keys) else None
        told_at = None
        statements = [UNBOUNDED]
        if self.quiet(alone):
            statements.append(sql.delete(tickets))
        else:
            statements += sql.give_back(tickets, locks)
            told_at = len(statements) - 2  # the tell: see `TicketSql.give_back`
        statements.append("COMMIT")
        follower = self.hand_over(alone)
        if follower is not None:
            statements += self.turn_sql.tried(
                sorted(follower.keys), server_version, follower.ticket or 0
            )
        return Closing(statements, follower, told_at)

    def closed(self, turn: PgTurn, closing: Closing, results: list[list[Any]]) -> PgTurn | None:
        """``turn`` committed, with the statements of ``closing``, which gave ``results`` (each
        statement's rows). The turn handed over to ``closing``'s follower on ``turn``'s
        connection, or None (if there is a follower, its transaction, begun without the
        locks or no longer wanted, is to be rolled back)."""
        if turn.ticket is not None:
            turn.ticket = None  # given back
            if closing.told_at is not None:
                self.desk.moved(results[closing.told_at])
        follower = closing.follower
        if follower is None:
            return None
        handed = None
        fence = results[-1][0][-1] if results[-1] else None
        if fence is not None:  # the follower holds its locks
            handed = PgTurn(turn.connection, int(fence), set(follower.keys), follower.ticket)
        return handed if self.handed(follower, handed) else None

    def quiet(self, early: EarlyTurn | None) -> bool:
        """Whether the commit of ``early``'s turn may give its ticket back without telling
        anyone: the next two tickets of its line are this process's, each following the one
        ahead (they never wait for a word). A withdrawn one's row may be gone already: the
        ticket after it is then told."""
        follower = None if early is None else early.follower()
        return follower is not None and follower.follower() is not None

    def hand_over(self, early: EarlyTurn | None) -> EarlyTurn | None:
        """The turn whose transaction the commit of ``early``'s turn begins, right after its
        COMMIT, in the same round trip: the next ticket of its line, if it is this process's,
        follows it, and waits for nothing else. Marked begun."""
        follower = None if early is None else early.follower()
        if (
            follower is None
            or follower.begun
            or follower.ticket is None
            or not all(direct.placed.is_set() for direct in follower.after)
        ):
            return None
        follower.begun = True
        follower.since = asyncio.get_running_loop().time()
        return follower

    def handed(self, follower: EarlyTurn, turn: PgTurn | None) -> bool:
        """The commit that began ``follower``'s turn is back with it (None: it failed, or the
        lock was taken); whether ``follower`` takes it (else it is to be rolled back)."""
        if turn is None or follower.withdrawn:
            follower.begun = False
            return False
        follower.handed = turn
        return True

    async def _held_back(self, early: EarlyTurn) -> bool:
        """Wait until the direct turns ``early`` comes after are placed; whether ``early``
        took a new ticket meanwhile (one of them took a ticket, before it).

        Its transaction must not reach the server's queue before theirs: it would hold the
        keys while its call waits in this process for theirs.
        """
        ticket = early.ticket
        after, early.after = early.after, []
        for direct in after:
            await direct.placed.wait()
        return early.ticket != ticket

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
        early.ended.set()
        calls_on = self.calls_on
        for lock in early.keys:
            left = calls_on[lock] - 1
            if left:
                calls_on[lock] = left
            else:
                del calls_on[lock]
        if early.direct:
            self.placed(early)
            return None  # it holds no ticket
        if early.taken and early.handed is None:  # its turn ended with its call
            self.desk.give_back(early)
            return None
        return self.background.spawn(self._give_up(early))

    async def _give_up(self, early: EarlyTurn) -> None:
        begin = early.begin
        if begin is not None and not early.taken:
            begin.cancel()  # a wait for the locks is cancelled in the server too
            await asyncio.wait([begin])
            if not begin.cancelled() and begin.exception() is None:
                await self.rollback(begin.result())  # it had the locks already
        handed, early.handed = early.handed, None
        if handed is not None:  # handed over, and never taken by its begin task
            await self.rollback(handed)
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
            if begin.done():
                pass  # begun while the call waited in this process (a hand-over, often)
            elif deadline is None:
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
