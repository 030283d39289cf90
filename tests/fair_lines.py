"""What a test of PostgreSQL fair mode reads of a key's line (the calls holding tickets, the
transactions waiting in the server's queue, what a give-back tells), and how it lines calls
up behind a holder."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from keyserial.postgres import PostgresKeyedQueue, lock_id
from keyserial.postgres._setup import ensure_sequence, ensure_ticket_table
from keyserial.postgres._sql_text import every_result, query
from keyserial.postgres._tickets import TicketSql, new_owner

from .redis_helpers import until
from .turn_notes import TurnNotes


async def _count(cursor: psycopg.AsyncCursor[Any]) -> int:
    """The number the ``SELECT count(...)`` that gave ``cursor`` counted."""
    row = await cursor.fetchone()
    return 0 if row is None else int(row[0])


async def ticket_count(pool: AsyncConnectionPool[Any]) -> int:
    """How many calls hold a ticket (rows of distinct tickets in the ticket table)."""
    async with pool.connection() as conn:
        cursor = await conn.execute("SELECT to_regclass('keyserial_fences_tq') IS NOT NULL")
        if not (await cursor.fetchall())[0][0]:
            return 0  # made by the first call's process, maybe not yet
        return await _count(
            await conn.execute("SELECT count(DISTINCT ticket) FROM keyserial_fences_tq")
        )


async def waiting_in_server(pool: AsyncConnectionPool[Any]) -> int:
    """Transactions of the test's database waiting in the server's queue for a key's lock."""
    async with pool.connection() as conn:
        return await _count(
            await conn.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 "
                "AND NOT granted "
                "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            )
        )


async def _until(
    pool: AsyncConnectionPool[Any],
    ask: Callable[[AsyncConnectionPool[Any]], Awaitable[int]],
    count: int,
    what: str,
) -> None:
    for _ in range(2000):
        if await ask(pool) == count:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never {count} {what}")


async def until_tickets(pool: AsyncConnectionPool[Any], count: int) -> None:
    """Wait until ``count`` calls hold tickets; fail after ten seconds."""
    await _until(pool, ticket_count, count, "tickets in the ticket table")


async def until_waiting_in_server(pool: AsyncConnectionPool[Any], count: int) -> None:
    """Wait until ``count`` transactions wait in the server's queue; fail after ten seconds."""
    await _until(pool, waiting_in_server, count, "transactions waiting in the server's queue")


async def _lock_waits_older_than(pool: AsyncConnectionPool[Any], seconds: float) -> int:
    """Statements of the test's database that have waited for a lock for longer than
    ``seconds`` (the server's clock)."""
    async with pool.connection() as conn:
        return await _count(
            await conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' "
                "AND clock_timestamp() - query_start > make_interval(secs => %s)",
                (seconds,),
            )
        )


async def until_a_lock_wait_older_than(pool: AsyncConnectionPool[Any], seconds: float) -> None:
    """Wait until one statement has waited for a lock for longer than ``seconds``; fail
    after ten seconds."""
    ask = functools.partial(_lock_waits_older_than, seconds=seconds)
    await _until(pool, ask, 1, f"statements waiting for a lock for over {seconds} s")


async def words_of_a_give_back(
    postgres_dsn: str, line: str, stopped: str = ""
) -> tuple[dict[str, list[str]], list[tuple[Any, ...]]]:
    """Tickets 100, 101, ... of the processes named by ``line``'s letters (``"aab"``: two of
    ``a``, then one of ``b``) wait on one key; the first one's process gives ticket 100 back
    in a transaction, as its commit does. What each process's channel heard, and the rows of
    the tell (its own share). The processes named in ``stopped`` last beat their heartbeats
    a lease and a half ago: their tickets are no longer live."""
    heard, rows = await words_of_give_backs(postgres_dsn, line, [0], stopped)
    return heard, rows[0]


