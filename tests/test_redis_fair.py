"""Fair mode's own promises: a call's ticket goes to Redis when the call registers, keeps its
place while the call waits in its process, and leaves no gap when the call gives up."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from keyserial.redis import RedisKeyedQueue, RedisUnavailable, encode_key
from keyserial.redis._transport import LuaScript

from .redis_helpers import Clients, until, until_tickets_waiting
from .turn_notes import TurnNotes

pytestmark = pytest.mark.asyncio


async def test_a_call_waiting_in_its_process_past_its_tickets_heartbeat_keeps_its_place(
    clients: Clients,
) -> None:
    lease = 0.3
    watcher = clients()
    a = RedisKeyedQueue(clients(), namespace="t", lease=lease, fair=True)
    b = RedisKeyedQueue(clients(), namespace="t", lease=lease, fair=True)
    notes = TurnNotes()

    holder = asyncio.create_task(a.run("k", notes.hold))
    await notes.until_holding()
    second = asyncio.create_task(a.run("k", notes.note, "a, made first"))  # waits in a's process
    await until_tickets_waiting(watcher, "t", "k", 1)
    third = asyncio.create_task(b.run("k", notes.note, "b, made later"))
    await until_tickets_waiting(watcher, "t", "k", 2)
    # Past two leases, a ticket nobody polls is dead to Redis: the first waiter's is kept
    # alive for it while it waits behind the holder in its own process.
    await asyncio.sleep(4 * lease)
    notes.release.set()
    await asyncio.gather(holder, second, third)
    assert notes.order == ["hold", "a, made first", "b, made later"]
    await a.aclose()
    await b.aclose()


@pytest.mark.parametrize("how", ["cancelled", "timed out"])
async def test_a_call_that_gives_up_in_its_process_leaves_no_gap_in_redis(
    clients: Clients, how: str
) -> None:
    watcher = clients()
    a = RedisKeyedQueue(clients(), namespace="t", lease=10.0, fair=True)
    b = RedisKeyedQueue(clients(), namespace="t", lease=10.0, fair=True)
    notes = TurnNotes()

    holder = asyncio.create_task(a.run("k", notes.hold))
    await notes.until_holding()
    if how == "cancelled":
        gives_up = asyncio.create_task(a.run("k", notes.note, "gave up"))
    else:
        gives_up = asyncio.create_task(a.with_options(timeout=0.5).run("k", notes.note, "gave up"))
    await until_tickets_waiting(watcher, "t", "k", 1)
    later = asyncio.create_task(b.run("k", notes.note, "b"))
    await until_tickets_waiting(watcher, "t", "k", 2)
    if how == "cancelled":
        gives_up.cancel()
    with pytest.raises(asyncio.CancelledError if how == "cancelled" else TimeoutError):
        await gives_up
    await until_tickets_waiting(watcher, "t", "k", 1)  # its ticket left Redis's queue
    notes.release.set()
    # A ticket left behind would be granted and never taken up: the key would stall until
    # the lease (10 s) ran out.
    await asyncio.wait_for(asyncio.gather(holder, later), 5)
    assert notes.order == ["hold", "b"]
    await a.aclose()
    await b.aclose()


async def test_a_later_calls_grant_is_passed_on_while_the_earliest_call_registers_on_its_own(
    clients: Clients, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The process's earliest waiting call ("A") could not register its ticket (Redis did not
    # answer then), so it registers on its own, first in Redis's queue, once its turn here
    # comes; a later call ("B"), registered fine, was granted meanwhile. B's call waits here
    # behind A: B must not keep the turn it cannot take up. With a lease far longer than the
    # test's bound, a kept turn shows as a timeout.
    queue = RedisKeyedQueue(clients(), namespace="t", lease=30.0, fair=True)
    notes = TurnNotes()
    await queue.run("warm-up", asyncio.sleep, 0)  # its grant listener is subscribed
    turns = queue._turns  # pyright: ignore[reportPrivateUsage]
    listener = next(iter(turns.listeners.values()))
    real_script, real_grant = turns.script, listener.grant
    registrations: list[tuple[str, ...]] = []  # what each registration of "k" sent
    held_back: list[tuple[str, int]] = []  # grants not delivered yet
    deliver = asyncio.Event()

    async def script(sent: LuaScript, base: str, *args: str | int, **options: Any) -> Any:
        if sent is turns.acquire_script and base == turns.base(encode_key("k")):
            registrations.append(tuple(map(str, args)))
            if len(registrations) == 2:  # A's ticket
                raise RedisUnavailable("injected: A's registration was not answered")
        return await real_script(sent, base, *args, **options)

    def grant(ticket: str, fence: int) -> None:
        if deliver.is_set():
            real_grant(ticket, fence)
        else:
            held_back.append((ticket, fence))

    monkeypatch.setattr(turns, "script", script)
    monkeypatch.setattr(listener, "grant", grant)

    try:
        holder = asyncio.create_task(queue.run("k", notes.hold))
        await notes.until_holding()
        first = asyncio.create_task(queue.run("k", notes.note, "A"))
        await until(lambda: len(registrations) == 2, "A's registration fails")
        second = asyncio.create_task(queue.run("k", notes.note, "B"))
        await until(lambda: len(registrations) == 3, "B registers")
        notes.release.set()  # the holder ends: Redis grants B, whose grant is held back
        await until(lambda: len(held_back) > 0, "B is granted")
        # A's call, next here, registers on its own: its ticket waits in Redis's queue,
        # behind B's turn (however it got there).
        await until_tickets_waiting(clients(), "t", "k", 1)
        deliver.set()
        for ticket, fence in held_back:
            real_grant(ticket, fence)
        await asyncio.wait_for(asyncio.gather(holder, first, second), timeout=10)
        assert notes.order == ["hold", "A", "B"]
    finally:
        # Also after a failure: the queue's background requests end with the test, not
        # with a later test's loop.
        await queue.aclose()


async def test_a_grant_kept_for_a_ticket_registered_again_is_not_taken_up(
    clients: Clients,
) -> None:
    # A process stopped past its lease reads, when it resumes, the grant Redis made to one of
    # its tickets meanwhile, and finds the ticket lost (the lease ran out; the turn went on):
    # it registers the ticket again, under its name. The grant it kept is of the earlier
    # registration: taken up, the call's function would start on a lease that ran out, while
    # another call holds the key. Here: b holds "k"; a's ticket waits; a grant with a fence
    # below any Redis makes now is kept for it; the ticket is registered again. Taking it up
    # must wait for a grant of the new registration (b still holds: the wait times out).
    a = RedisKeyedQueue(clients(), namespace="t", lease=10.0, fair=True)
    b = RedisKeyedQueue(clients(), namespace="t", lease=10.0, fair=True)
    notes = TurnNotes()
    holder = asyncio.create_task(b.run("k", notes.hold))
    await notes.until_holding()
    await a.run("warm-up", asyncio.sleep, 0)  # its grant listener is subscribed
    tickets = a._tickets  # pyright: ignore[reportPrivateUsage]
    assert tickets is not None
    listener = next(iter(a._turns.listeners.values()))  # pyright: ignore[reportPrivateUsage]
    encoded = encode_key("k")
    ticket = tickets.register(encoded)
    await until(lambda: ticket.reply.done(), "the ticket is registered")
    assert ticket.reply.result() == ""  # it waits behind b's turn
    listener.grant(ticket.name, 1)  # kept: its call does not wait for it yet
    assert listener.waiting[ticket.name] == 1
    loop = asyncio.get_running_loop()
    sender = tickets.senders[(loop, ticket.base)]
    tickets._lost_early(ticket)  # pyright: ignore[reportPrivateUsage]
    await until(lambda: not sender.running, "the ticket is registered again")

    async def take_up() -> int:
        task = asyncio.current_task()
        assert task is not None
        turn, keeper = await tickets.take_early(ticket, encoded, loop.time() + 0.5, task)
        await a._turns.give_back(encoded, turn, keeper, task)  # pyright: ignore[reportPrivateUsage]
        return turn.fence

    taken = (await asyncio.gather(take_up(), return_exceptions=True))[0]
    notes.release.set()
    assert isinstance(taken, TimeoutError), f"took up a grant made before: fence {taken}"
    await holder
    await a.run("k", notes.note, "a")  # the key moves on
    assert notes.order == ["hold", "a"]
    await a.aclose()
    await b.aclose()
