"""PostgreSQL fair mode: a commit that begins the next ticket's turn of its own process, and
tells its line only what another process needs to hear."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from keyserial import current_fence
from keyserial.postgres import CommitInDoubt, PostgresKeyedQueue, connection, lock_id
from keyserial.postgres._desk import EarlyTurn
from keyserial.postgres._early import Closing
from keyserial.postgres._setup import ensure_sequence, ensure_ticket_table
from keyserial.postgres._sql_text import query
from keyserial.postgres._tickets import TicketSql, new_owner, registration_lock
from keyserial.postgres._turn import PgTurn
from keyserial.postgres._turns import _commit_error  # pyright: ignore[reportPrivateUsage]

from .conftest import Pools
from .fair_lines import (
    behind_a_holder,
    counted,
    ticket_count,
    until_waiting_in_server,
    words_of_a_give_back,
)
from .redis_helpers import until
from .turn_notes import TurnNotes

pytestmark = pytest.mark.asyncio


async def _free(pools: Pools, key: str) -> bool:
    """Whether no transaction holds ``key``'s lock of namespace ``t``."""
    async with (await pools(max_size=1)).connection() as conn:
        await conn.execute("BEGIN")
        cursor = await conn.execute("SELECT pg_try_advisory_xact_lock(%s)", (lock_id("t", key),))
        row = await cursor.fetchone()
        await conn.execute("ROLLBACK")
    return row is not None and bool(row[0])


def _after_a_hand_over(queue: PostgresKeyedQueue, act: Callable[[EarlyTurn], None]) -> None:
    """Run ``act`` on the follower right after the first commit of ``queue`` that begins a
    follower's turn (``EarlyTurns.closed``), once."""
    early = queue._turns.early  # pyright: ignore[reportPrivateUsage]
    closed = early.closed

    def closed_then_act(turn: PgTurn, closing: Closing, results: list[list[Any]]) -> PgTurn | None:
        handed = closed(turn, closing, results)
        follower = closing.follower
        if handed is not None and follower is not None:
            early.closed = closed  # type: ignore[method-assign]
            act(follower)
        return handed

    early.closed = closed_then_act  # type: ignore[method-assign]


async def test_the_next_ticket_of_the_process_begins_in_the_commit_of_the_one_ahead(
    pools: Pools,
) -> None:
    # c0..c3 take their tickets in one round trip behind the holder. c0 begins its turn on
    # its own; each of c1..c3 begins in the commit of the one ahead, on its connection.
    queue = PostgresKeyedQueue(await pools(), namespace="t", fair=True)
    notes = TurnNotes()
    begun = counted(queue._turns.early, "begin")  # pyright: ignore[reportPrivateUsage]
    backends: dict[str, int] = {}

    async def note(name: str) -> None:
        notes.order.append(name)
        cursor = await connection().execute("SELECT pg_backend_pid()")
        row = await cursor.fetchone()
        assert row is not None
        backends[name] = int(row[0])

    assert await behind_a_holder(queue, notes, 4, note) == [None] * 4
    assert notes.order == ["hold", "c0", "c1", "c2", "c3"]
    assert len(begun) == 1, "c1..c3 began their turns on their own"
    assert len(set(backends.values())) == 1
    await queue.aclose()
    assert await _free(pools, "k")


async def test_a_commit_tells_no_one_while_the_next_two_tickets_follow_their_own(
    pools: Pools,
) -> None:
    # c0's and c1's commits have two tickets of their own process next, each following
    # the one ahead: no one waits for a word. c2's and c3's tell their line.
    queue = PostgresKeyedQueue(await pools(), namespace="t", fair=True)
    notes = TurnNotes()
    told = counted(queue._turns.early.desk.sql, "tell")  # pyright: ignore[reportPrivateUsage]
    assert await behind_a_holder(queue, notes, 4) == [None] * 4
    assert notes.order == ["hold", "c0", "c1", "c2", "c3"]
    assert len(told) == 2
    await queue.aclose()


