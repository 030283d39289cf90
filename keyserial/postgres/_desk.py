"""Fair mode's desk: one connection per process and queue that keeps the process's tickets.

It registers tickets, asks their verdicts, gives them back, beats the heartbeat and LISTENs,
one batch (one round trip) at a time; ``EarlyTurn`` is one call's ticket, as the desk and the
call's begin task share it. The rules the verdicts follow are ``_early``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Hashable, Mapping
from typing import Any

import psycopg
from psycopg import AsyncConnection, sql
from psycopg.pq import TransactionStatus
from psycopg_pool import AsyncConnectionPool

from ._errors import PostgresUnavailable, SetupRequired
from ._setup import ensure_sequence, ensure_ticket_table, schema_of
from ._sql_text import every_result, query
from ._tickets import TicketSql, new_owner, owner_lock
from ._turn import PgTurn

Task = asyncio.Task[Any]
logger = logging.getLogger("keyserial")

#: How soon a ticket told ``soon`` is asked again (then twice as long each time, up to
#: ``LAST_RETRY``): the transaction ahead of it is on its way to the server's queue.
FIRST_RETRY = 0.001
LAST_RETRY = 0.05


class EarlyTurn:
    """One call's turn in fair mode, from its registration until the call takes it up.

    The desk alone writes ``ticket``, ``retry``, ``behind``, ``followed_by`` and ``verdict``
    (the latest answer, which replaces one not read yet: it is the newer word) and sets and
    clears ``answered``; the call's side (``EarlyTurns``, its begin task among it) alone reads
    the verdict, writes ``begun``, ``since``, ``handed``, ``direct``, ``after``, ``taken`` and
    ``withdrawn``, and sets ``placed`` and ``ended``.
    """

    __slots__ = (
        "after",
        "answered",
        "begin",
        "begun",
        "behind",
        "direct",
        "ended",
        "followed_by",
        "handed",
        "keys",
        "order",
        "placed",
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
        #: Set once the call ended (its turn committed, rolled back or was never taken).
        self.ended = asyncio.Event()
        #: The turn the commit of the turn right ahead (``behind``) began for this one, in
        #: its own round trip, on its connection (see `EarlyTurns.hand_over`).
        self.handed: PgTurn | None = None
        #: The turn registered right behind this one on its key's line (see `_chain`); it
        #: is still there while its ``behind`` is this one.
        self.followed_by: EarlyTurn | None = None
        self.withdrawn = False
        #: A direct turn (no ticket: see _early) until it takes a ticket instead.
        self.direct = False
        #: Set once a direct turn holds its locks, took a ticket, or ended.
        self.placed = asyncio.Event()
        #: The turn whose ticket is right ahead of this one's on its one key, this process's,
        #: registered with it (see `_chain`): this one's turn is begun by that one's commit,
        #: or once that one ended, with no verdict asked ("behind").
        self.behind: EarlyTurn | None = None
        #: This process's direct turns on the same keys, made earlier and not placed yet
        #: when this ticket was taken: its transaction begins only once they are placed.
        self.after: list[EarlyTurn] = []

    def follower(self) -> EarlyTurn | None:
        """The turn registered right behind this one that still follows it and whose call
        has not ended, if any."""
        follower = self.followed_by
        if follower is None or follower.behind is not self or follower.withdrawn:
            return None
        return follower

    def forget_ticket(self) -> None:
        """The desk takes a new ticket for it: an answer not read yet was the old one's, and
        so was the turn it was behind."""
        self.ticket = None
        self.verdict = None
        self.answered.clear()
        self.behind = None

    def answer(self, verdict: str | BaseException) -> None:
        self.verdict = verdict
        self.answered.set()

    async def next_verdict(self) -> str:
        """The desk's next answer.

        Raises:
            PostgresUnavailable, SetupRequired: the desk could not ask.
        """
        verdict = None
        while verdict is None:  # None: the answer was taken back (see `register_again`)
            await self.answered.wait()
            self.answered.clear()
            verdict, self.verdict = self.verdict, None
        if isinstance(verdict, BaseException):
            raise verdict
        return verdict


class TicketDesk:
    """The tickets of one queue's calls in this process, and the connection that keeps them.

    It alone writes ``live``, ``parked``, its work lists and ``connection``. The call's side
    (``EarlyTurns``) enrols a call's ticket, asks again for a lost one, and gives one back.
    """

    def __init__(
        self, pool: AsyncConnectionPool[Any], table: str, schema: str | None, lease: float
    ) -> None:
        self.pool = pool
        self.table = table
        self.schema = schema
        self.lease = lease
        self.owner = new_owner()
        self.sql = TicketSql(table, schema, lease, self.owner)
        #: order -> every call's turn not yet given back, in registration order.
        self.live: dict[int, EarlyTurn] = {}
        #: order -> turns whose verdict was ``wait``: asked again when their keys' lines move.
        self.parked: dict[int, EarlyTurn] = {}
        self.unregistered: list[EarlyTurn] = []
        #: order -> turns whose registration is on its way to the server, in the batch
        #: being sent.
        self.registering: dict[int, EarlyTurn] = {}
        #: Orders of turns of that batch that must take new tickets once it is back (see
        #: `register_again`).
        self.again: set[int] = set()
        self.to_ask: dict[int, EarlyTurn] = {}
        self.to_give_back: dict[int, tuple[int, ...]] = {}  # ticket -> its locks
        self.task: Task | None = None
        #: The desk's connection while it has one.
        self.connection: AsyncConnection[Any] | None = None
        self.work: asyncio.Event | None = None
        self.closing = False  # the queue is closing: the desk ends as soon as it is idle

    def enrol(self, early: EarlyTurn) -> None:
        """Register ``early``'s ticket in the next batch."""
        self.live[early.order] = early
        self.unregistered.append(early)
        self._poke()

    async def close(self) -> None:
        """End the desk once this process's tickets are given back, at most a lease later."""
        task = self.task
        if task is None or task.done():
            return
        self.closing = True
        self._poke()
        await asyncio.wait([task], timeout=self.lease)
        if not task.done():  # calls of this process still hold tickets: they keep the desk
            self.closing = False

    def _poke(self) -> None:
        if self.task is None or self.task.done():
            self.work = asyncio.Event()
            self.task = asyncio.get_running_loop().create_task(self._serve())
        assert self.work is not None
        self.work.set()

    def ask(self, early: EarlyTurn) -> None:
        if early.order in self.live and not early.withdrawn:
            self.to_ask[early.order] = early
            self._poke()

    def _ask_soon(self, early: EarlyTurn) -> None:
        """Ask again for ``early`` (told ``soon``) shortly, then less and less often."""
        delay, early.retry = early.retry, min(early.retry * 2, LAST_RETRY, self.lease / 3)
        asyncio.get_running_loop().call_later(delay, self.ask, early)

    def register_again(self, lost: EarlyTurn) -> None:
        """``lost`` and this process's later turns not begun take new tickets, in order.

        A process's tickets keep the order of its calls: a later turn whose registration is
        on its way takes a new ticket once its first is known.
        """
        self.again.update(order for order in self.registering if order > lost.order)
        for early in list(self.live.values()):
            if early.order < lost.order or early.begun or early.ticket is None:
                continue
            self.parked.pop(early.order, None)
            self.to_ask.pop(early.order, None)
            self.to_give_back[early.ticket] = tuple(early.keys)
            early.forget_ticket()  # its begin task waits for the verdict of its new ticket
            self.unregistered.append(early)
        self.unregistered.sort(key=lambda early: early.order)
        self._poke()

    def give_back(self, early: EarlyTurn) -> None:
        """Forget ``early``: its call ended; delete its rows unless its commit did."""
        early.followed_by = None  # the turn behind keeps its ``behind``: no cycle is left
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
                self.ask(early)

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
                    if self.live:
                        idle_since = None
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
        connection = await connect_beside(self.pool, autocommit=True)
        try:
            await ensure_sequence(connection, self.table, self.schema)
            await ensure_ticket_table(connection, self.table, self.schema)
            if self.schema is None:
                # Named in full from now on: a turn's commit gives its ticket back after the
                # function's statements, which may point the search path elsewhere.
                self.sql.locate(self.table, await schema_of(connection, self.table))
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
        self.registering = {early.order: early for early in registering}
        asking = [e for e in self.to_ask.values() if e.ticket is not None and not e.begun]
        self.to_ask = {}
        statements, kinds = _batch(self.sql, giving, registering, asking)
        if not statements:
            return
        try:
            cursor = await connection.execute(query(statements))
            results = await every_result(cursor)
        except (psycopg.OperationalError, psycopg.InterfaceError):
            self._sent()
            self.unregistered[:0] = registering  # asked again on the next connection
            for early in asking:
                self.ask(early)
            for ticket, held in giving.items():
                self.to_give_back.setdefault(ticket, held)
            raise
        except psycopg.Error as exc:
            self._sent()
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
                again = self._sent()
                for early, (ticket, verdict) in zip(registering, rows, strict=True):
                    early.ticket = int(ticket)
                    # None: not asked, as it follows the one ahead; if it no longer does
                    # (that one ended meanwhile), it is asked shortly.
                    verdicts[early.ticket] = "soon" if verdict is None else str(verdict)
                    if early.order not in self.live:  # its call ended meanwhile
                        self.to_give_back[early.ticket] = tuple(early.keys)
                    elif early.order in again:  # an earlier turn took a ticket meanwhile
                        self.to_give_back[early.ticket] = tuple(early.keys)
                        early.forget_ticket()
                        self.unregistered.append(early)
                self.unregistered.sort(key=lambda early: early.order)
            elif kind == "verdicts":
                verdicts.update((int(ticket), str(verdict)) for ticket, verdict in rows)
            elif kind == "told":
                self.moved(rows)
        _chain(registering, self.live)
        for asked in registering + asking:
            verdict = verdicts.get(asked.ticket or 0)
            if verdict is None or asked.order not in self.live:
                continue  # it registers again, or its call ended, meanwhile
            if verdict in ("wait", "soon") and asked.behind is not None:
                verdict = "behind"  # it follows the ticket ahead: never parked nor asked again
            elif verdict == "wait":
                # Parked before the answer: a notification read after this batch asks again.
                self.parked[asked.order] = asked
            elif verdict == "soon":
                self._ask_soon(asked)
            else:
                asked.retry = FIRST_RETRY
            asked.answer(verdict)

    def moved(self, rows: list[Any]) -> None:
        """A commit gave tickets back: ask again for this process's turns that its word,
        the rows of `TicketSql.give_back` marked as this process's, names."""
        mine = {int(lock): int(ticket) for lock, ticket, _, own in rows if own}
        if mine:
            self._ask_heads(mine)

    def unchain(self, early: EarlyTurn) -> None:
        """The turn ahead of ``early`` ended without holding its locks: ``early`` is asked for
        its verdict as any ticket is."""
        early.behind = None
        self.ask(early)

    def _sent(self) -> set[int]:
        """The batch is back (or failed): the orders of its turns to register again."""
        again, self.again = self.again, set()
        self.registering = {}
        return again

    async def _heartbeat(self, connection: AsyncConnection[Any]) -> None:
        mine = [e.ticket for e in self.live.values() if e.ticket is not None]
        cursor = await connection.execute(self.sql.heartbeat(mine))
        kept = {int(row[0]) for row in (await every_result(cursor))[-1]}
        for early in list(self.live.values()):
            if early.ticket is not None and not early.begun and early.ticket not in kept:
                self.register_again(early)
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


