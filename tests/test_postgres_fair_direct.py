"""Fair mode's shortcuts on PostgreSQL: a process's only call on a key waits in the server's
queue without a ticket, as in the default mode; its later calls take tickets, and so does any
call that finds another process's ticket waiting, without ever overtaking the calls of its
own process made before it. A commit wakes only the processes it concerns, and tickets a
process registered together follow each other without asking the server again."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Mapping

import pytest

from keyserial.postgres import PostgresKeyedQueue, lock_id
from keyserial.postgres._desk import EarlyTurn, _batch  # pyright: ignore[reportPrivateUsage]
from keyserial.postgres._tickets import TicketSql, new_owner
from keyserial.postgres._turn import PgTurn

from .conftest import Pools
from .fair_lines import (
    behind_a_holder,
    counted,
    ticket_count,
    until_tickets,
    until_waiting_in_server,
    waiting_in_server,
    words_of_a_give_back,
    words_of_give_backs,
)
from .redis_helpers import until
from .turn_notes import TurnNotes

pytestmark = pytest.mark.asyncio


def _slowed(queue: PostgresKeyedQueue) -> asyncio.Event:
    """Hold ``queue``'s direct turns back before their first query until the event is set, as
    a slow network would."""
    go_on = asyncio.Event()
    early = queue._turns.early  # pyright: ignore[reportPrivateUsage]
    begin_direct = early.begin_direct

    async def slow(
        keys: Mapping[int, Hashable], deadline: float | None, loop: asyncio.AbstractEventLoop
    ) -> PgTurn | None:
        await go_on.wait()
        return await begin_direct(keys, deadline, loop)

    early.begin_direct = slow
    return go_on


async def test_each_process_s_only_call_waits_in_the_server_in_call_order(pools: Pools) -> None:
    watcher = await pools(max_size=1)
    queues = [PostgresKeyedQueue(await pools(), namespace="t", fair=True) for _ in range(4)]
    notes = TurnNotes()

    holder = asyncio.create_task(queues[0].run("k", notes.hold))
    await notes.until_holding()
    calls = []
    for process in (1, 2, 3):
        calls.append(asyncio.create_task(queues[process].run("k", notes.note, f"p{process}")))
        await until_waiting_in_server(watcher, process)
    assert await ticket_count(watcher) == 0
    for queue in queues:  # no connection for tickets either
        assert queue._turns.early.desk.task is None  # pyright: ignore[reportPrivateUsage]
    notes.release.set()
    await asyncio.wait_for(asyncio.gather(holder, *calls), 10)
    assert notes.order == ["hold", "p1", "p2", "p3"]
    for queue in queues:
        await queue.aclose()


async def test_a_ticket_never_reaches_the_server_ahead_of_its_process_s_direct_turn(
    pools: Pools,
) -> None:
    # a1 takes its turn directly, but its first query is slow to reach the server; a2, a's
    # next call, takes a ticket, which is at the head of the line. a2's transaction must
    # wait until a1's is in the server's queue: ahead of it, it would hold the key while a2's
    # call waits in the process for a1's, and a1's transaction waits in the server for a2's.
    watcher = await pools(max_size=1)
    a = PostgresKeyedQueue(await pools(), namespace="t", fair=True)
    b = PostgresKeyedQueue(await pools(), namespace="t", fair=True)
    notes = TurnNotes()
    go_on = _slowed(a)

    holder = asyncio.create_task(b.run("k", notes.hold))
    await notes.until_holding()
    first = asyncio.create_task(a.run("k", notes.note, "a1"))
    await until(lambda: a.stats().running == 1, "a1 begins its turn")
    second = asyncio.create_task(a.run("k", notes.note, "a2"))
    await until_tickets(watcher, 1)
    await asyncio.sleep(0.2)  # a2's verdict comes back: it is first in line
    assert await waiting_in_server(watcher) == 0, "a2's transaction went ahead of a1's"
    notes.release.set()
    await holder
    go_on.set()
    await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert notes.order == ["hold", "a1", "a2"]
    await a.aclose()
    await b.aclose()
    assert await ticket_count(watcher) == 0


async def test_a_direct_turn_that_finds_a_ticket_takes_one_before_its_process_s_later_calls(
    pools: Pools,
) -> None:
    # b1 waits in the server behind c's holder, b2 with a ticket. a1's first query reaches
    # the server only after a2 took its ticket: a1 finds b2's, takes a ticket itself, and
    # a2 takes a new one after a1's.
    watcher = await pools(max_size=1)
    a, b, c = [PostgresKeyedQueue(await pools(), namespace="t", fair=True) for _ in range(3)]
    notes = TurnNotes()
    go_on = _slowed(a)

    holder = asyncio.create_task(c.run("k", notes.hold))
    await notes.until_holding()
    calls = [asyncio.create_task(b.run("k", notes.note, "b1"))]
    await until_waiting_in_server(watcher, 1)
    calls.append(asyncio.create_task(b.run("k", notes.note, "b2")))
    await until_tickets(watcher, 1)
    calls.append(asyncio.create_task(a.run("k", notes.note, "a1")))
    await until(lambda: a.stats().running == 1, "a1 begins its turn")
    calls.append(asyncio.create_task(a.run("k", notes.note, "a2")))
    await until_tickets(watcher, 2)
    go_on.set()
    await until_tickets(watcher, 3)  # b2's, a1's and a2's new one
    notes.release.set()
    await asyncio.wait_for(asyncio.gather(holder, *calls), 10)
    assert notes.order == ["hold", "b1", "b2", "a1", "a2"]
    for queue in (a, b, c):
        await queue.aclose()
    assert await ticket_count(watcher) == 0


async def test_bursts_of_calls_of_several_processes_on_one_key_all_run_in_each_s_order(
    pools: Pools,
) -> None:
    # Each process makes eight calls at once, four times: its first takes its turn directly
    # while its later ones take tickets, and while others' tickets are taken and given
    # back. Every call runs, each process's in the order it made them.
    queues = [PostgresKeyedQueue(await pools(), namespace="t", fair=True) for _ in range(3)]
    started: list[list[int]] = [[] for _ in queues]

    async def note(process: int, call: int) -> None:
        started[process].append(call)

    async def bursts(process: int) -> None:
        for burst in range(4):
            calls = range(burst * 8, burst * 8 + 8)
            await asyncio.gather(*(queues[process].run("k", note, process, c) for c in calls))

    await asyncio.wait_for(asyncio.gather(*(bursts(p) for p in range(len(queues)))), 30)
    assert started == [list(range(32))] * len(queues)
    for queue in queues:
        await queue.aclose()


async def test_a_commit_notifies_only_the_process_of_the_ticket_that_may_go_next(
    postgres_dsn: str,
) -> None:
    # Tickets 100 (a, giving it back), 101 (b), 102 (c) and 103 (d) wait on one key. Once
    # 100 is given back, 101 is next (b was asked when 101 became second, with 100 ahead)
    # and 102 may follow it: only c is woken.
    heard, _ = await words_of_a_give_back(postgres_dsn, "abcd")
    key = lock_id("t", "k")
    assert heard == {"a": [], "b": [], "c": [f"{key}:102"], "d": []}


async def test_a_commit_wakes_no_one_when_the_next_two_tickets_are_one_process_s(
    postgres_dsn: str,
) -> None:
    # Tickets 101 and 102 are b's: 102 waits for 101, whose give-back b hears in its own
    # rows. Neither b nor d is woken.
    heard, _ = await words_of_a_give_back(postgres_dsn, "abbd")
    assert heard == {"a": [], "b": [], "d": []}


async def test_a_commit_tells_the_tickets_next_in_line_past_those_of_a_stopped_process(
    postgres_dsn: str,
) -> None:
    # s stopped a lease and a half ago while two of its calls waited: its tickets, 101 and
    # 102, are no longer live, and verdicts skip them. Once 100 is given back, c's 103 is
    # next and d's 104 may follow it. c was never second at a give-back, so it is told too:
    # a word naming s's tickets would reach no one, and c and d would wait for their
    # heartbeats until s's rows were cleared, three leases after its last heartbeat.
    heard, _ = await words_of_a_give_back(postgres_dsn, "asscd", stopped="s")
    key = lock_id("t", "k")
    assert heard == {"a": [], "c": [f"{key}:103"], "d": [f"{key}:104"], "s": []}


async def test_two_give_backs_at_once_on_one_line_tell_the_ticket_that_becomes_second(
    postgres_dsn: str,
) -> None:
    # a gives 100 back in its commit while s gives 102 back (its call was cancelled, or it
    # takes a new ticket): a's 101 is then first and q's 103 second. Each tell alone sees the
    # other's ticket still there (a's: 101 and 102; s's: 100 and 101, both a's), so neither
    # would name 103, and q would wait for its heartbeat. The tells of one line take turns:
    # the later one sees the line the earlier one left, and q is woken.
    heard, _ = await words_of_give_backs(postgres_dsn, "aasqq", givers=[0, 2])
    key = lock_id("t", "k")
    assert f"{key}:103" in heard["q"]
    assert heard["a"] == []


async def test_a_desk_s_give_back_tells_the_line_once_it_holds_its_registration_lock() -> None:
    # A ticket the desk gives back (its call was cancelled, or it takes a new one) tells its
    # line as a commit does, once it holds the line's registration lock. The batch takes it
    # with those of the lines it registers on, in one order: two batches never wait for
    # each other in a cycle.
    tickets = TicketSql("fences", None, 10.0, new_owner())
    given, registered = lock_id("t", "given"), lock_id("t", "registered")
    early = EarlyTurn({registered: "registered"}, 0)
    statements, _ = _batch(tickets, {100: (given,)}, [early], [])
    told = statements.index(tickets.tell([100], [given]))
    assert statements[:told] == ["BEGIN", *tickets.registering([given, registered])]


async def test_tickets_registered_together_follow_each_other_without_asking_again(
    pools: Pools,
) -> None:
    # Four calls of one process made at once behind its holder take their tickets in one
    # round trip: the first may go at once, and each of the others begins once the one ahead
    # of it held the key, without its verdict being asked again.
    queue = PostgresKeyedQueue(await pools(), namespace="t", fair=True)
    notes = TurnNotes()
    asked = counted(queue._turns.early.desk.sql, "verdicts")  # pyright: ignore[reportPrivateUsage]
    assert await behind_a_holder(queue, notes, 4) == [None] * 4
    assert notes.order == ["hold", "c0", "c1", "c2", "c3"]
    assert asked == []
    await queue.aclose()


async def test_a_process_whose_direct_turn_found_a_ticket_takes_tickets_on_the_key(
    pools: Pools,
) -> None:
    # a's direct turn finds b's ticket and takes one instead; for a lease, a's calls on the
    # key take tickets at once, without asking the server first.
    a = PostgresKeyedQueue(await pools(), namespace="t", lease=10.0, fair=True)
    b = PostgresKeyedQueue(await pools(), namespace="t", lease=10.0, fair=True)
    watcher = await pools(max_size=1)
    notes = TurnNotes()
    early = a._turns.early  # pyright: ignore[reportPrivateUsage]
    tried: list[Mapping[int, Hashable]] = []
    begin_direct = early.begin_direct

    async def counted(
        keys: Mapping[int, Hashable], deadline: float | None, loop: asyncio.AbstractEventLoop
    ) -> PgTurn | None:
        tried.append(keys)
        return await begin_direct(keys, deadline, loop)

    early.begin_direct = counted
    holder = asyncio.create_task(b.run("k", notes.hold))
    await notes.until_holding()
    calls = [asyncio.create_task(b.run("k", notes.note, "b1"))]
    await until_tickets(watcher, 1)
    calls.append(asyncio.create_task(a.run("k", notes.note, "a1")))
    await until_tickets(watcher, 2)
    notes.release.set()
    await asyncio.wait_for(asyncio.gather(holder, *calls), 10)
    assert len(tried) == 1
    await a.run("k", notes.note, "a2")  # a has no call on the key: still, a ticket
    assert len(tried) == 1
    assert notes.order == ["hold", "b1", "a1", "a2"]
    await a.aclose()
    await b.aclose()


async def test_a_call_whose_pool_has_no_idle_connection_takes_a_ticket_at_once(
    pools: Pools,
) -> None:
    # a's only connection is busy with other work when a1 is made: a1 takes a ticket rather
    # than wait for the connection without one, so b1, made after it, does not go first.
    watcher = await pools(max_size=1)
    a_pool = await pools(max_size=1)
    a = PostgresKeyedQueue(a_pool, namespace="t", fair=True)
    b = PostgresKeyedQueue(await pools(), namespace="t", fair=True)
    c = PostgresKeyedQueue(await pools(), namespace="t", fair=True)
    notes = TurnNotes()

    holder = asyncio.create_task(c.run("k", notes.hold))
    await notes.until_holding()
    async with a_pool.connection():  # other work of a's
        first = asyncio.create_task(a.run("k", notes.note, "a1"))
        await until_tickets(watcher, 1)
        second = asyncio.create_task(b.run("k", notes.note, "b1"))
        await until_tickets(watcher, 2)
    notes.release.set()
    await asyncio.wait_for(asyncio.gather(holder, first, second), 10)
    assert notes.order == ["hold", "a1", "b1"]
    for queue in (a, b, c):
        await queue.aclose()
