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
  in the server right behind it, so a hand-off costs what it costs in the default mode;
* ``wait``: two or more live tickets are ahead. A notification (a call gave its ticket
  back, in its commit or later: ``pg_notify`` on the queue's channel, the key's lock id as
  payload) or the next heartbeat asks again;
* ``soon``: one ticket is ahead, and its transaction is not in the server's lock queue yet
  (it is on its way): asked again shortly, then less and less often;
* ``lost``: the row is gone (its process was stopped for so long that another process
  cleared it): it registers again, with its process's later waiting tickets, in call order.

A ticket is live while its process's desk (below) holds its session's advisory lock, the
*owner lock*, and its heartbeat refreshes ``seen`` every third of the lease: the tickets of
a process that died are skipped at once (its sessions end with it), those of a process
that stopped a lease later. So at
most two transactions of a key are open at a time, the holder's and the next call's; every
other waiting call holds only its row. Whether a ticket's transaction is in the server's
lock queue is read in ``pg_locks``: the transaction first takes a try-lock whose two-int
key is its ticket, then the keys' locks, on the same backend.

Each process keeps one connection of its own for its tickets (the *desk*): it registers,
asks verdicts, gives tickets back, beats the heartbeat and LISTENs, one batch at a time.
It is opened on first use and closed once the process has had no ticket for a lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import itertools
import logging
import secrets
from collections.abc import Awaitable, Callable, Hashable, Mapping
from typing import Any

import psycopg
from psycopg import AsyncConnection, sql
from psycopg.pq import TransactionStatus
from psycopg_pool import AsyncConnectionPool

from .._background import Background
from ._errors import PostgresUnavailable, SetupRequired, naming
from ._setup import ensure_sequence, ensure_ticket_table, sequence, ticket_table
from ._turn import PgTurn

Task = asyncio.Task[Any]
logger = logging.getLogger("keyserial")

#: How soon a ticket told ``soon`` is asked again (then twice as long each time, up to
#: ``LAST_RETRY``): the transaction ahead of it is on its way to the server's queue.
FIRST_RETRY = 0.001
LAST_RETRY = 0.05

_LOW31 = (1 << 31) - 1
_LOW32 = (1 << 32) - 1


def ticket_lock(ticket: int) -> tuple[int, int]:
    """The two-int advisory try-lock that marks a ticket's transaction in ``pg_locks``.

    Its first int is never negative; an owner lock's always is: the two never meet.
    """
    return ticket >> 31, ticket & _LOW31


#: Mixed into a line's lock id to make its registration lock (see `TicketSql.registering`):
#: another bigint advisory lock, which a key's lock id matches by chance no more often than
#: two keys' ids do.
_REGISTRATION = 0x5265676973746572  # "Register"


def registration_lock(lock: int) -> int:
    """The bigint advisory lock that orders the registrations on ``lock``'s line."""
    mixed = (lock ^ _REGISTRATION) & ((1 << 64) - 1)
    return mixed - (1 << 64) if mixed >= 1 << 63 else mixed


def new_owner() -> int:
    """A process's owner id: a random negative bigint, so its owner lock's first int is
    negative (see `ticket_lock`)."""
    return -1 - secrets.randbits(63)


def owner_lock(owner: int) -> tuple[int, int]:
    """The two-int advisory lock the desk's session holds for ``owner``, as int4s."""
    low = owner & _LOW32
    return owner >> 32, low - (1 << 32) if low >= 1 << 31 else low