def _batch(
    tickets: TicketSql,
    giving: Mapping[int, tuple[int, ...]],
    registering: list[EarlyTurn],
    asking: list[EarlyTurn],
) -> tuple[list[str], list[str]]:
    """The statements of one batch of the desk, and what each one's result is: give
    ``giving`` back (ticket -> its locks), register ``registering`` (each new ticket with its
    verdict), ask the verdicts of ``asking``."""
    statements: list[str] = []
    kinds: list[str] = []
    if giving or registering:
        # One transaction: tickets given back and new ones, committed before any verdict.
        statements.append("BEGIN")
        kinds.append("begun")
    given = sorted({lock for held in giving.values() for lock in held})
    # Every line's registration lock at once, in order: two batches never wait for each other
    # in a cycle.
    locking = tickets.registering(given + [lock for early in registering for lock in early.keys])
    statements += locking
    kinds += ["locked"] * len(locking)
    if giving:
        statements += [tickets.tell(list(giving), given), tickets.delete(list(giving))]
        kinds += ["told", "given back"]
    if registering:
        statements += [tickets.register(list(early.keys)) for early in registering]
        kinds += ["registered"] * len(registering)
    if giving or registering:
        statements.append("COMMIT")
        kinds.append("committed")
    if registering:
        # A ticket registered right behind its own on one key follows it (`_chain`): no
        # verdict is asked for it.
        heads = [
            place
            for place, early in enumerate(registering, 1)
            if place == 1 or not _one_same_key(registering[place - 2], early)
        ]
        statements.append(tickets.new_verdicts(len(registering), heads))
        kinds.append("new verdicts")
    if asking:
        statements.append(tickets.verdicts([early.ticket or 0 for early in asking]))
        kinds.append("verdicts")
    return statements, kinds


