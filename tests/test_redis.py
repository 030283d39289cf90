"""The Redis backend against a real, private redis-server."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis.asyncio as redis
from redis.exceptions import ResponseError

from keyserial import LeaseLost, current_fence, serialized
from keyserial.redis import RedisKeyedQueue, RedisUnavailable, encode_key
from keyserial.redis._transport import LuaScript, ScriptRunner

from .redis_helpers import Clients, one_node_cluster, until, until_tickets_waiting
from .redis_server import RedisServer
from .scheduling import Recorder

# Every test runs in the default mode and in fair mode (the redis_mode fixture).
pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("redis_mode")]

ROOT = Path(__file__).resolve().parent.parent


async def test_same_key_is_serialized_across_queues_in_registration_order(
    clients: Clients,
) -> None:
    # Two queues with their own Redis clients stand for two processes.
    first = RedisKeyedQueue(clients(), namespace="t", lease=5.0)
    second = RedisKeyedQueue(clients(), namespace="t", lease=5.0)
    rec = Recorder()
    fences: dict[str, int] = {}

    async def step(name: str) -> str:
        fences[name] = current_fence()
        return await rec.step(name)

    a = asyncio.create_task(first.run("seg", step, "a"))
    await until(lambda: rec.log == ["start a"], "a starts")
    b = asyncio.create_task(second.run("seg", step, "b"))
    # b's request reaches Redis before c is made: its ticket waits in the key's queue.
    await until_tickets_waiting(clients(), "t", "seg", 1)
    c = asyncio.create_task(first.run("seg", step, "c"))
    other = asyncio.create_task(second.run("other", step, "other"))
    await until(lambda: "start other" in rec.log, "a different key runs at once")
    assert "start b" not in rec.log and "start c" not in rec.log
    for name in ("a", "b", "c", "other"):
        rec.gate(name).set()
    assert list(await asyncio.gather(a, b, c, other)) == ["a", "b", "c", "other"]
    starts = [line for line in rec.log if line.startswith("start") and line != "start other"]
    assert starts == ["start a", "start b", "start c"]
    assert fences["a"] < fences["b"] < fences["c"]
    await first.aclose()
    await second.aclose()


async def test_uncontended_call_takes_two_round_trips(clients: Clients) -> None:
    client, watcher, marker = clients(), clients(), clients()
    queue = RedisKeyedQueue(client, namespace="t", lease=5.0)
    await marker.ping()  # connected before watching: its HELLO is not counted

    async def work() -> int:
        return current_fence()

    await queue.run("warm-up", work)  # loads the scripts and subscribes once
    # MONITOR shows every command the server receives; a script's own calls come as "lua".
    async with watcher.monitor() as monitor:
        fences = [await queue.run(f"key-{i}", work) for i in range(10)]
        await marker.echo("end of the calls")
        sent: list[str] = []
        while True:
            command = await monitor.next_command()
            if command["command"] == "ECHO end of the calls":
                break
            if command["client_type"] != "lua":
                sent.append(command["command"].split()[0])
    assert sent == ["EVALSHA"] * 20
    assert all(f > 0 for f in fences)
    await queue.aclose()


async def test_decorator_and_fences_increase_per_key(clients: Clients) -> None:
    queue = RedisKeyedQueue(clients(), namespace="t", lease=5.0)
    fences: list[int] = []

    @serialized(key="seg_id", queue=queue)
    async def finalize(seg_id: str) -> None:
        fences.append(current_fence())
        await asyncio.sleep(0)

    await asyncio.gather(*(finalize("s") for _ in range(20)))
    assert fences == sorted(set(fences)) and len(fences) == 20
    await queue.aclose()


async def test_keys_are_typed_and_encoded_apart() -> None:
    names = {encode_key(k) for k in ["1", 1, b"1", ("1",), (1, "x"), "{tag}", "a:b"]}
    assert len(names) == 7
    assert all(name.replace("-", "").replace("_", "").isalnum() for name in names)
    assert encode_key("x" * 1000).startswith("h") and len(encode_key("x" * 1000)) == 65
    with pytest.raises(TypeError, match="str, bytes, int"):
        encode_key(1.5)
    with pytest.raises(TypeError):
        encode_key(("ok", frozenset()))


async def test_reentry_and_wait_timeout(clients: Clients) -> None:
    queue = RedisKeyedQueue(clients(), namespace="t", lease=5.0)
    other = RedisKeyedQueue(clients(), namespace="t", lease=5.0)
    seen: list[int] = []

    async def inner() -> None:
        seen.append(current_fence())

    async def outer() -> None:
        seen.append(current_fence())
        await queue.run("k", inner)  # same task: runs inside this turn
        with pytest.raises(TimeoutError):
            await other.with_options(timeout=0.2).run("k", inner)  # another "process" must wait

    await queue.run("k", outer)
    assert seen[0] == seen[1]
    await queue.aclose()
    await other.aclose()


async def test_lock_holds_the_turn_for_a_block_across_queues(clients: Clients) -> None:
    first = RedisKeyedQueue(clients(), namespace="t", lease=5.0)
    second = RedisKeyedQueue(clients(), namespace="t", lease=5.0)
    log: list[str] = []
    release = asyncio.Event()
    fences: list[int] = []

    async def inside() -> None:
        fences.append(current_fence())

    async def hold() -> None:
        async with first.lock("k"):
            log.append("first in")
            fences.append(current_fence())
            await first.run("k", inside)  # re-entry: runs inside the block's turn
            await release.wait()
            log.append("first out")

    async def wait_then_enter() -> None:
        async with second.lock("k"):
            log.append("second in")
            fences.append(current_fence())

    holder = asyncio.create_task(hold())
    await until(lambda: log == ["first in"], "the first block holds the key")
    waiter = asyncio.create_task(wait_then_enter())
    with pytest.raises(TimeoutError):
        async with second.lock("k", timeout=0.2):
            pass
    assert log == ["first in"]
    release.set()
    await asyncio.gather(holder, waiter)
    assert log == ["first in", "first out", "second in"]
    assert fences[0] == fences[1] < fences[2]
    # The timed-out block left nothing behind: the key is free for an uncontended turn.
    await asyncio.wait_for(first.run("k", inside), timeout=5)
    await first.aclose()
    await second.aclose()


async def _until_one_ticket_waits(client: redis.Redis, queue: RedisKeyedQueue, key: str) -> None:
    """Wait until Redis holds one waiting ticket in ``key``'s queue; fail after a while."""
    queue_name = queue._turns.base(encode_key(key)) + ":queue"
    for _ in range(1000):
        if await client.llen(queue_name) == 1:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"no ticket ever waited for {key!r}")


