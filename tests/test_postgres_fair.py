"""Fair mode's own promises on PostgreSQL: a waiting call holds a ticket, not a connection
(but a process's first call on a key, which waits in the server as in the default mode);
turns follow the order of the calls across processes whatever the pool size; a call that
gives up leaves no ticket behind, and an idle process keeps no connection for its tickets."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from keyserial import current_fence
from keyserial.postgres import PostgresKeyedQueue, lock_id
from keyserial.postgres._setup import ensure_sequence, ensure_ticket_table
from keyserial.postgres._sql_text import query
from keyserial.postgres._tickets import TicketSql, new_owner, owner_lock, ticket_lock

from .conftest import Pools
from .fair_lines import ticket_count, until_tickets
from .postgres_server import private_database
from .redis_helpers import until
from .turn_notes import TurnNotes

pytestmark = pytest.mark.asyncio


async def _connections(pool: AsyncConnectionPool[Any]) -> int:
    """Server connections to the test's database, but the one asking."""
    async with pool.connection() as conn:
        cursor = await conn.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        row = await cursor.fetchone()
        return 0 if row is None else int(row[0])


@pytest.mark.parametrize("pool_size", [2, 6])
async def test_twenty_waiting_calls_of_four_processes_hold_tickets_and_run_in_call_order(
    pools: Pools, pool_size: int
) -> None:
    # Four processes' queues (a pool each), twenty calls waiting on one held key. The pools
    # start with no connection: a process's first call takes a ticket too, rather than wait
    # for a connection without one. Each waiting call holds a ticket, not a connection: the
    # pool's size does not matter, and the server sees a connection per process for its
    # tickets, the holder's and the next call's, whether the pools are smaller than the
    # waiting calls or not.
    watcher = await pools(max_size=1)
    processes = [await pools(min_size=0, max_size=pool_size) for _ in range(4)]
    queues = [PostgresKeyedQueue(pool, namespace="t", fair=True) for pool in processes]
    release = asyncio.Event()
    order: list[int] = []
    fences: list[int | None] = []

    async def hold() -> None:
        await release.wait()

    async def note(call: int) -> None:
        order.append(call)
        fences.append(current_fence())  # drawn once the server granted the turn

    holder = asyncio.create_task(queues[0].run("k", hold))
    await until_tickets(watcher, 1)
    calls = []
    for call in range(20):  # round robin over the processes, each registered before the next
        calls.append(asyncio.create_task(queues[call % 4].run("k", note, call)))
        await until_tickets(watcher, call + 2)
    # Settle: the next call's transaction waits in the server behind the holder's.
    await asyncio.sleep(0.2)
    peak = await _connections(watcher)
    pooled = sum(pool.get_stats()["pool_size"] for pool in processes)
    # Four ticket connections, the holder's and the next call's: six in all.
    assert peak <= 6, f"{peak} server connections for 20 waiting calls"
    assert pooled <= 2, f"the pools opened {pooled} connections"
    release.set()
    await asyncio.wait_for(asyncio.gather(holder, *calls), 20)
    assert order == list(range(20)), list(zip(order, fences, strict=True))
    for queue in queues:
        await queue.aclose()
    assert await ticket_count(watcher) == 0, "a ticket outlived its call"


@pytest.mark.parametrize("how", ["cancelled", "timed out"])
async def test_a_call_that_gives_up_leaves_no_ticket_and_no_gap(pools: Pools, how: str) -> None:
    first, second, watcher = await pools(), await pools(), await pools()
    a = PostgresKeyedQueue(first, namespace="t", lease=10.0, fair=True)
    b = PostgresKeyedQueue(second, namespace="t", lease=10.0, fair=True)
    notes = TurnNotes()

    holder = asyncio.create_task(a.run("k", notes.hold))  # direct: no ticket
    await notes.until_holding()
    if how == "cancelled":
        gives_up = asyncio.create_task(a.run("k", notes.note, "gave up"))
    else:
        gives_up = asyncio.create_task(a.with_options(timeout=0.5).run("k", notes.note, "gave up"))
    await until_tickets(watcher, 1)
    later = asyncio.create_task(b.run("k", notes.note, "b"))
    await until_tickets(watcher, 2)
    if how == "cancelled":
        gives_up.cancel()
    with pytest.raises(asyncio.CancelledError if how == "cancelled" else TimeoutError):
        await gives_up
    await until_tickets(watcher, 1)  # its ticket was given back
    notes.release.set()
    # A ticket or transaction left behind would hold the line until its lease (10 s).
    await asyncio.wait_for(asyncio.gather(holder, later), 5)
    assert notes.order == ["hold", "b"]
    for pool in (first, second):
        stats = pool.get_stats()
        assert stats["pool_size"] == stats["pool_available"], "a connection was not given back"
    await a.aclose()
    await b.aclose()
    assert await ticket_count(watcher) == 0