def _chain(registered: list[EarlyTurn], live: Mapping[int, EarlyTurn]) -> None:
    """Note, for each turn of a batch just registered, the turn registered right before it in
    the batch if both have one key, the same: on that key's line, the two tickets are next to
    each other (the batch held the key's registration lock). The desk's own step: it alone
    writes ``behind``."""
    ahead: EarlyTurn | None = None
    for early in registered:
        early.behind = None
        if early.ticket is None or early.order not in live:  # again, or it ended
            ahead = None
            continue
        if ahead is not None and _one_same_key(ahead, early):
            early.behind = ahead
            ahead.followed_by = early
        ahead = early


def _one_same_key(ahead: EarlyTurn, early: EarlyTurn) -> bool:
    """Whether ``early``, registered right after ``ahead`` in one batch, follows it on its
    line: both have one key, the same."""
    return len(early.keys) == 1 and early.keys.keys() == ahead.keys.keys()


async def _close(connection: AsyncConnection[Any]) -> None:
    with contextlib.suppress(Exception):
        await connection.close()


async def connect_beside(pool: AsyncConnectionPool[Any], **settings: Any) -> AsyncConnection[Any]:
    """A connection of its own, outside ``pool``, made as the pool makes its connections (its
    conninfo and kwargs, which it may hold as functions, sync or async), with ``settings``
    over its kwargs.

    Raises:
        psycopg.OperationalError: the server could not be reached.
    """
    conninfo: str = await _resolved(pool.conninfo)
    kwargs: dict[str, Any] = dict(await _resolved(pool.kwargs) or {})
    kwargs.update(settings)
    return await psycopg.AsyncConnection.connect(conninfo, **kwargs)


async def _resolved(setting: object) -> Any:
    value = setting() if callable(setting) else setting
    return await value if inspect.isawaitable(value) else value
