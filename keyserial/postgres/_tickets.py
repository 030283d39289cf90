"""Fair mode's statements: the ticket table's rows, the verdicts, and the locks they read.

A ticket is one row per key in ``<table>_tq``: ``(lock, ticket, owner, seen)``. Three kinds of
advisory lock tell the server's state to the verdicts (see ``_early``):

* a turn's transaction takes a two-int *ticket lock* (first int never negative) before the
  keys' locks, so ``pg_locks`` shows it in the server's queue;
* a process's ticket connection holds a two-int *owner lock* (first int always negative) for
  its session's life, so ``pg_locks`` shows the process alive;
* a registration, or a give-back that tells a line, takes each key's *registration lock* (a
  bigint) for its transaction, so the registrations on one key commit in the order their
  tickets were drawn, and each tell sees the line as the give-backs before it left it.
"""

from __future__ import annotations

import hashlib
import secrets

from psycopg import sql

from ._setup import sequence, ticket_table
from ._sql_text import bigints, rendered

_LOW31 = (1 << 31) - 1
_LOW32 = (1 << 32) - 1
_LOW64 = (1 << 64) - 1


#: The setting, local to a direct turn's transaction, that says whether another process's call
#: waits with a ticket on the turn's keys (``'true'``: the turn locks nothing).
OTHERS_WAITING = "keyserial.others_waiting"


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


#: This database's oid: pg_locks shows the locks of every database of the server, and only
#: this one's count.
_HERE = "(SELECT oid FROM pg_database WHERE datname = current_database())"