async def test_an_idle_process_closes_the_connection_of_its_tickets(pools: Pools) -> None:
    pool, watcher = await pools(min_size=1, max_size=2), await pools(max_size=1)
    queue = PostgresKeyedQueue(pool, namespace="t", lease=1.0, fair=True)

    async def work() -> None:
        return None

    async def until_connections(count: int) -> None:
        # The server's backend of a closed connection ends a moment after the client's close.
        for _ in range(1000):
            if await _connections(watcher) == count:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"never {count} connections")

    async def two_calls() -> None:  # the second takes a ticket
        await asyncio.gather(queue.run("k", work), queue.run("k", work))

    def pooled() -> int:
        return pool.get_stats()["pool_size"]

    desk = queue._turns.early.desk  # pyright: ignore[reportPrivateUsage]
    await queue.run("k", work)
    assert desk.connection is None, "a lone call takes no ticket"
    await two_calls()
    assert desk.connection is not None, "the ticket connection is kept a while"
    # Closed a lease after the last ticket was given back; the pool's connections are left.
    await until(lambda: desk.connection is None, "the ticket connection closes")
    await until_connections(pooled())
    await two_calls()  # and opened again for the next ticket
    assert desk.connection is not None
    await queue.aclose()
    assert desk.connection is None and desk.task is not None and desk.task.done()
    await until_connections(pooled())


async def test_tickets_lost_while_waiting_are_taken_again_in_call_order(pools: Pools) -> None:
    # A process stopped for three leases finds its waiting tickets cleared by the others'
    # heartbeat: its calls take new ones, in their order, behind the calls made meanwhile.
    first, second, watcher = await pools(), await pools(), await pools()
    a = PostgresKeyedQueue(first, namespace="t", lease=0.3, fair=True)
    b = PostgresKeyedQueue(second, namespace="t", lease=0.3, fair=True)
    notes = TurnNotes()

    holder = asyncio.create_task(a.run("k", notes.hold))  # direct: no ticket
    await notes.until_holding()
    calls = [asyncio.create_task(a.run("k", notes.note, "a0"))]  # the next: in the server's queue
    await until_tickets(watcher, 1)
    calls.append(asyncio.create_task(b.run("k", notes.note, "b0")))  # finds a0's: a ticket
    await until_tickets(watcher, 2)
    calls += [asyncio.create_task(a.run("k", notes.note, name)) for name in ("a1", "a2")]
    await until_tickets(watcher, 4)
    # a's next heartbeat, which finds its tickets gone, waits until b1 has registered. The
    # tickets go once a's desk waits in it: a heartbeat already on its way would find them
    # gone, and a1 and a2 would register again before b1.
    beat_again, holding = asyncio.Event(), asyncio.Event()
    heartbeat = a._turns.early.desk._heartbeat  # pyright: ignore[reportPrivateUsage]

    async def held_heartbeat(connection: Any) -> None:
        holding.set()
        await beat_again.wait()
        await heartbeat(connection)

    a._turns.early.desk._heartbeat = held_heartbeat  # type: ignore[method-assign]
    await asyncio.wait_for(holding.wait(), 10)
    async with watcher.connection() as conn:  # what another process's heartbeat does
        await conn.execute(
            "DELETE FROM keyserial_fences_tq WHERE ticket IN "
            "(SELECT ticket FROM keyserial_fences_tq ORDER BY ticket DESC LIMIT 2)"
        )
    calls.append(asyncio.create_task(b.run("k", notes.note, "b1")))
    await until_tickets(watcher, 3)
    beat_again.set()
    await until_tickets(watcher, 5)  # a1's and a2's again
    notes.release.set()
    await asyncio.wait_for(asyncio.gather(holder, *calls), 10)
    assert notes.order == ["hold", "a0", "b0", "b1", "a1", "a2"]
    await a.aclose()
    await b.aclose()
    assert await ticket_count(watcher) == 0


