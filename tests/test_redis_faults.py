"""The Redis backend under faults a production user meets: each test failed before its fix.

Stale grants after Redis forgot its tickets, a lock block cancelled while it releases,
releases against a dead server, stalls and pauses of the server, bursts past the pool,
``decode_responses``, synchronous clients, unusual keys and settings.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import redis
import redis.asyncio

from keyserial import LeaseLost, current_fence
from keyserial.redis import RedisKeyedQueue, RedisUnavailable, acl_rules, encode_key

from .redis_helpers import Clients, until
from .redis_server import RedisServer
from .scheduling import Recorder

# Every test runs in the default mode and in fair mode (the redis_mode fixture).
pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("redis_mode")]


async def debug_sleep(client: redis.asyncio.Redis, seconds: float) -> None:
    """Stall the whole server for ``seconds`` (DEBUG SLEEP): it answers nothing meanwhile."""
    await client.execute_command("DEBUG", "SLEEP", str(seconds))  # type: ignore[no-untyped-call]


@pytest_asyncio.fixture
async def pauser(clients: Clients) -> AsyncIterator[redis.asyncio.Redis]:
    """A client that pauses the server; whatever a test does, the server is unpaused after."""
    client = clients()
    yield client
    await client.client_unpause()


async def test_a_grant_for_a_ticket_nobody_waits_for_never_lets_a_call_in(
    clients: Clients,
) -> None:
    # A waiter that gave up at the instant its grant was published leaves that grant behind
    # in its process; once Redis forgot its tickets (restart, expired counter) the same
    # ticket could be drawn again and would run at once. Here such leftover grants are
    # published for the first tickets a listener could draw, before any call.
    first = RedisKeyedQueue(clients(), namespace="stale", lease=5.0)
    second = RedisKeyedQueue(clients(), namespace="stale", lease=5.0)
    publisher = clients()
    rec = Recorder()
    holder = asyncio.create_task(second.run("k", rec.step, "holder"))
    await until(lambda: rec.log == ["start holder"], "the other process holds the key")
    subscriber = await first._turns.listener()
    base = first._turns.base(encode_key("k"))
    for number in range(1, 50):
        await publisher.publish(subscriber.channel, f"{base}|{number}@{subscriber.listener}|9")
    await asyncio.sleep(0.05)  # delivered to the listener
    waiter = asyncio.create_task(first.run("k", rec.step, "waiter"))
    await asyncio.sleep(0.2)
    assert rec.log == ["start holder"], "a stale grant let a call in while another holds the key"
    rec.gate("holder").set()
    rec.gate("waiter").set()
    await asyncio.wait_for(asyncio.gather(holder, waiter), timeout=10)
    assert rec.log == ["start holder", "end holder", "start waiter", "end waiter"]
    await first.aclose()
    await second.aclose()


async def test_a_lock_block_cancelled_while_it_releases_does_not_wedge_its_key(
    clients: Clients, pauser: redis.asyncio.Redis
) -> None:
    # Lease 5 s: the block waits up to half a second for its release to be answered.
    queue = RedisKeyedQueue(clients(), namespace="wedge", lease=5.0)
    in_block = asyncio.Event()
    leave = asyncio.Event()

    async def block() -> None:
        async with queue.lock("k"):
            in_block.set()
            await leave.wait()

    task = asyncio.create_task(block())
    await asyncio.wait_for(in_block.wait(), timeout=10)
    await pauser.client_pause(2000, all=False)  # write commands (the release) wait
    leave.set()
    await asyncio.sleep(0.1)  # the block is in __aexit__, its release sent and waiting
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await pauser.client_unpause()

    async def next_call() -> str:
        return "ran"

    # The process's own turn was given back: the next call of this process gets the key.
    assert await asyncio.wait_for(queue.run("k", next_call), timeout=10) == "ran"
    assert len(queue._local) == 0
    await queue.aclose()


@pytest.mark.parametrize("fault", ["killed", "stopped"])
async def test_a_call_is_not_held_hostage_by_a_redis_that_is_gone(
    clients: Clients, redis_server: RedisServer, fault: str
) -> None:
    # Lease 1 s, Redis gone a moment into a 2 s call: killed (connections refused) or
    # stopped (connections open, nothing answered). The lease cannot be renewed nor the turn
    # released; the caller learns LeaseLost within the lease, without waiting on Redis.
    queue = RedisKeyedQueue(clients(), namespace="hostage", lease=1.0)
    started = asyncio.Event()

    async def long_call() -> str:
        started.set()
        await asyncio.sleep(2.0)
        return "done"

    call = asyncio.create_task(queue.run("k", long_call))
    await asyncio.wait_for(started.wait(), timeout=10)
    if fault == "killed":
        redis_server.kill()
    else:
        redis_server.pause()
    try:
        with pytest.raises(LeaseLost):
            await asyncio.wait_for(call, timeout=4.0)  # a hang bound, not a duration claim
    finally:
        if fault == "killed":
            redis_server.start()
        else:
            redis_server.resume()
    await queue.aclose()


@pytest.mark.parametrize("how", ["CLIENT PAUSE", "DEBUG SLEEP"])
async def test_a_timeout_bounds_the_wait_while_redis_stalls(
    clients: Clients, pauser: redis.asyncio.Redis, how: str
) -> None:
    queue = RedisKeyedQueue(clients(), namespace="stall", lease=5.0)
    ran: list[str] = []

    async def work() -> None:
        ran.append("ran")

    await queue.run("warm-up", work)  # connected, scripts loaded
    ran.clear()
    stall: asyncio.Task[None] | None = None
    if how == "CLIENT PAUSE":
        await pauser.client_pause(1500)
    else:
        stall = asyncio.create_task(debug_sleep(pauser, 1.5))
        await asyncio.sleep(0.1)
    call = asyncio.create_task(queue.with_options(timeout=0.3).run("k", work))
    # The test waits less than the stall: a timeout that waits for Redis to answer fails it.
    done, _ = await asyncio.wait([call], timeout=1.0)
    assert done, "the call's timeout did not hold while Redis stalled"
    with pytest.raises(TimeoutError):
        await call
    if stall is None:
        await pauser.client_unpause()
    else:
        await stall
    await asyncio.sleep(0.1)
    assert ran == []  # and the function never ran, even once Redis answered
    await queue.run("k", work)  # the key is not left blocked: its ticket was withdrawn
    assert ran == ["ran"]
    await queue.aclose()


async def test_a_call_without_timeout_fails_within_its_lease_when_redis_does_not_answer(
    clients: Clients, pauser: redis.asyncio.Redis
) -> None:
    queue = RedisKeyedQueue(clients(), namespace="stall", lease=0.3)

    async def work() -> None:
        return None

    await queue.run("warm-up", work)
    await pauser.client_pause(2000)
    with pytest.raises(RedisUnavailable, match="did not answer"):
        await asyncio.wait_for(queue.run("k", work), timeout=1.5)  # less than the pause
    await pauser.client_unpause()
    await queue.aclose()


async def test_a_burst_of_distinct_keys_larger_than_the_pool_queues_for_connections(
    clients: Clients,
) -> None:
    client = clients()  # a default client: its pool allows 100 connections
    queue = RedisKeyedQueue(client, namespace="burst", lease=5.0)
    ran: list[int] = []

    async def work(i: int) -> None:
        await asyncio.sleep(0)
        ran.append(i)

    outcomes = await asyncio.wait_for(
        asyncio.gather(
            *(queue.run(f"key-{i}", work, i) for i in range(2000)), return_exceptions=True
        ),
        timeout=60,
    )
    errors = [outcome for outcome in outcomes if outcome is not None]
    assert errors == []
    assert sorted(ran) == list(range(2000))
    await queue.aclose()


async def test_live_waiters_keep_their_places_through_a_stall_shorter_than_the_lease(
    clients: Clients, pauser: redis.asyncio.Redis
) -> None:
    lease = 1.0
    # The holder's own lease is long: this is about the waiters' places, not its turn.
    holder = RedisKeyedQueue(clients(), namespace="order", lease=10 * lease)
    waiters = [RedisKeyedQueue(clients(), namespace="order", lease=lease) for _ in range(3)]
    rec = Recorder()
    held = asyncio.create_task(holder.run("k", rec.step, "holder"))
    await until(lambda: rec.log == ["start holder"], "the holder runs")
    tasks = []
    for i, queue in enumerate(waiters):
        tasks.append(asyncio.create_task(queue.run("k", rec.step, f"w{i}")))
        await asyncio.sleep(0.1)  # registered in this order
    for i in range(3):
        rec.gate(f"w{i}").set()
    # A stall of 0.9 lease: longer than two thirds of it, shorter than all of it. The
    # holder's release reaches Redis at its start, the waiters' polls later: once awake,
    # Redis hands the turn on before any waiter has polled again.
    stall = asyncio.create_task(debug_sleep(pauser, 0.9 * lease))
    await asyncio.sleep(0.05)
    rec.gate("holder").set()
    await stall
    await asyncio.wait_for(asyncio.gather(held, *tasks), timeout=20)
    starts = [line for line in rec.log if line.startswith("start")]
    assert starts == ["start holder", "start w0", "start w1", "start w2"]
    for queue in (holder, *waiters):
        await queue.aclose()


@pytest.mark.parametrize("protocol", [2, 3], ids=["RESP2", "RESP3"])
async def test_decode_responses_clients_hand_off_through_grants(
    clients: Clients, protocol: int, caplog: pytest.LogCaptureFixture
) -> None:
    # A lease of 30 s polls every 10 s: a hand-off within the test's bound came by grant.
    first = RedisKeyedQueue(
        clients(decode_responses=True, protocol=protocol), namespace="decoded", lease=30.0
    )
    second = RedisKeyedQueue(
        clients(decode_responses=True, protocol=protocol), namespace="decoded", lease=30.0
    )
    rec = Recorder()
    fences: list[int] = []

    async def step(name: str) -> str:
        fences.append(current_fence())
        return await rec.step(name)

    with caplog.at_level(logging.WARNING, logger="keyserial"):
        a = asyncio.create_task(first.run("k", step, "a"))
        await until(lambda: rec.log == ["start a"], "a runs")
        b = asyncio.create_task(second.run("k", step, "b"))
        await asyncio.sleep(0.1)
        rec.gate("a").set()
        rec.gate("b").set()
        assert list(await asyncio.wait_for(asyncio.gather(a, b), timeout=5)) == ["a", "b"]
    assert fences[0] < fences[1]
    assert caplog.records == []
    await first.aclose()
    await second.aclose()


async def test_a_synchronous_client_is_refused_at_construction(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    with pytest.raises(TypeError, match="asyncio client"):
        RedisKeyedQueue(client, namespace="n")  # type: ignore[arg-type]
    client.close()


async def test_unusual_keys_and_settings() -> None:
    lone = "seg-\ud800"  # a str with a lone surrogate: a key like any other in-process
    assert encode_key(lone) != encode_key("seg-\ud801")
    huge = 10**5000  # more digits than int() may print
    assert encode_key(huge) != encode_key(huge + 1)
    nested: object = "leaf"
    for _ in range(10_000):
        nested = (nested,)
    with pytest.raises(ValueError, match="nested"):
        encode_key(nested)
    client = redis.asyncio.Redis()
    with pytest.raises(TypeError, match="namespace must be a str"):
        RedisKeyedQueue(client, namespace=b"n")  # type: ignore[arg-type]
    for lease in (math.inf, math.nan, 1e-6, 0, -1):
        with pytest.raises(ValueError, match="lease"):
            RedisKeyedQueue(client, namespace="n", lease=lease)
    await client.aclose()


async def test_an_evicting_redis_is_warned_about_once(
    clients: Clients, caplog: pytest.LogCaptureFixture
) -> None:
    admin = clients()
    await admin.config_set("maxmemory-policy", "allkeys-lru")
    queue = RedisKeyedQueue(clients(), namespace="evict", lease=5.0)

    async def work() -> None:
        return None

    with caplog.at_level(logging.WARNING, logger="keyserial"):
        await queue.run("a", work)
        await queue.run("b", work)
    warnings = [r for r in caplog.records if "maxmemory-policy" in r.getMessage()]
    assert len(warnings) == 1 and "noeviction" in warnings[0].getMessage()
    await queue.aclose()


async def test_a_user_restricted_to_the_documented_acl_runs_the_queue(
    clients: Clients, redis_server: RedisServer
) -> None:
    admin = clients()
    rules = acl_rules("restricted").split()
    await admin.acl_setuser("worker", enabled=True, passwords=["+secret"], reset=True)
    await admin.execute_command("ACL", "SETUSER", "worker", *rules)  # type: ignore[no-untyped-call]
    url = redis_server.url.replace("redis://", "redis://worker:secret@")
    first = RedisKeyedQueue(redis.asyncio.Redis.from_url(url), namespace="restricted", lease=5.0)
    second = RedisKeyedQueue(redis.asyncio.Redis.from_url(url), namespace="restricted", lease=5.0)
    rec = Recorder()
    a = asyncio.create_task(first.run("k", rec.step, "a"))
    await until(lambda: rec.log == ["start a"], "a runs")
    b = asyncio.create_task(second.run("k", rec.step, "b"))
    await asyncio.sleep(0.1)
    rec.gate("a").set()
    rec.gate("b").set()
    assert list(await asyncio.wait_for(asyncio.gather(a, b), timeout=10)) == ["a", "b"]
    # Another namespace's keys are out of this user's reach.
    other = RedisKeyedQueue(redis.asyncio.Redis.from_url(url), namespace="other", lease=5.0)
    with pytest.raises(RedisUnavailable, match="no permissions"):
        await other.run("k", rec.step, "c")
    for queue in (first, second, other):
        await queue.aclose()
        await queue._client.aclose()