async def test_a_commit_tells_its_own_process_in_its_rows_not_by_notification(
    postgres_dsn: str,
) -> None:
    # Tickets 100 (a, given back), 101 (a) and 102 (b) wait on one key: b is notified, and
    # a's share, that 101 and 102 are next, comes back as the tell's rows.
    heard, rows = await words_of_a_give_back(postgres_dsn, "aab")
    key = lock_id("t", "k")
    assert heard == {"a": [], "b": [f"{key}:102"]}
    assert [(row[0], row[1], row[3]) for row in rows] == [(key, 102, True), (key, 102, False)]


@pytest.mark.parametrize("setting", ["lock_timeout", "statement_timeout"])
async def test_a_ticket_s_commit_waits_for_its_line_whatever_timeout_the_function_set(
    pools: Pools, setting: str
) -> None:
    # c0 waits with a ticket; its function writes, then sets a tiny timeout for the rest of
    # its transaction. Its commit must take its line's registration lock to tell the line,
    # and another transaction holds that lock for now: the commit waits for it rather than
    # fail on the function's timeout, and the write is kept.
    queue = PostgresKeyedQueue(await pools(), namespace="t", fair=True)
    watcher = await pools(max_size=2)
    notes = TurnNotes()
    async with watcher.connection() as conn:
        await conn.execute("CREATE TABLE written (name text)")

    async def impatient() -> None:
        await connection().execute("INSERT INTO written VALUES ('c0')")
        await connection().execute("SELECT set_config(%s, '1ms', true)", (setting,))

    holder = asyncio.create_task(queue.run("k", notes.hold))
    await notes.until_holding()
    call = asyncio.create_task(queue.run("k", impatient))
    desk = queue._turns.early.desk  # pyright: ignore[reportPrivateUsage]
    await until(lambda: desk.connection is not None and not desk.unregistered, "registered")
    async with watcher.connection() as line:
        await line.execute(
            "SELECT pg_advisory_xact_lock(%s)", (registration_lock(lock_id("t", "k")),)
        )
        notes.release.set()
        await until_waiting_in_server(watcher, 1)  # the commit, for the registration lock
        await line.commit()
    await asyncio.wait_for(asyncio.gather(holder, call), 10)
    async with watcher.connection() as conn:
        cursor = await conn.execute("SELECT name FROM written")
        assert await cursor.fetchall() == [("c0",)]
    await queue.aclose()


async def test_a_turn_handed_over_but_never_taken_up_is_rolled_back(pools: Pools) -> None:
    # c0's commit begins c1's turn, but c1's begin task ends (cancelled) before it takes
    # the turn up: that transaction is rolled back and its connection goes back to the
    # pool; c2 runs.
    pool = await pools()
    queue = PostgresKeyedQueue(pool, namespace="t", fair=True)
    notes = TurnNotes()

    def cancel(follower: EarlyTurn) -> None:
        assert follower.begin is not None
        follower.begin.cancel()

    _after_a_hand_over(queue, cancel)
    done = await behind_a_holder(queue, notes, 3)
    assert isinstance(done[1], asyncio.CancelledError)
    assert notes.order == ["hold", "c0", "c2"]
    await queue.aclose()
    assert await _free(pools, "k")
    stats = pool.get_stats()
    assert stats["pool_available"] == stats["pool_size"], stats