async def test_a_verdict_reads_the_locks_of_its_own_database_only(postgres_dsn: str) -> None:
    # Ticket 100 is ahead of ticket 101 and its transaction is not in this database's lock
    # queue: 101 must wait ("soon"). A transaction of another database on the same server
    # holds the same ticket's try-lock and the same key's lock: pg_locks shows it too, and
    # read without its database it would have let 101 go past 100.
    owner_a, owner_b = new_owner(), new_owner()
    key = lock_id("t", "k")
    with private_database() as elsewhere_dsn:
        async with (
            await psycopg.AsyncConnection.connect(postgres_dsn, autocommit=True) as a,
            await psycopg.AsyncConnection.connect(postgres_dsn, autocommit=True) as b,
            await psycopg.AsyncConnection.connect(elsewhere_dsn, autocommit=True) as elsewhere,
        ):
            await ensure_sequence(a, "fences", None)
            await ensure_ticket_table(a, "fences", None)
            for conn, owner in ((a, owner_a), (b, owner_b)):  # each process's desk session
                await conn.execute("SELECT pg_try_advisory_lock(%s, %s)", owner_lock(owner))
            await a.execute(
                "INSERT INTO fences_tq VALUES (%s, 100, %s, now()), (%s, 101, %s, now())",
                (key, owner_a, key, owner_b),
            )
            tickets = TicketSql("fences", None, 10.0, owner_b)
            await b.execute(tickets.prepare())
            await elsewhere.execute("BEGIN")
            await elsewhere.execute("SELECT pg_try_advisory_xact_lock(%s, %s)", ticket_lock(100))
            await elsewhere.execute("SELECT pg_advisory_xact_lock(%s)", (key,))
            cursor = await b.execute(query([tickets.verdicts([101])]))
            assert await cursor.fetchall() == [(101, "soon")]
            await elsewhere.execute("ROLLBACK")


async def test_a_heartbeat_clears_the_tickets_of_a_process_dead_for_a_lease(
    postgres_dsn: str,
) -> None:
    # Process d was killed while its calls 100 and 101 waited, a lease and a half ago: its
    # desk's session, and with it its owner lock, are gone, but the rows are younger than
    # three leases. Verdicts skip them; a give-back's word, which names the first tickets
    # of the line, would name them and reach no one. The next heartbeat of any process
    # clears them. Process e's desk lost its connection just now: its row stays for a lease
    # (it may reconnect); a's, alive but stopped for a lease and a half, stays too, and so
    # does the beating process's own.
    owner_a, owner_d, owner_e, owner_m = new_owner(), new_owner(), new_owner(), new_owner()
    key = lock_id("t", "k")
    connect = psycopg.AsyncConnection.connect
    async with (
        await connect(postgres_dsn, autocommit=True) as a,
        await connect(postgres_dsn, autocommit=True) as m,
    ):
        await ensure_sequence(a, "fences", None)
        await ensure_ticket_table(a, "fences", None)
        await a.execute("SELECT pg_advisory_lock(%s, %s)", owner_lock(owner_a))
        await a.execute(
            "INSERT INTO fences_tq SELECT %s, t, o, now() - s * interval '1 second' "
            "FROM unnest(%s::bigint[], %s::bigint[], %s::float8[]) AS r(t, o, s)",
            (
                key,
                [100, 101, 102, 103, 104],
                [owner_d, owner_d, owner_e, owner_a, owner_m],
                [15.0, 15.0, 0.0, 15.0, 0.0],
            ),
        )
        await m.execute(TicketSql("fences", None, 10.0, owner_m).heartbeat([104]))
        cursor = await m.execute("SELECT ticket FROM fences_tq ORDER BY ticket")
        assert [row[0] for row in await cursor.fetchall()] == [102, 103, 104]