class TicketSql:
    """The statements of one queue's tickets: its table, channel, sequence and lease."""

    def __init__(self, table: str, schema: str | None, lease: float, owner: int) -> None:
        self.table = ticket_table(table, schema)
        self.sequence = sequence(table, schema)
        digest = hashlib.sha256(f"{schema}\0{table}".encode()).hexdigest()[:16]
        #: The LISTEN channel of the queue's table: every process of the queue shares it.
        self.channel = f"keyserial_{digest}"
        self.owner = sql.Literal(owner)
        self.lease = sql.Literal(f"{max(1, int(lease * 1000))} milliseconds")
        self.gone = sql.Literal(f"{max(1, int(3 * lease * 1000))} milliseconds")

    def verdict(self, ticket: sql.Composable) -> sql.Composed:
        """An expression: ``ticket``'s verdict (see the module's docstring)."""
        # pg_locks shows the locks of every database of the server: only this one's count.
        here = sql.SQL("(SELECT oid FROM pg_database WHERE datname = current_database())")
        owner_alive = sql.SQL(
            "SELECT 1 FROM pg_locks o WHERE o.locktype = 'advisory' AND o.objsubid = 2 "
            "AND o.database = {here} AND o.granted "
            "AND o.classid::bigint = (r.owner >> 32) & {low32} "
            "AND o.objid::bigint = r.owner & {low32}"
        ).format(here=here, low32=sql.Literal(_LOW32))
        ahead = sql.SQL(
            "FROM {t} m JOIN {t} r ON r.lock = m.lock AND r.ticket < m.ticket "
            "WHERE m.ticket = {ticket} AND m.owner = {owner} "
            "AND r.seen > clock_timestamp() - {lease}::interval AND EXISTS ({owner_alive})"
        ).format(
            t=self.table,
            ticket=ticket,
            owner=self.owner,
            lease=self.lease,
            owner_alive=owner_alive,
        )
        in_server = sql.SQL(
            "SELECT 1 FROM pg_locks a JOIN pg_locks b ON b.pid = a.pid "
            "WHERE a.locktype = 'advisory' AND a.objsubid = 2 AND a.granted "
            "AND a.database = {here} "
            "AND a.classid::bigint = r.ticket >> 31 AND a.objid::bigint = r.ticket & {low31} "
            "AND b.locktype = 'advisory' AND b.objsubid = 1 "
            "AND b.classid::bigint = (m.lock >> 32) & {low32} "
            "AND b.objid::bigint = m.lock & {low32}"
        ).format(here=here, low31=sql.Literal(_LOW31), low32=sql.Literal(_LOW32))
        return sql.SQL(
            "CASE WHEN NOT EXISTS (SELECT 1 FROM {t} m WHERE m.ticket = {ticket} "
            "AND m.owner = {owner}) THEN 'lost' "
            "WHEN EXISTS (SELECT 1 {ahead} GROUP BY m.lock HAVING count(*) > 1) THEN 'wait' "
            "WHEN EXISTS (SELECT 1 {ahead} AND NOT EXISTS ({in_server})) THEN 'soon' "
            "ELSE 'go' END"
        ).format(t=self.table, ticket=ticket, owner=self.owner, ahead=ahead, in_server=in_server)

    def registering(self, locks: list[int]) -> sql.Composed:
        """Take the registration locks of ``locks``' lines, in order, for the transaction.

        Registrations on one line then commit in the order their tickets were drawn, so a
        verdict asked after a registration's commit sees every smaller ticket of the line.
        """
        return sql.SQL("; ").join(
            sql.SQL("SELECT pg_advisory_xact_lock({})").format(sql.Literal(registration_lock(lock)))
            for lock in sorted(set(locks))
        )

    def register(self, locks: list[int]) -> sql.Composed:
        """One call's rows, under one new ticket."""
        return sql.SQL(
            "INSERT INTO {t} (lock, ticket, owner, seen) "
            "SELECT l, n.ticket, {owner}, clock_timestamp() "
            "FROM (SELECT nextval({seq}) AS ticket) n, unnest({locks}::bigint[]) l"
        ).format(
            t=self.table,
            owner=self.owner,
            seq=sql.Literal(self.sequence.as_string(None)),
            locks=sql.Literal(locks),
        )

    def prepare(self) -> sql.Composed:
        """Prepare, in the desk's session, the query of the verdicts of tickets.

        The desk's session plans it once (``plan_cache_mode``): its subqueries over
        ``pg_locks`` cost more to plan than to run.
        """
        return sql.SQL(
            "SET plan_cache_mode = force_generic_plan; "
            "PREPARE keyserial_verdicts(bigint[]) AS "
            "SELECT t, {verdict} FROM unnest($1::bigint[]) t; "
            "PREPARE keyserial_new_verdicts(int) AS "
            "SELECT t, {verdict} FROM (SELECT DISTINCT ticket AS t FROM {table} "
            "WHERE owner = {owner} ORDER BY ticket DESC LIMIT $1) n ORDER BY t"
        ).format(verdict=self.verdict(sql.SQL("t")), table=self.table, owner=self.owner)

    def new_verdicts(self, count: int) -> sql.Composed:
        """The ``count`` tickets this process drew last, in order, and their verdicts."""
        return sql.SQL("EXECUTE keyserial_new_verdicts({})").format(sql.Literal(count))

    def verdicts(self, tickets: list[int]) -> sql.Composed:
        return sql.SQL("EXECUTE keyserial_verdicts({}::bigint[])").format(sql.Literal(tickets))

    def give_back(self, tickets: list[int], locks: list[int]) -> sql.Composed:
        """Delete ``tickets``' rows; tell each of ``locks``' lines who may now go.

        The payload, ``<lock>:<ticket>``, names the second ticket of the line (the first is
        the next call's, in the server's queue already), or the first if it is alone: only
        the calls up to it are asked again. A ticket named that is dead or stopped leaves
        the line to the heartbeat, which asks every parked call.
        """
        next_up = sql.SQL(
            "COALESCE((SELECT ticket FROM {t} WHERE lock = l ORDER BY ticket OFFSET 1 LIMIT 1), "
            "(SELECT min(ticket) FROM {t} WHERE lock = l))"
        ).format(t=self.table)
        return sql.SQL(
            "DELETE FROM {t} WHERE owner = {owner} AND ticket = ANY({tickets}::bigint[]); "
            "SELECT pg_notify({channel}, l || ':' || h) "
            "FROM unnest({locks}::bigint[]) l, LATERAL (SELECT {next_up}) x(h) "
            "WHERE h IS NOT NULL"
        ).format(
            t=self.table,
            owner=self.owner,
            tickets=sql.Literal(tickets),
            channel=sql.Literal(self.channel),
            locks=sql.Literal(locks),
            next_up=next_up,
        )

    def heartbeat(self, tickets: list[int]) -> sql.Composed:
        """Clear the rows of processes gone for three leases and this process's rows no
        call holds; refresh the others, returning their tickets."""
        return sql.SQL(
            "DELETE FROM {t} WHERE seen < clock_timestamp() - {gone}::interval; "
            "DELETE FROM {t} WHERE owner = {owner} AND ticket <> ALL({tickets}::bigint[]); "
            "UPDATE {t} SET seen = clock_timestamp() WHERE owner = {owner} RETURNING ticket"
        ).format(t=self.table, gone=self.gone, owner=self.owner, tickets=sql.Literal(tickets))