async def test_a_hand_over_whose_key_another_transaction_took_begins_the_turn_on_its_own(
    pools: Pools,
) -> None:
    # A transaction of another process waits in the server's queue for the key (a turn
    # that reached it before c1 registered). c0's commit lets it have the key: c1's turn,
    # tried in that commit, is not taken; c0's call returns at once, and c1 runs once the
    # other transaction ends.
    watcher = await pools(max_size=1)
    pool = await pools()
    queue = PostgresKeyedQueue(pool, namespace="t", fair=True)
    notes = TurnNotes()
    gate = asyncio.Event()

    async def gated(name: str) -> None:
        notes.order.append(name)
        await gate.wait()

    holder = asyncio.create_task(queue.run("k", notes.hold))
    await notes.until_holding()
    first = asyncio.create_task(queue.run("k", gated, "c0"))
    second = asyncio.create_task(queue.run("k", notes.note, "c1"))
    await until_waiting_in_server(watcher, 1)  # c0's transaction
    notes.release.set()
    await until(lambda: notes.order == ["hold", "c0"], "c0 starts")
    async with (await pools(max_size=1)).connection() as other:
        await other.execute("BEGIN")
        waiting = asyncio.create_task(
            other.execute("SELECT pg_advisory_xact_lock(%s)", (lock_id("t", "k"),))
        )
        await until_waiting_in_server(watcher, 1)
        gate.set()
        await asyncio.wait_for(first, 10)  # c0's commit did not wait for the key
        await waiting
        await until_waiting_in_server(watcher, 1)  # c1's transaction, begun on its own
        assert notes.order == ["hold", "c0"]
        await other.execute("COMMIT")
    await asyncio.wait_for(asyncio.gather(holder, second), 10)
    assert notes.order == ["hold", "c0", "c1"]
    await queue.aclose()
    stats = pool.get_stats()
    assert stats["pool_available"] == stats["pool_size"], stats


async def test_a_session_ended_after_a_commit_that_began_the_next_turn_leaves_it_in_doubt() -> None:
    # The part of the query after COMMIT fails only when the server ends the session, which
    # may have come after the COMMIT: the writes may or may not have been kept.
    ended = psycopg.errors.AdminShutdown("terminating connection due to administrator command")
    assert isinstance(_commit_error(ended, None, True), CommitInDoubt)
    assert not isinstance(_commit_error(ended, None, False), CommitInDoubt)


async def test_a_batch_asks_the_verdict_of_the_first_ticket_of_each_run_only(
    postgres_dsn: str,
) -> None:
    # Three tickets of one process on one key: the batch that registered them asks the
    # first one's verdict; the two that follow it get none (they follow the one ahead).
    owner = new_owner()
    key = lock_id("t", "k")
    tickets = TicketSql("fences", None, 10.0, owner)
    async with await psycopg.AsyncConnection.connect(postgres_dsn, autocommit=True) as conn:
        await ensure_sequence(conn, "fences", None)
        await ensure_ticket_table(conn, "fences", None)
        await conn.execute(query([tickets.register([key])] * 3))
        await conn.execute(tickets.prepare())
        cursor = await conn.execute(query([tickets.new_verdicts(3, [1])]))
        verdicts = [row[1] for row in await cursor.fetchall()]
    assert verdicts == ["go", None, None]


async def test_a_ticket_whose_run_ended_before_its_batch_came_back_is_asked_its_verdict(
    pools: Pools,
) -> None:
    # c0 and c1 register in one batch; c0's call is cancelled while the batch is on its way,
    # so c1 follows no one: its verdict, not asked in that batch, is asked next, and it runs.
    queue = PostgresKeyedQueue(await pools(), namespace="t", fair=True)
    notes = TurnNotes()
    desk = queue._turns.early.desk  # pyright: ignore[reportPrivateUsage]
    new_verdicts = desk.sql.new_verdicts
    calls: list[asyncio.Task[None]] = []

    def cancelling(count: int, asked: list[int]) -> str:
        if count == 2:
            calls[0].cancel()  # delivered while the batch is on its way
        return new_verdicts(count, asked)

    desk.sql.new_verdicts = cancelling  # type: ignore[method-assign]
    holder = asyncio.create_task(queue.run("k", notes.hold))
    await notes.until_holding()
    calls += [asyncio.create_task(queue.run("k", notes.note, f"c{n}")) for n in range(2)]
    await until(lambda: calls[0].done(), "c0 is cancelled")
    notes.release.set()
    done = await asyncio.wait_for(asyncio.gather(holder, *calls, return_exceptions=True), 10)
    assert isinstance(done[1], asyncio.CancelledError)
    assert notes.order == ["hold", "c1"]
    await queue.aclose()