class TicketSql:
    """The statements of one queue's tickets: its table, channel, sequence and lease."""

    def __init__(self, table: str, schema: str | None, lease: float, owner: int) -> None:
        self.owner_id = owner
        self.owner = sql.Literal(owner)
        self.lease = sql.Literal(f"{max(1, int(lease * 1000))} milliseconds")
        self.gone = sql.Literal(f"{max(1, int(3 * lease * 1000))} milliseconds")
        # The same, as text, for the statements put together as text (see `_sql_text`).
        self.lease_text = rendered(self.lease)
        self.others_setting = rendered(sql.Literal(OTHERS_WAITING))
        digest = hashlib.sha256(f"{schema}\0{table}".encode()).hexdigest()[:16]
        #: The LISTEN channels of the queue's table: one per process, named after its owner
        #: id (``to_hex`` in the server), so a commit wakes only the processes it concerns.
        #: Named after the queue's ``table=`` and ``schema=`` as given.
        self.channels = f"keyserial_{digest}_"
        self.channel = f"{self.channels}{owner & _LOW64:016x}"
        self.channels_text = rendered(sql.Literal(self.channels))
        self.sequence = sequence(table, schema)
        self.sequence_text = rendered(sql.Literal(self.sequence.as_string(None)))
        self.locate(table, schema)

    def locate(self, table: str, schema: str | None) -> None:
        """Name the queue's ticket table ``table`` in ``schema`` (None: as the search path
        finds it when each statement runs)."""
        self.table = ticket_table(table, schema)
        self.table_text = rendered(self.table)

    def verdict(self, ticket: sql.Composable) -> sql.Composed:
        """An expression: ``ticket``'s verdict (the rules are in ``_early``'s docstring)."""
        here = sql.SQL(_HERE)
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

    def others_waiting(self, locks: list[int]) -> str:
        """Note in the transaction's setting `OTHERS_WAITING` whether a call of another process
        holds a fresh ticket on any of ``locks``' lines: a direct turn then locks nothing (see
        ``_early``)."""
        return (
            f"SELECT set_config({self.others_setting}, EXISTS (SELECT 1 FROM {self.table_text} "
            f"WHERE lock = ANY({bigints(locks)}) AND owner <> {self.owner_id} "
            f"AND seen > clock_timestamp() - {self.lease_text}::interval)::text, true)"
        )

    def registering(self, locks: list[int]) -> list[str]:
        """Take the registration locks of ``locks``' lines, in order, for the transaction.

        Registrations on one line then commit in the order their tickets were drawn, so a
        verdict asked after a registration's commit sees every smaller ticket of the line;
        and a tell (see `give_back`) sees every registration and give-back committed before.
        """
        return [
            f"SELECT pg_advisory_xact_lock({registration_lock(lock)})"
            for lock in sorted(set(locks))
        ]

    def register(self, locks: list[int]) -> str:
        """One call's rows, under one new ticket."""
        return (
            f"INSERT INTO {self.table_text} (lock, ticket, owner, seen) "
            f"SELECT l, n.ticket, {self.owner_id}, clock_timestamp() "
            f"FROM (SELECT nextval({self.sequence_text}) AS ticket) n, unnest({bigints(locks)}) l"
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
            "PREPARE keyserial_new_verdicts(int, int[]) AS "
            "SELECT t, CASE WHEN i = ANY($2) THEN {verdict} END "
            "FROM (SELECT t, row_number() OVER (ORDER BY t) AS i FROM (SELECT DISTINCT "
            "ticket AS t FROM {table} WHERE owner = {owner} ORDER BY ticket DESC LIMIT $1) d) x "
            "ORDER BY t"
        ).format(verdict=self.verdict(sql.SQL("t")), table=self.table, owner=self.owner)

    def new_verdicts(self, count: int, asked: list[int]) -> str:
        """The ``count`` tickets this process drew last, in order, and the verdicts of those
        at the positions ``asked`` (from 1); the others' verdicts are NULL."""
        positions = ", ".join(map(str, asked))
        return f"EXECUTE keyserial_new_verdicts({int(count)}, ARRAY[{positions}]::int[])"

    def verdicts(self, tickets: list[int]) -> str:
        """``tickets`` and their verdicts."""
        return f"EXECUTE keyserial_verdicts({bigints(tickets)})"

    def give_back(self, tickets: list[int], locks: list[int]) -> list[str]:
        """Tell each of ``locks``' lines who may go once ``tickets`` (this process's) are given
        back; delete ``tickets``' rows.

        The word, ``<lock>:<ticket>``, names the second fresh ticket left on the line (one
        whose heartbeat is less than a lease old), or the first if it is alone: only the
        calls up to it are asked again. Another process hears it as a notification
        (``pg_notify``, sent when the transaction commits) only if it holds the second
        fresh ticket and the first is another process's, or if it holds the first and older
        rows are ahead of it. No one else needs it:

        * the first fresh ticket left was the second at an earlier give-back (or at its
          own registration), and was asked then, unless rows that were fresh then are
          ahead of it (a stopped process's: it is told now); with one live ticket ahead,
          its verdict was ``go`` or ``soon``, and a call told ``soon`` asks again on its
          own;
        * when the first two are one process's, the second waits for the first (it follows
          it, or it is asked once the first is given back: that process gives it back, and
          hears its own word).

        The tell first takes the lines' registration locks (see `registering`): the tells
        and registrations of a line take turns, so each tell sees the line as the one before
        left it. Two give-backs at once would otherwise each see the other's ticket still
        there, and neither would name the ticket that both together make second.

        This process's own share comes back as the tell's rows ``(lock, ticket, _, true)``
        (see `TicketDesk.moved`): the next-to-last statement's. A ticket named that is dead
        leaves the line to the heartbeat, which asks every parked call (and clears a dead
        process's rows once a lease old).
        """
        return [*self.registering(locks), self.tell(tickets, locks), self.delete(tickets)]

    def tell(self, tickets: list[int], locks: list[int]) -> str:
        """The statement of `give_back` that tells the lines, once it holds their
        registration locks."""
        given = bigints(tickets)
        return (
            # Of the first two fresh tickets left, the second's row notifies its process when
            # the two have two owners; the first's, when older rows are ahead of it.
            # The line's first row, fresh or not (``head``), is looked up once per line.
            f"SELECT l, o.h, CASE WHEN o.owner <> {self.owner_id} AND ((o.ticket = o.h "
            f"AND o.lo <> o.hi) OR (o.ticket = o.first AND o.first > r.head)) THEN pg_notify("
            f"{self.channels_text} || lpad(to_hex(o.owner), 16, '0'), l || ':' || o.ticket) "
            f"END, o.owner = {self.owner_id} "
            f"FROM unnest({bigints(locks)}) l, "
            f"LATERAL (SELECT min(ticket) FROM {self.table_text} WHERE lock = l "
            f"AND ticket <> ALL({given})) r(head), "
            f"LATERAL (SELECT owner, ticket, "
            f"max(ticket) OVER (), min(owner) OVER (), max(owner) OVER (), min(ticket) OVER () "
            f"FROM (SELECT owner, ticket FROM {self.table_text} WHERE lock = l "
            f"AND ticket <> ALL({given}) "
            f"AND seen > clock_timestamp() - {self.lease_text}::interval "
            f"ORDER BY ticket LIMIT 2) f) o(owner, ticket, h, lo, hi, first)"
        )

    def delete(self, tickets: list[int]) -> str:
        """The last statement of `give_back`."""
        return (
            f"DELETE FROM {self.table_text} "
            f"WHERE owner = {self.owner_id} AND ticket = ANY({bigints(tickets)})"
        )

    def heartbeat(self, tickets: list[int]) -> sql.Composed:
        """Take the owner lock if this session does not hold it yet (a session of this
        process that the server had not ended yet held it when this one began); clear the
        rows of processes that stopped three leases ago, or died a lease ago (no session
        holds their owner locks), and this process's rows no call holds; refresh the others,
        returning their tickets.

        A dead process's rows are skipped by verdicts at once, and by a give-back's word
        once a lease old (see `give_back`); until they are cleared, each give-back on their
        line also wakes the process of the first fresh ticket behind them. Those of a
        process without its owner lock are kept for a lease: its ticket connection may have
        broken, and a process that reconnects within it keeps its place (one that comes back
        later takes new tickets, in the order of its calls)."""
        high, low = owner_lock(self.owner_id)
        return sql.SQL(
            "SELECT pg_try_advisory_lock({high}, {low}) WHERE NOT EXISTS (SELECT 1 FROM pg_locks "
            "WHERE locktype = 'advisory' AND objsubid = 2 AND pid = pg_backend_pid() "
            "AND classid = {high_oid} AND objid = {low_oid}); "
            "DELETE FROM {t} WHERE seen < clock_timestamp() - {gone}::interval "
            "OR (seen < clock_timestamp() - {lease}::interval "
            "AND ((owner >> 32) & {low32}, owner & {low32}) NOT IN (SELECT classid::bigint, "
            "objid::bigint FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 "
            "AND granted AND database = {here})); "
            "DELETE FROM {t} WHERE owner = {owner} AND ticket <> ALL({tickets}::bigint[]); "
            "UPDATE {t} SET seen = clock_timestamp() WHERE owner = {owner} RETURNING ticket"
        ).format(
            high=sql.Literal(high),
            low=sql.Literal(low),
            high_oid=sql.Literal(high & _LOW32),
            low_oid=sql.Literal(low & _LOW32),
            t=self.table,
            gone=self.gone,
            lease=self.lease,
            low32=sql.Literal(_LOW32),
            here=sql.SQL(_HERE),
            owner=self.owner,
            tickets=sql.Literal(tickets),
        )