class EarlyTurn:
    """One call's turn in fair mode, from its registration until the call takes it up.

    The desk alone writes ``ticket``, ``retry`` and ``verdict`` (the latest answer, which
    replaces one not read yet: it is the newer word) and sets ``answered``; the begin task
    alone reads the verdict and writes ``begun`` and ``since``; the call's side alone writes
    ``taken`` and ``withdrawn``.
    """

    __slots__ = (
        "answered",
        "begin",
        "begun",
        "keys",
        "order",
        "retry",
        "since",
        "taken",
        "ticket",
        "verdict",
        "withdrawn",
    )

    def __init__(self, keys: Mapping[int, Hashable], order: int) -> None:
        loop = asyncio.get_running_loop()
        self.keys = keys
        self.order = order  # registration order in this process
        self.ticket: int | None = None
        #: The desk's latest answer for the ticket: a verdict, or why there will be none.
        self.verdict: str | BaseException | None = None
        self.answered = asyncio.Event()
        self.retry = FIRST_RETRY
        self.since = loop.time()  # no later than the server's idle timer of the turn starts
        self.begin: asyncio.Task[PgTurn] | None = None
        self.begun = False  # its transaction was asked for, on a connection of the pool
        self.taken = False
        self.withdrawn = False

    def answer(self, verdict: str | BaseException) -> None:
        self.verdict = verdict
        self.answered.set()

    async def next_verdict(self) -> str:
        """The desk's next answer.

        Raises:
            PostgresUnavailable, SetupRequired: the desk could not ask.
        """
        await self.answered.wait()
        self.answered.clear()
        verdict, self.verdict = self.verdict, None
        if isinstance(verdict, BaseException):
            raise verdict
        assert verdict is not None
        return verdict