async def test_fair_turns_work_with_names_that_need_quoting(pools: Pools) -> None:
    # The statements a turn sends each time are put together as text: a table and a schema
    # whose names hold quotes, spaces and non-ASCII letters are quoted there too.
    pool = await pools()
    async with pool.connection() as conn:
        await conn.execute('CREATE SCHEMA IF NOT EXISTS "odd ""s"" ü"')
    queue = PostgresKeyedQueue(
        pool, namespace="t", table='it\'s "fé"', schema='odd "s" ü', fair=True
    )
    notes = TurnNotes()
    assert await behind_a_holder(queue, notes, 3) == [None] * 3
    assert notes.order == ["hold", "c0", "c1", "c2"]
    await queue.aclose()


@pytest.mark.parametrize("schema", ["public", None])
async def test_a_function_that_points_search_path_elsewhere_leaves_the_commit_working(
    pools: Pools, schema: str | None
) -> None:
    # A ticket's commit gives the ticket back after the function's statements, which here
    # point search_path at a schema without the ticket table (as schema-per-tenant
    # applications do): the commit names the table in full, whether the queue was made with
    # schema= or found the table on the search path.
    pool = await pools()
    async with pool.connection() as conn:
        await conn.execute("CREATE SCHEMA tenant")
    queue = PostgresKeyedQueue(pool, namespace="t", schema=schema, fair=True)
    notes = TurnNotes()

    async def elsewhere(name: str) -> None:
        notes.order.append(name)
        await connection().execute("SET LOCAL search_path TO tenant")

    assert await behind_a_holder(queue, notes, 3, elsewhere) == [None] * 3
    assert notes.order == ["hold", "c0", "c1", "c2"]
    await queue.aclose()
    assert await ticket_count(pool) == 0


async def test_turns_that_followed_each_other_leave_nothing_behind(pools: Pools) -> None:
    # Each turn of a run notes the one behind it and the one ahead: once the calls ended,
    # nothing of them is left, without waiting for the garbage collector's cycle search.
    queue = PostgresKeyedQueue(await pools(), namespace="t", fair=True)

    async def work() -> None:
        pass

    gc.collect()  # what earlier tests left
    gc.disable()
    try:
        for _ in range(3):
            await asyncio.wait_for(asyncio.gather(*(queue.run("k", work) for _ in range(8))), 10)
        await queue.aclose()
        left = [o for o in gc.get_objects() if isinstance(o, EarlyTurn)]
    finally:
        gc.enable()
    assert left == []


async def test_a_turn_handed_over_in_a_process_that_then_stops_past_the_lease_begins_again(
    pools: Pools,
) -> None:
    # The process stops right after c0's commit began c1's turn, for longer than the lease:
    # the server ends c1's idle session. c1's function does not start on it; c1 begins its
    # turn again, with no error, and writes with a later fence.
    lease = 0.3
    pool = await pools()
    queue = PostgresKeyedQueue(pool, namespace="t", lease=lease, fair=True)
    notes = TurnNotes()
    fences: list[int | None] = []

    async def note(name: str) -> None:
        notes.order.append(name)
        fences.append(current_fence())
        await connection().execute("SELECT 1")  # a statement on the turn's session

    # The process stops, its loop with it.
    _after_a_hand_over(queue, lambda _: time.sleep(3 * lease))
    assert await behind_a_holder(queue, notes, 3, note) == [None] * 3
    assert notes.order == ["hold", "c0", "c1", "c2"]
    drawn = [fence for fence in fences if fence is not None]
    assert len(drawn) == 3 and drawn == sorted(set(drawn))  # each later than the one before
    await queue.aclose()

    def all_back() -> bool:
        stats = pool.get_stats()
        return stats["pool_available"] == stats["pool_size"]

    # The pool replaces c1's ended session in the background: the new connection counts in
    # its size while it is being opened.
    await until(all_back, "every connection is back in the pool")