async def _names(client: redis.Redis, pattern: str) -> list[str]:
    return [n.decode() if isinstance(n, bytes) else n for n in await client.keys(pattern)]


async def test_redis_keeps_only_expiring_counters_for_a_key_no_longer_used(
    clients: Clients,
) -> None:
    client = clients()
    first = RedisKeyedQueue(client, namespace="idle", lease=5.0)
    second = RedisKeyedQueue(clients(), namespace="idle", lease=5.0)
    rec = Recorder()
    held = asyncio.create_task(first.run("seg", rec.step, "a"))
    await until(lambda: "start a" in rec.log, "a holds the key")
    waiting = asyncio.create_task(second.run("seg", rec.step, "b"))
    await _until_one_ticket_waits(client, first, "seg")
    rec.gate("a").set()
    rec.gate("b").set()
    await asyncio.gather(held, waiting)
    names = sorted(await _names(client, "keyserial:*"))
    assert [name.rsplit(":", 1)[1] for name in names] == ["fence"]
    for name in names:
        assert 0 < await client.pttl(name) <= 3_600_000
    await first.aclose()
    await second.aclose()


async def test_everything_a_key_leaves_in_redis_expires_even_if_its_processes_die(
    clients: Clients,
) -> None:
    client = clients()
    queue = RedisKeyedQueue(client, namespace="dead", lease=5.0)
    base = queue._turns.base(encode_key("seg"))
    # Processes that died at once: one took the turn, one queued behind it; neither returns.
    for ticket in ("1@gone-1", "1@gone-2"):
        await queue._turns.script(queue._turns.acquire_script, base, queue._turns.lease_ms, ticket)
    # and one withdrew a ticket whose registration had not reached Redis yet
    await queue._turns.script(queue._turns.release_script, base, "2@gone-2", queue._turns.lease_ms)
    names = sorted(await _names(client, "keyserial:*"))
    parts = ["alive", "fence", "2@gone-2", "holder", "queue", "was"]
    assert [name.rsplit(":", 1)[1] for name in names] == parts
    for name in names:
        assert 0 < await client.pttl(name) <= 3_600_000, name
    await queue.aclose()