class EarlyTurns:
    """Fair mode's turns of one queue in this process: tickets, and the desk that keeps them.

    It alone writes ``live``, ``parked`` and the desk's work lists. ``begin`` begins a
    ticket's transaction (``PostgresTurns.begin_ticket``), ``rollback`` ends one without
    keeping anything.
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
        self.pool = pool
        self.table = table
        self.schema = schema
        self.lease = lease
        self.begin = begin
        self.rollback = rollback
        self.owner = new_owner()
        self.sql = TicketSql(table, schema, lease, self.owner)
        self.numbers = itertools.count()
        #: order -> every call's turn not yet given back, in registration order.
        self.live: dict[int, EarlyTurn] = {}
        #: order -> turns whose verdict was ``wait``: asked again when their keys' lines move.
        self.parked: dict[int, EarlyTurn] = {}
        self.unregistered: list[EarlyTurn] = []
        self.to_ask: dict[int, EarlyTurn] = {}
        self.to_give_back: dict[int, tuple[int, ...]] = {}  # ticket -> its locks
        self.desk: Task | None = None
        #: The desk's connection while it has one (written by the desk alone).
        self.connection: AsyncConnection[Any] | None = None
        self.work: asyncio.Event | None = None
        self.closing = False  # the queue is closing: the desk ends as soon as it is idle
        #: Turns given up and being rolled back, running on their own.
        self.background = Background("fair mode's background work")

    # The call's side.

    def register(self, keys: Mapping[int, Hashable]) -> EarlyTurn:
        """Take a ticket for a call registering now, and begin its turn once the ticket's
        verdict says so.

        The call takes it up with `take_up` when its turn in this process comes, or gives it
        up with `withdraw`; one of the two must follow, then `withdraw` gives the ticket back.
        """
        early = EarlyTurn(keys, next(self.numbers))
        self.live[early.order] = early
        self.unregistered.append(early)
        self._poke()
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
                self._register_again(early)
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
        self._give_back(early)

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
        desk = self.desk
        if desk is None or desk.done():
            return
        self.closing = True  # the desk ends once no call holds a ticket and its work is done
        self._poke()
        await asyncio.wait([desk], timeout=self.lease)
        if not desk.done():  # calls of this process still hold tickets: they keep the desk
            self.closing = False

    # The desk's work lists: written here, drained by the desk.

    def _poke(self) -> None:
        if self.desk is None or self.desk.done():
            self.work = asyncio.Event()
            self.desk = asyncio.get_running_loop().create_task(self._serve())
        assert self.work is not None
        self.work.set()

    def _ask(self, early: EarlyTurn) -> None:
        if early.order in self.live and not early.withdrawn:
            self.to_ask[early.order] = early
            self._poke()

    def _ask_soon(self, early: EarlyTurn) -> None:
        """Ask again for ``early`` (told ``soon``) shortly, then less and less often."""
        delay, early.retry = early.retry, min(early.retry * 2, LAST_RETRY, self.lease / 3)
        asyncio.get_running_loop().call_later(delay, self._ask, early)

    def _register_again(self, lost: EarlyTurn) -> None:
        """``lost`` and this process's later turns not begun take new tickets, in order."""
        for early in list(self.live.values()):
            if early.order < lost.order or early.begun or early.ticket is None:
                continue
            self.parked.pop(early.order, None)
            self.to_ask.pop(early.order, None)
            self.to_give_back[early.ticket] = tuple(early.keys)
            early.ticket = None  # its begin task waits for the verdict of its new ticket
            self.unregistered.append(early)
        self.unregistered.sort(key=lambda early: early.order)
        self._poke()

    def _give_back(self, early: EarlyTurn) -> None:
        self.live.pop(early.order, None)
        self.parked.pop(early.order, None)
        self.to_ask.pop(early.order, None)
        if early in self.unregistered:
            self.unregistered.remove(early)
        begin = early.begin
        committed = (
            early.taken
            and begin is not None
            and begin.done()
            and not begin.cancelled()
            and begin.exception() is None
            and begin.result().ticket is None  # its commit gave the ticket back
        )
        if early.ticket is not None and not committed:
            self.to_give_back[early.ticket] = tuple(early.keys)
            self._poke()

    def _ask_heads(self, up_to: Mapping[int, int] | None) -> None:
        """Ask again for the first parked turn of this process on each lock of ``up_to``
        whose ticket is no later than the lock's ticket there (None: on every lock)."""
        seen: set[int] = set()
        for early in sorted(self.parked.values(), key=lambda early: early.order):
            wanted = [lock for lock in early.keys if up_to is None or lock in up_to]
            first = [lock for lock in wanted if lock not in seen]
            seen.update(wanted)
            ticket = early.ticket
            if first and (
                up_to is None or any(ticket is not None and ticket <= up_to[lock] for lock in first)
            ):
                del self.parked[early.order]
                self._ask(early)

    # The desk: one connection, one batch at a time.

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        beat = self.lease / 3
        connection: AsyncConnection[Any] | None = None
        next_beat = loop.time() + beat
        idle_since: float | None = None
        try:
            while True:
                if connection is None:
                    connection = self.connection = await self._connect()
                    if connection is None:
                        return  # unreachable, and nothing left to do
                    # Notifications may have been missed, and tickets lost, meanwhile.
                    next_beat = loop.time()
                try:
                    now = loop.time()
                    if now >= next_beat:
                        next_beat = now + beat
                        await self._heartbeat(connection)
                        self._ask_heads(None)
                    elif self.unregistered or self.to_ask or self.to_give_back:
                        await self._work(connection)
                    elif not self.live:
                        idle_since = now if idle_since is None else idle_since
                        if self.closing or now - idle_since >= self.lease:
                            return
                        await self._listen(connection, min(next_beat, idle_since + self.lease))
                    else:
                        idle_since = None
                        await self._listen(connection, next_beat)
                except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                    await _close(connection)
                    connection = self.connection = None
                    logger.debug("keyserial: the ticket connection broke: %r", exc)
                except Exception as exc:
                    # Not the connection's failure: the calls waiting for a verdict are told,
                    # rather than left waiting for one that would never come.
                    logger.warning("keyserial: fair mode's tickets failed: %r", exc)
                    self._fail_waiting(PostgresUnavailable(f"fair mode's tickets failed: {exc}"))
                    await _close(connection)
                    connection = self.connection = None
        finally:
            self.connection = None
            if connection is not None:
                await _close(connection)

    async def _connect(self) -> AsyncConnection[Any] | None:
        """The desk's connection, listening, once the queue's objects exist.

        Tried twice; if the server cannot be reached, every call still waiting for a
        verdict gets ``PostgresUnavailable`` (it holds nothing, as a call of the default
        mode whose connection broke), and the desk tries again each third of a lease while
        calls of this process hold tickets; None once none does.
        """
        while True:
            failure: BaseException | None = None
            for _ in range(2):
                try:
                    connection = await self._open()
                except SetupRequired as exc:
                    failure = exc
                    break
                except psycopg.Error as exc:
                    failure = PostgresUnavailable(f"PostgreSQL is unreachable: {exc}")
                    continue
                return connection
            assert failure is not None
            self._fail_waiting(failure)
            self.to_give_back.clear()  # the heartbeat clears what is left, once back
            if not self.live:
                return None
            await asyncio.sleep(self.lease / 3)

    def _fail_waiting(self, failure: BaseException) -> None:
        """Tell every call still waiting for a verdict that none will come."""
        for early in list(self.live.values()):
            if not early.begun:
                early.answer(failure)
        self.unregistered.clear()
        self.to_ask.clear()
        self.parked.clear()

    async def _open(self) -> AsyncConnection[Any]:
        conninfo: str = await resolved(self.pool.conninfo)
        kwargs: dict[str, Any] = dict(await resolved(self.pool.kwargs) or {})
        kwargs["autocommit"] = True
        connection = await psycopg.AsyncConnection.connect(conninfo, **kwargs)
        try:
            await ensure_sequence(connection, self.table, self.schema)
            await ensure_ticket_table(connection, self.table, self.schema)
            await connection.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.sql.channel)))
            await connection.execute(self.sql.prepare())
            # Held for the session's life: the server drops it when the process dies.
            await connection.execute(
                "SELECT pg_try_advisory_lock(%s, %s)", owner_lock(self.owner), prepare=False
            )
        except BaseException:
            await _close(connection)
            raise
        return connection

    async def _work(self, connection: AsyncConnection[Any]) -> None:
        """One batch, one round trip: give tickets back, register (each new ticket with its
        verdict), ask verdicts; park the calls told to wait."""
        giving, self.to_give_back = self.to_give_back, {}
        registering = [early for early in self.unregistered if not early.withdrawn]
        self.unregistered = []
        asking = [e for e in self.to_ask.values() if e.ticket is not None and not e.begun]
        self.to_ask = {}
        statements: list[sql.Composable] = []
        kinds: list[str] = []  # what each statement's result is
        if giving or registering:
            # One transaction: tickets given back and new ones, committed before any verdict.
            statements.append(sql.SQL("BEGIN"))
            kinds.append("begun")
        if giving:
            locks = sorted({lock for held in giving.values() for lock in held})
            statements.append(self.sql.give_back(list(giving), locks))
            kinds += ["given back", "notified"]
        if registering:
            registered = [lock for early in registering for lock in early.keys]
            statements.append(self.sql.registering(registered))
            kinds += ["locked"] * len(set(registered))
            for early in registering:
                statements.append(self.sql.register(list(early.keys)))
                kinds.append("registered")
        if giving or registering:
            statements.append(sql.SQL("COMMIT"))
            kinds.append("committed")
        if registering:
            statements.append(self.sql.new_verdicts(len(registering)))
            kinds.append("new verdicts")
        if asking:
            statements.append(self.sql.verdicts([early.ticket or 0 for early in asking]))
            kinds.append("verdicts")
        if not statements:
            return
        try:
            cursor = await connection.execute(sql.SQL("; ").join(statements))
            results = await _results(cursor)
        except (psycopg.OperationalError, psycopg.InterfaceError):
            self.unregistered[:0] = registering  # asked again on the next connection
            for early in asking:
                self._ask(early)
            for ticket, held in giving.items():
                self.to_give_back.setdefault(ticket, held)
            raise
        except psycopg.Error as exc:
            if connection.info.transaction_status != TransactionStatus.IDLE:
                await connection.execute("ROLLBACK")
            error: BaseException = PostgresUnavailable(f"fair mode's tickets failed: {exc}")
            if isinstance(exc, psycopg.errors.InsufficientPrivilege):
                error = SetupRequired(
                    f"this role may not use the ticket table of fair mode ({exc}): run "
                    "'python -m keyserial.postgres setup <dsn> --grant <role>' once"
                )
            for early in registering + asking:
                early.answer(error)
            return
        verdicts: dict[int, str] = {}
        for kind, rows in zip(kinds, results, strict=True):
            if kind == "new verdicts":  # in ticket order, which is registration order
                for early, (ticket, verdict) in zip(registering, rows, strict=True):
                    early.ticket = int(ticket)
                    verdicts[early.ticket] = str(verdict)
                    if early.order not in self.live:  # its call ended meanwhile
                        self.to_give_back[early.ticket] = tuple(early.keys)
            elif kind == "verdicts":
                verdicts.update((int(ticket), str(verdict)) for ticket, verdict in rows)
        for asked in registering + asking:
            verdict = verdicts.get(asked.ticket or 0)
            if verdict is None or asked.order not in self.live:
                continue  # it registers again, or its call ended, meanwhile
            if verdict == "wait":
                # Parked before the answer: a notification read after this batch asks again.
                self.parked[asked.order] = asked
            elif verdict == "soon":
                self._ask_soon(asked)
            else:
                asked.retry = FIRST_RETRY
            asked.answer(verdict)

    async def _heartbeat(self, connection: AsyncConnection[Any]) -> None:
        mine = [e.ticket for e in self.live.values() if e.ticket is not None]
        cursor = await connection.execute(self.sql.heartbeat(mine))
        kept = {int(row[0]) for row in (await _results(cursor))[-1]}
        for early in list(self.live.values()):
            if early.ticket is not None and not early.begun and early.ticket not in kept:
                self._register_again(early)
                break  # it takes the later ones along

    async def _listen(self, connection: AsyncConnection[Any], until: float) -> None:
        """Take notifications until ``until`` or until there is work for the desk."""
        work = self.work
        assert work is not None
        work.clear()
        loop = asyncio.get_running_loop()
        listening = loop.create_task(self._receive(connection, max(0.0, until - loop.time())))
        woken = loop.create_task(work.wait())
        try:
            await asyncio.wait([listening, woken], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (listening, woken):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await woken
            try:
                await listening
            except asyncio.CancelledError:
                if not listening.cancelled():
                    raise

    async def _receive(self, connection: AsyncConnection[Any], timeout: float) -> None:
        async for notify in connection.notifies(timeout=timeout):
            lock, _, ticket = notify.payload.partition(":")
            with contextlib.suppress(ValueError):
                self._ask_heads({int(lock): int(ticket)})


async def _results(cursor: psycopg.AsyncCursor[Any]) -> list[list[Any]]:
    """The rows of every statement of a multi-statement query, in order (none for those
    without rows)."""
    results: list[list[Any]] = []
    while True:
        results.append(list(await cursor.fetchall()) if cursor.description else [])
        if not cursor.nextset():
            return results


async def _close(connection: AsyncConnection[Any]) -> None:
    with contextlib.suppress(Exception):
        await connection.close()


async def resolved(setting: object) -> Any:
    """A pool setting's value: the pool may hold it as a function, sync or async."""
    value = setting() if callable(setting) else setting
    return await value if inspect.isawaitable(value) else value
