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