class Worker:
    """A worker process (tests/redis_worker.py) and its output lines."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.redis_worker", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )

    async def line(self) -> str:
        assert self.process.stdout is not None
        read = asyncio.to_thread(self.process.stdout.readline)
        return (await asyncio.wait_for(read, timeout=30)).strip()

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def signal(self, number: int) -> None:
        self.process.send_signal(number)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()


FENCED_WRITE = (
    "local last = tonumber(redis.call('HGET', KEYS[1], 'fence') or '0') "
    "if tonumber(ARGV[1]) > last then "
    "redis.call('HSET', KEYS[1], 'fence', ARGV[1], 'value', ARGV[2]) return 1 end "
    "return 0"
)


async def test_holder_stopped_past_its_lease_loses_the_turn_and_its_write(
    clients: Clients, redis_server: RedisServer
) -> None:
    client = clients()
    queue = RedisKeyedQueue(client, namespace="faults", lease=0.5)
    write = client.register_script(FENCED_WRITE)
    holder = Worker(redis_server.url, "hold", "k", "0.5")
    try:
        stale_fence = int((await holder.line()).split()[1])
        holder.signal(signal.SIGSTOP)  # paused, like a long GC pause, past its lease

        async def newer_write() -> int:
            fence = current_fence()
            assert await write(keys=["resource"], args=[fence, "newer"]) == 1
            return fence

        newer_fence = await queue.run("k", newer_write)  # granted once the lease expired
        assert newer_fence > stale_fence
        holder.signal(signal.SIGCONT)
        holder.send("write")
        assert await holder.line() == "refused"  # the store refused the stale write
        assert await holder.line() == "lease lost"  # and the call learned it lost the turn
        assert (await client.hget("resource", "value")) == b"newer"
    finally:
        holder.close()
    await queue.aclose()


async def test_killed_holder_frees_the_key_when_its_lease_expires(
    clients: Clients, redis_server: RedisServer
) -> None:
    queue = RedisKeyedQueue(clients(), namespace="faults", lease=0.5)
    holder = Worker(redis_server.url, "hold", "k", "0.5")
    try:
        held_fence = int((await holder.line()).split()[1])
        holder.signal(signal.SIGKILL)

        async def work() -> int:
            return current_fence()

        assert await asyncio.wait_for(queue.run("k", work), timeout=10) > held_fence
    finally:
        holder.close()
    await queue.aclose()


async def test_killed_waiter_is_skipped(clients: Clients, redis_server: RedisServer) -> None:
    client = clients()
    queue = RedisKeyedQueue(client, namespace="faults", lease=0.5)
    rec = Recorder()
    holding = asyncio.create_task(queue.run("k", rec.step, "holder"))
    await until(lambda: rec.log == ["start holder"], "the holder runs")
    waiter = Worker(redis_server.url, "wait", "k", "0.5")
    try:
        assert await waiter.line() == "waiting"
        await _until_one_ticket_waits(client, queue, "k")
        waiter.signal(signal.SIGKILL)
        other = RedisKeyedQueue(clients(), "faults", 0.5)
        behind = asyncio.create_task(other.run("k", rec.step, "behind"))
        await asyncio.sleep(0.1)
        rec.gate("holder").set()
        await holding
        rec.gate("behind").set()
        # The dead waiter's ticket stalls the key for at most about one lease.
        await asyncio.wait_for(behind, timeout=10)
        assert rec.log[-2:] == ["start behind", "end behind"]
    finally:
        waiter.close()
    await queue.aclose()
    await other.aclose()


@pytest.mark.parametrize("call_while_down", [True, False], ids=["a call fails", "no call fails"])
async def test_a_redis_restart_fails_calls_clearly_then_goes_unnoticed(
    clients: Clients, redis_server: RedisServer, call_while_down: bool
) -> None:
    queue = RedisKeyedQueue(clients(), namespace="t", lease=1.0)

    async def work() -> int:
        return current_fence()

    before = await queue.run("k", work)
    redis_server.kill()
    if call_while_down:
        with pytest.raises(RedisUnavailable):
            await queue.run("k", work)
    # Empty: all tickets, fences and scripts are gone; with no failed call between, the
    # queue's idle connections are stale too.
    redis_server.start()
    assert await queue.run("k", work) > before  # fences stay increasing across the data loss
    await queue.aclose()


async def test_bad_arguments() -> None:
    client = redis.Redis()
    with pytest.raises(ValueError, match="namespace"):
        RedisKeyedQueue(client, namespace="")
    with pytest.raises(ValueError, match="lease"):
        RedisKeyedQueue(client, namespace="n", lease=0)
    with pytest.raises(TypeError, match=r"needs an asyncio client .*, not builtins\.object"):
        RedisKeyedQueue(object(), namespace="n")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="fair must be True or False, not 'yes'"):
        RedisKeyedQueue(client, namespace="n", fair="yes")  # type: ignore[arg-type]
    queue = RedisKeyedQueue(client, namespace="n")
    with pytest.raises(TypeError, match="coalesce=True needs an in-process KeyedSerialQueue"):
        serialized(coalesce=True, queue=queue)(asyncio.sleep)
    await client.aclose()


async def test_a_long_call_keeps_its_turn_by_renewing_the_lease(clients: Clients) -> None:
    holder = RedisKeyedQueue(clients(), namespace="t", lease=0.5)
    other = RedisKeyedQueue(clients(), namespace="t", lease=0.5)
    log: list[str] = []

    async def long_call() -> None:
        log.append("long starts")
        await asyncio.sleep(1.5)  # three leases: renewed in the background meanwhile
        log.append("long ends")

    async def next_call() -> None:
        log.append("next runs")

    running = asyncio.create_task(holder.run("k", long_call))
    await until(lambda: log == ["long starts"], "the long call starts")
    await other.run("k", next_call)
    await running  # no LeaseLost: a live holder is never cut off
    assert log == ["long starts", "long ends", "next runs"]
    await holder.aclose()
    await other.aclose()


async def test_redis_restart_mid_run_loses_nothing(
    clients: Clients, redis_server: RedisServer
) -> None:
    queues = [RedisKeyedQueue(clients(), namespace="t", lease=0.5) for _ in range(2)]
    ran: list[int] = []

    async def work(call: int) -> None:
        await asyncio.sleep(0.005)
        ran.append(call)

    calls = [asyncio.create_task(queues[i % 2].run(f"key-{i % 5}", work, i)) for i in range(200)]
    await until(lambda: len(ran) >= 20, "some calls ran")
    redis_server.kill()  # every ticket, holder and fence is gone
    redis_server.start()
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    for call, outcome in enumerate(outcomes):
        if outcome is None:
            assert ran.count(call) == 1  # it ran, exactly once
        else:
            assert isinstance(outcome, (RedisUnavailable, LeaseLost)), outcome
            assert ran.count(call) <= 1  # LeaseLost: it ran, but its turn was not safe
    assert len(ran) == len(set(ran))
    await queues[0].run("key-0", work, 999)  # and the queue works again
    assert ran[-1] == 999
    for queue in queues:
        await queue.aclose()


async def test_a_script_call_cancelled_mid_command_leaves_no_reply_behind(
    clients: Clients,
) -> None:
    client, pauser = clients(), clients()
    runner = ScriptRunner(client)
    echo = LuaScript("return ARGV[1]")
    assert await runner.call(echo, "k", "warm-up") == b"warm-up"
    # For a second, the server holds every client's commands (then it answers them).
    await pauser.client_pause(1000)
    first = asyncio.create_task(runner.call(echo, "k", "first"))
    for _ in range(10):
        await asyncio.sleep(0)  # sent; waiting for its reply
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    # Had the interrupted connection been reused, this call would read "first".
    assert await runner.call(echo, "k", "second") == b"second"
    assert await runner.call(echo, "k", "third") == b"third"
    await runner.close()


# A blocking pool makes calls beyond its size wait; a plain one refuses them, so fewer go there.
@pytest.mark.parametrize(
    ("blocking", "calls"), [(True, 12), (False, 6)], ids=["blocking pool", "plain pool"]
)
async def test_a_bounded_pool_keeps_serving_its_other_users(
    redis_server: RedisServer, blocking: bool, calls: int
) -> None:
    if blocking:
        pool: redis.ConnectionPool = redis.BlockingConnectionPool.from_url(
            redis_server.url, max_connections=8, timeout=2
        )
    else:
        pool = redis.ConnectionPool.from_url(redis_server.url, max_connections=8)
    client = redis.Redis(connection_pool=pool)
    queue = RedisKeyedQueue(client, namespace="t")
    gate = asyncio.Event()
    running: list[int] = []

    async def work(i: int) -> None:
        running.append(i)
        await gate.wait()

    tasks = [asyncio.create_task(queue.run(f"key-{i}", work, i)) for i in range(calls)]
    await until(lambda: len(running) == calls, "every call holds its turn")
    gate.set()
    await asyncio.gather(*tasks)
    # The queue keeps at most a quarter of the pool idle, and none of a blocking pool (a call
    # waiting in it could not take one kept by the queue); the grant listener holds one.
    free = 8 - 1 - (0 if blocking else 2)
    assert await asyncio.gather(*(client.ping() for _ in range(free))) == [True] * free
    await queue.aclose()
    await client.aclose()
    await pool.disconnect()  # a pool given to the client is not closed with it


async def test_a_script_error_is_raised_and_the_connection_stays_usable(
    clients: Clients,
) -> None:
    client = clients()
    runner = ScriptRunner(client)
    failing = LuaScript("return redis.error_reply('refused: ' .. ARGV[1])")
    echo = LuaScript("return ARGV[1]")
    with pytest.raises(ResponseError, match="refused: no"):
        await runner.call(failing, "k", "no")
    assert await runner.call(echo, "k", "yes") == b"yes"
    queue = RedisKeyedQueue(client, namespace="t")
    queue._turns.acquire_script = failing  # a queue maps Redis's refusal to RedisUnavailable

    async def work() -> None:
        return None

    with pytest.raises(RedisUnavailable, match="Redis refused the request: refused"):
        await queue.run("k", work)
    await queue.aclose()
    await runner.close()


async def test_works_with_a_redis_cluster_client() -> None:
    async with one_node_cluster() as client:
        if not hasattr(client, "pubsub"):  # redis-py before 8.0: no asyncio cluster pub/sub
            with pytest.raises(TypeError, match=r"RedisCluster has it from redis-py 8\.0"):
                RedisKeyedQueue(client, namespace="t")
            return
        await _serializes_across_two_queues(client)


async def _serializes_across_two_queues(client: redis.RedisCluster) -> None:
    first = RedisKeyedQueue(client, namespace="t", lease=2.0)
    second = RedisKeyedQueue(client, namespace="t", lease=2.0)
    rec = Recorder()
    a = asyncio.create_task(first.run("k", rec.step, "a"))
    await until(lambda: rec.log == ["start a"], "the first call runs")
    b = asyncio.create_task(second.run("k", rec.step, "b"))
    other = asyncio.create_task(second.run("other", rec.step, "other"))
    await until(lambda: "start other" in rec.log, "a different key runs at once")
    assert "start b" not in rec.log
    for name in ("a", "b", "other"):
        rec.gate(name).set()
    assert list(await asyncio.gather(a, b, other)) == ["a", "b", "other"]
    assert rec.log.index("end a") < rec.log.index("start b")
    await first.aclose()
    await second.aclose()


async def test_the_redis_mode_fixture_makes_the_queues_it_promises(
    clients: Clients, redis_mode: str
) -> None:
    queue = RedisKeyedQueue(clients(), namespace="t")
    assert queue.fair is (redis_mode == "fair")
    assert (os.environ.get("KEYSERIAL_TEST_REDIS_FAIR") == "1") is (redis_mode == "fair")
    await queue.aclose()
