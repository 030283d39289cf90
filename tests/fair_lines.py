"""What a test of PostgreSQL fair mode reads of a key's line: the calls holding tickets, and
the transactions waiting in the server's queue."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from psycopg_pool import AsyncConnectionPool


async def ticket_count(pool: AsyncConnectionPool[Any]) -> int:
    """How many calls hold a ticket (rows of distinct tickets in the ticket table)."""
    async with pool.connection() as conn:
        cursor = await conn.execute("SELECT to_regclass('keyserial_fences_tq') IS NOT NULL")
        if not (await cursor.fetchall())[0][0]:
            return 0  # made by the first call's process, maybe not yet
        cursor = await conn.execute("SELECT count(DISTINCT ticket) FROM keyserial_fences_tq")
        row = await cursor.fetchone()
        return 0 if row is None else int(row[0])


async def waiting_in_server(pool: AsyncConnectionPool[Any]) -> int:
    """Transactions of the test's database waiting in the server's queue for a key's lock."""
    async with pool.connection() as conn:
        cursor = await conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 "
            "AND NOT granted "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
        row = await cursor.fetchone()
        return 0 if row is None else int(row[0])


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