async def test_the_ticket_connection_takes_its_owner_lock_once_an_old_session_lets_go(
    pools: Pools, postgres_dsn: str
) -> None:
    # An earlier session of the process (one the server has not ended yet, after the
    # ticket connection broke) still holds the owner lock when the new one begins: the new
    # session takes it at its next heartbeat, or the process's tickets would look dead.
    pool = await pools()
    queue = PostgresKeyedQueue(pool, namespace="t", lease=0.3, fair=True)
    desk = queue._turns.early.desk  # pyright: ignore[reportPrivateUsage]
    high, low = owner_lock(desk.owner)
    release = asyncio.Event()

    async def hold() -> None:
        await release.wait()

    async def work() -> None:
        return None

    async with await psycopg.AsyncConnection.connect(postgres_dsn, autocommit=True) as old:
        await old.execute("SELECT pg_advisory_lock(%s, %s)", (high, low))
        holder = asyncio.create_task(queue.run("k", hold))
        after = asyncio.create_task(queue.run("k", work))  # takes a ticket
        await until(lambda: desk.connection is not None, "the ticket connection opens")
        assert desk.connection is not None
        pid = desk.connection.info.backend_pid
        await old.execute("SELECT pg_advisory_unlock(%s, %s)", (high, low))
        held = False
        for _ in range(400):
            cursor = await old.execute(
                "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 "
                "AND pid = %s AND classid = %s AND objid = %s",
                (pid, high & 0xFFFFFFFF, low & 0xFFFFFFFF),
            )
            if held := bool(await cursor.fetchall()):
                break
            await asyncio.sleep(0.01)
    release.set()
    await asyncio.gather(holder, after)
    await queue.aclose()
    assert held, "the ticket connection never took its owner lock"


def _scanned_whole(plan: Any, table: str) -> list[str]:
    """The node types of ``plan`` (EXPLAIN's JSON) that read every row of ``table``."""
    found: list[str] = []
    nodes = [plan]
    while nodes:
        node = nodes.pop()
        if isinstance(node, list):
            nodes.extend(node)  # pyright: ignore[reportUnknownArgumentType]
        elif isinstance(node, dict):
            if node.get("Node Type") == "Seq Scan" and node.get("Relation Name") == table:
                found.append("Seq Scan")
            nodes.extend(node.values())  # pyright: ignore[reportUnknownArgumentType]
    return found


async def test_a_process_finds_its_own_tickets_without_reading_every_waiting_calls(
    postgres_dsn: str,
) -> None:
    # Five thousand calls of another process wait on other keys. This process's verdicts,
    # the tickets it gives back and its heartbeat find its own rows through an index: a
    # statement that read every ticket would make each turn cost more the more calls wait
    # anywhere in the queue.
    owner = new_owner()
    key = lock_id("t", "k")
    async with await psycopg.AsyncConnection.connect(postgres_dsn, autocommit=True) as conn:
        await ensure_sequence(conn, "fences", None)
        await ensure_ticket_table(conn, "fences", None)
        await conn.execute(
            "INSERT INTO fences_tq SELECT g, g, %s, now() FROM generate_series(1, 5000) g",
            (new_owner(),),
        )
        await conn.execute("INSERT INTO fences_tq VALUES (%s, 5001, %s, now())", (key, owner))
        await conn.execute("ANALYZE fences_tq")
        tickets = TicketSql("fences", None, 10.0, owner)
        await conn.execute(tickets.prepare())
        statements = [
            tickets.verdicts([5001]),
            tickets.new_verdicts(1, [1]),
            *tickets.give_back([5001], [key]),
            *(
                statement
                for statement in tickets.heartbeat([5001]).as_string(conn).split("; ")
                if "owner = " in statement
            ),
        ]
        assert len(statements) == 7
        for statement in statements:
            explain = sql.SQL("EXPLAIN (FORMAT JSON) " + statement)  # pyright: ignore[reportArgumentType]
            cursor = await conn.execute(explain)
            row = await cursor.fetchone()
            assert row is not None
            assert _scanned_whole(row[0], "fences_tq") == [], statement


async def test_a_ticket_table_made_without_its_owner_index_gets_it_on_first_use(
    postgres_dsn: str,
) -> None:
    # A ticket table made by an earlier version has no index by owner: the first fair
    # queue of a role that may add it does.
    async with await psycopg.AsyncConnection.connect(postgres_dsn, autocommit=True) as conn:
        await conn.execute(
            "CREATE UNLOGGED TABLE fences_tq (lock bigint NOT NULL, ticket bigint NOT NULL, "
            "owner bigint NOT NULL, seen timestamptz NOT NULL, PRIMARY KEY (lock, ticket))"
        )
        await ensure_ticket_table(conn, "fences", None)
        cursor = await conn.execute(
            "SELECT indexdef FROM pg_indexes WHERE tablename = 'fences_tq' "
            "AND indexname = 'fences_tqo'"
        )
        assert await cursor.fetchall() == [
            ("CREATE INDEX fences_tqo ON public.fences_tq USING btree (owner, ticket)",)
        ]