async def words_of_give_backs(
    postgres_dsn: str, line: str, givers: list[int], stopped: str = ""
) -> tuple[dict[str, list[str]], list[list[tuple[Any, ...]]]]:
    """As `words_of_a_give_back`, with the tickets at the places ``givers`` of ``line`` (from
    0) given back by their processes at once: each giver sends its statements before any
    giver commits, and is left waiting if they wait for a lock an earlier giver holds; then
    the givers commit, in order. What each process's channel heard, and each tell's rows."""
    owners = {name: new_owner() for name in sorted(set(line))}
    key = lock_id("t", "k")
    tickets = {name: TicketSql("fences", None, 10.0, owner) for name, owner in owners.items()}
    connect = functools.partial(psycopg.AsyncConnection.connect, postgres_dsn, autocommit=True)
    async with await connect() as setup:
        await ensure_sequence(setup, "fences", None)
        await ensure_ticket_table(setup, "fences", None)
        await setup.execute(
            "INSERT INTO fences_tq SELECT %s, 99 + n, owner, now() - age * interval '1 second' "
            "FROM unnest(%s::bigint[], %s::float8[]) WITH ORDINALITY AS o(owner, age, n)",
            (key, [owners[name] for name in line], [15.0 if n in stopped else 0.0 for n in line]),
        )
    listeners = {name: await connect() for name in owners}  # each process's desk
    giving = [await connect() for _ in givers]  # each giver's connection for its commit
    try:
        for name, listener in listeners.items():
            channel = sql.Identifier(tickets[name].channel)
            await listener.execute(sql.SQL("LISTEN {}").format(channel))
        sent: list[asyncio.Task[list[tuple[Any, ...]]]] = []
        for place, giver in zip(givers, giving, strict=True):
            await giver.execute("BEGIN")
            statements = tickets[line[place]].give_back([100 + place], [key])
            sent.append(asyncio.create_task(_told(giver, query(statements))))
            await _sent_or_waiting(postgres_dsn, sent[-1], giver)
        rows: list[list[tuple[Any, ...]]] = []
        for giver, sending in zip(giving, sent, strict=True):
            rows.append(await asyncio.wait_for(sending, 10))
            await giver.execute("COMMIT")
        heard: dict[str, list[str]] = {}
        for name, listener in listeners.items():
            heard[name] = [n.payload async for n in listener.notifies(timeout=0.5)]
    finally:
        for connection in [*listeners.values(), *giving]:
            await connection.close()
    return heard, rows


async def _told(connection: psycopg.AsyncConnection[Any], statements: sql.SQL) -> list[Any]:
    """Send the statements of a give-back; the rows of its tell (the next-to-last)."""
    return (await every_result(await connection.execute(statements)))[-2]


async def _sent_or_waiting(
    postgres_dsn: str, sending: asyncio.Task[Any], giver: psycopg.AsyncConnection[Any]
) -> None:
    """Wait until ``sending`` is done, or ``giver``'s session waits for a lock."""
    pid = giver.info.backend_pid
    async with await psycopg.AsyncConnection.connect(postgres_dsn, autocommit=True) as watcher:
        for _ in range(2000):
            if sending.done():
                return
            cursor = await watcher.execute(
                "SELECT 1 FROM pg_locks WHERE pid = %s AND NOT granted", (pid,)
            )
            if await cursor.fetchone() is not None:
                return
            await asyncio.sleep(0.005)
    raise AssertionError("a give-back neither ended nor waited for a lock")


def counted(target: object, name: str) -> list[int]:
    """Count the calls of ``target``'s method ``name`` (one entry per call)."""
    original = getattr(target, name)
    calls: list[int] = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    setattr(target, name, counting)
    return calls


async def behind_a_holder(
    queue: PostgresKeyedQueue,
    notes: TurnNotes,
    count: int,
    note: Callable[[str], Awaitable[None]] | None = None,
) -> list[BaseException | None]:
    """Hold ``k`` with a call of ``queue``, make ``count`` calls on it, ``c0`` on (their
    tickets are registered in one round trip), then let the holder go: the calls' outcomes
    (None, or what they raised)."""
    holder = asyncio.create_task(queue.run("k", notes.hold))
    await notes.until_holding()
    noting = notes.note if note is None else note
    calls = [asyncio.create_task(queue.run("k", noting, f"c{n}")) for n in range(count)]
    desk = queue._turns.early.desk  # pyright: ignore[reportPrivateUsage]
    await until(lambda: desk.connection is not None and not desk.unregistered, "registered")
    notes.release.set()
    done = await asyncio.wait_for(asyncio.gather(holder, *calls, return_exceptions=True), 10)
    return done[1:]
