"""KeyedStream against a private redis-server: order, acks, retries, dead letters, takeover."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from typing import Any

import pytest
import pytest_asyncio
import redis.asyncio as redis

from keyserial import QueueObserver
from keyserial._observation import Outcome
from keyserial.redis._transport import text
from keyserial.streams import KeyedStream, RedisStreamSource, StreamMessage, acl_rules

from .redis_helpers import Clients, one_node_cluster, until
from .stream_behaviour import (
    Running,
    consumers_share_partitions_and_take_them_back,
    same_key_in_order_different_keys_concurrently,
)

pytestmark = pytest.mark.asyncio

LEASE = 1.0

#: Makes a KeyedStream named "s" (one per simulated consumer), each on a client of its own.
Streams = Callable[..., KeyedStream]


@pytest_asyncio.fixture
async def streams(clients: Clients) -> AsyncIterator[Streams]:
    made: list[KeyedStream] = []

    def make(partitions: int = 4, lease: float = LEASE) -> KeyedStream:
        made.append(KeyedStream(clients(), "s", partitions, lease=lease))
        return made[-1]

    yield make
    for stream in made:
        stream.stop()
    for stream in made:
        await stream.aclose()


@pytest_asyncio.fixture
async def running() -> AsyncIterator[Running]:
    runs = Running()
    yield runs
    await runs.stop_all()


async def pending(client: redis.Redis, stream: KeyedStream, partition: int) -> list[str]:
    """The ids read from ``partition`` and not acknowledged yet."""
    try:
        rows: Any = await client.xpending_range(
            redis_names(stream).stream_name(partition), "keyserial", "-", "+", 1000
        )
    except redis.ResponseError as exc:
        if "NOGROUP" not in str(exc):
            raise
        return []  # never read: no owner has set the partition's group up yet
    return [row["message_id"].decode() for row in rows]


async def read_by_a_dead_owner(client: redis.Redis, stream: KeyedStream, count: int) -> str:
    """Make an earlier owner of partition 0 read its first ``count`` messages and die."""
    name = redis_names(stream).stream_name(0)
    await client.xgroup_create(name, "keyserial", id="0", mkstream=True)
    await client.xreadgroup("keyserial", "dead-owner", {name: ">"}, count=count)
    return name


def redis_names(stream: KeyedStream) -> RedisStreamSource:
    """The Redis source behind ``stream``, which names its keys."""
    source = stream.source
    assert isinstance(source, RedisStreamSource)
    return source


async def test_same_key_in_stream_order_different_keys_concurrently(
    streams: Streams, running: Running
) -> None:
    await same_key_in_order_different_keys_concurrently(streams(), running)


async def test_a_message_is_acknowledged_after_its_handler_and_before_its_key_moves_on(
    streams: Streams, clients: Clients, running: Running
) -> None:
    stream = streams(partitions=1)
    client = clients()
    first_may_finish = asyncio.Event()
    seen_pending: list[list[str]] = []
    ids: list[str] = []

    @stream.consumer()
    async def handle(message: StreamMessage) -> None:
        seen_pending.append(await pending(client, stream, 0))
        if message.id == ids[0]:
            await first_may_finish.wait()

    ids.append(await stream.publish("k", {"n": 1}))
    ids.append(await stream.publish("k", {"n": 2}))
    running.start(stream)
    await until(lambda: len(seen_pending) == 1, "first handler started")
    # Read, running: pending (not acknowledged) while its handler has not returned.
    assert ids[0] in await pending(client, stream, 0)
    first_may_finish.set()
    await until(lambda: len(seen_pending) == 2, "second handler started")
    # When the key's next message starts, the first one's ack is already in Redis.
    assert ids[0] not in seen_pending[1]
    await until(lambda: stream.stats().handled == 2, "both handled")
    assert await pending(client, stream, 0) == []


async def test_a_failing_handler_is_retried_while_its_key_waits_and_other_keys_go_on(
    streams: Streams, running: Running
) -> None:
    stream = streams()
    log: list[tuple[str, int]] = []

    @stream.consumer(max_attempts=3, retry_delay=0.01)
    async def handle(message: StreamMessage) -> None:
        log.append((str(message.key), message.attempt))
        if message.key == "flaky" and message.fields["n"] == "0" and message.attempt < 3:
            raise RuntimeError("not yet")

    await stream.publish("flaky", {"n": 0})
    await stream.publish("flaky", {"n": 1})
    await stream.publish("other", {"n": 0})
    running.start(stream)
    await until(lambda: stream.stats().handled == 3, "all handled")
    flaky = [attempt for key, attempt in log if key == "flaky"]
    assert flaky == [1, 2, 3, 1]  # the second message waited for the first's three attempts
    stats = stream.stats()
    assert (stats.retries, stats.failed_attempts, stats.dead_lettered) == (2, 2, 0)


async def test_after_max_attempts_a_message_is_dead_lettered_and_its_key_moves_on(
    streams: Streams, clients: Clients, running: Running
) -> None:
    stream = streams(partitions=1)
    handled: list[str] = []

    @stream.consumer(max_attempts=2, retry_delay=0)
    async def handle(message: StreamMessage) -> None:
        if message.fields["kind"] == "poison":
            raise ValueError(f"cannot parse {message.fields['text']!r}")
        handled.append(message.fields["text"])

    poison = await stream.publish(("seg", 1), {"kind": "poison", "text": "???"})
    await stream.publish(("seg", 1), {"kind": "final", "text": "hello"})
    running.start(stream)
    await until(lambda: handled == ["hello"], "the next message of the key handled")
    [dead] = await stream.dead_letters()
    assert (dead.key, dead.id, dead.partition) == (("seg", 1), poison, 0)
    assert dead.fields == {"kind": "poison", "text": "???"}
    assert (dead.error, dead.deliveries) == ("ValueError: cannot parse '???'", 1)
    assert stream.stats().dead_lettered == 1
    assert await pending(clients(), stream, 0) == []  # dead-lettered means acknowledged


async def test_a_new_owner_first_finishes_the_previous_owners_unacknowledged_messages(
    streams: Streams, clients: Clients, running: Running
) -> None:
    stream = streams(partitions=1)
    client = clients()
    for n in range(3):
        await stream.publish("k", {"n": n})
    # An earlier owner read the first two and died before acknowledging them.
    name = await read_by_a_dead_owner(client, stream, 2)
    await stream.publish("k", {"n": 3})
    log: list[tuple[int, int]] = []

    @stream.consumer()
    async def handle(message: StreamMessage) -> None:
        log.append((int(message.fields["n"]), message.deliveries))

    running.start(stream)
    await until(lambda: len(log) == 4, "all four handled")
    # Message 1 sat behind message 0 of its key: it never started, so the claim that
    # handed it out again does not count as a delivery.
    assert log == [(0, 2), (1, 1), (2, 1), (3, 1)]
    # The dead owner's name leaves the group once nothing is pending under it.
    consumers: Any = await client.xinfo_consumers(name, "keyserial")
    assert b"dead-owner" not in [consumer["name"] for consumer in consumers]


async def test_a_message_handed_out_more_than_max_deliveries_times_is_dead_lettered_unrun(
    streams: Streams, clients: Clients, running: Running
) -> None:
    stream = streams(partitions=1)
    client = clients()
    pill = await stream.publish("pill", {"n": 0})
    follower = await stream.publish("pill", {"n": 1})
    survivor = await stream.publish("lucky", {"n": 0})
    await stream.publish("pill", {"n": 2})
    # Earlier owners read the first three and died: Redis counts each hand-out, the next
    # owner's claim included. The pill goes from 2 to 3, over the bound of 2; the survivor
    # from 1 to 2, at it. The follower, behind the pill, never started: its count is set
    # back to what it was.
    name = await read_by_a_dead_owner(client, stream, 3)
    await client.xclaim(name, "keyserial", "dead-owner", 0, [pill], retrycount=2)
    await client.xclaim(name, "keyserial", "dead-owner", 0, [follower], retrycount=2)
    await client.xclaim(name, "keyserial", "dead-owner", 0, [survivor], retrycount=1)
    ran: list[tuple[Hashable, str, int]] = []
    counted: list[int] = []

    @stream.consumer(max_deliveries=2)
    async def handle(message: StreamMessage) -> None:
        ran.append((message.key, message.fields["n"], message.deliveries))
        if message.id == follower:  # what a later owner would be told, were this one to die
            rows: Any = await client.xpending_range(name, "keyserial", follower, follower, 1)
            counted.append(rows[0]["times_delivered"])

    running.start(stream)
    await until(lambda: len(ran) == 3, "the survivor and the pill's next messages handled")
    assert sorted(ran, key=str) == [("lucky", "0", 2), ("pill", "1", 2), ("pill", "2", 1)]
    assert counted == [2]
    [dead] = await stream.dead_letters()
    assert (dead.key, dead.id, dead.deliveries) == ("pill", pill, 3)
    assert dead.error.startswith("delivered 3 times, more than max_deliveries=2"), dead.error
    assert stream.stats().dead_lettered == 1
    assert await pending(client, stream, 0) == []


async def test_an_owner_that_lost_its_partition_cannot_acknowledge_and_the_message_runs_again(
    streams: Streams, clients: Clients, running: Running
) -> None:
    stream = streams(partitions=1)
    client = clients()
    holder = redis_names(stream).stream_name(0).removesuffix(":stream") + ":holder"
    steal = asyncio.Event()
    runs: list[tuple[int, int]] = []

    @stream.consumer()
    async def handle(message: StreamMessage) -> None:
        runs.append((message.fence, message.deliveries))
        if len(runs) == 1:
            # Another owner took the partition while this handler ran (its lease ran out).
            await client.set(holder, "1@elsewhere:" + str(message.fence + 1), px=200)
            steal.set()

    await stream.publish("k", {"n": 0})
    running.start(stream)
    await until(lambda: len(runs) == 2, "the message ran again under a new ownership")
    assert steal.is_set()
    (first_fence, first_deliveries), (second_fence, second_deliveries) = runs
    assert (first_deliveries, second_deliveries) == (1, 2)  # the fenced ack was refused
    assert second_fence > first_fence + 1
    assert stream.stats().ownerships_lost >= 1
    await until(lambda: stream.stats().handled == 1, "acknowledged by the new ownership")


async def test_reading_stops_while_max_in_flight_messages_are_unfinished(
    streams: Streams, clients: Clients, running: Running
) -> None:
    # Eight partitions read concurrently: the bound holds for all of them together.
    stream = streams(partitions=8)
    release = asyncio.Event()
    started: list[str] = []

    @stream.consumer(max_in_flight=3)
    async def handle(message: StreamMessage) -> None:
        started.append(str(message.key))
        await release.wait()

    for n in range(40):
        await stream.publish(f"key-{n}", {"n": n})
    running.start(stream)
    await until(lambda: len(stream.stats().partitions) == 8, "all partitions owned")
    await until(lambda: len(started) == 3, "three handlers running")
    await asyncio.sleep(LEASE / 2)  # time for reads that must not happen
    assert len(started) == 3
    client = clients()
    read = [await pending(client, stream, partition) for partition in range(8)]
    assert sum(map(len, read)) == 3  # the others were not even read
    assert stream.stats().in_flight == 3
    release.set()
    await until(lambda: stream.stats().handled == 40, "all handled")
    await until(lambda: stream.stats().in_flight == 0, "nothing left in flight")


async def test_a_partition_whose_keys_are_stuck_reads_no_more_than_its_share_ahead(
    streams: Streams, clients: Clients, running: Running
) -> None:
    # A partition whose handlers wait must not fill max_in_flight with messages they cannot
    # start: another partition's keys would then wait for room their messages could use.
    stream = streams(partitions=2)
    stuck, flowing = (
        next(f"k{n}" for n in range(100) if stream.partition_of(f"k{n}") == p) for p in (0, 1)
    )
    release = asyncio.Event()
    handled: list[str] = []

    @stream.consumer(max_in_flight=64)
    async def handle(message: StreamMessage) -> None:
        if message.fields["n"] != "warm-up" and message.key == stuck:
            await release.wait()
        handled.append(str(message.key))

    for key in (stuck, flowing):  # both partitions reading: a share is half of 64
        await stream.publish(key, {"n": "warm-up"})
    running.start(stream)
    await until(lambda: len(handled) == 2, "both partitions read")
    for n in range(100):
        await stream.publish(stuck, {"n": n})
        await stream.publish(flowing, {"n": n})
    try:
        await until(lambda: handled.count(flowing) == 101, "the other partition's messages handled")
        await asyncio.sleep(LEASE / 2)  # time for reads that must not happen
        # At most its share, half of 64 (fewer if a read came while the backlog was published).
        assert 1 <= len(await pending(clients(), stream, 0)) <= 32
    finally:
        release.set()
    await until(lambda: len(handled) == 202, "all handled")


async def test_a_share_counts_the_partitions_assigned_but_not_yet_owned(
    streams: Streams, clients: Clients, running: Running
) -> None:
    # Both partitions are this consumer's, but another owner still holds partition 1: the
    # partition owned meanwhile reads no more than its share, half of 64, so that there is
    # room for partition 1's keys once it is taken.
    stream, elsewhere = streams(partitions=2), streams(partitions=2)
    stuck = next(f"k{n}" for n in range(100) if stream.partition_of(f"k{n}") == 0)
    release = asyncio.Event()
    handled: list[str] = []

    @stream.consumer(max_in_flight=64)
    async def handle(message: StreamMessage) -> None:
        await release.wait()
        handled.append(str(message.fields["n"]))

    for n in range(100):
        await stream.publish(stuck, {"n": n})
    async with elsewhere.source.own(1):
        running.start(stream)
        try:
            await until(lambda: stream.stats().in_flight > 0, "partition 0 read")
            await asyncio.sleep(LEASE / 2)  # time for reads that must not happen
            assert len(await pending(clients(), stream, 0)) == 32
        finally:
            release.set()
    await until(lambda: len(handled) == 100, "all handled")


async def test_stop_lets_running_handlers_finish_acknowledges_them_and_gives_everything_back(
    streams: Streams, clients: Clients, running: Running
) -> None:
    stream = streams(partitions=2)
    client = clients()
    started, may_finish = asyncio.Event(), asyncio.Event()
    finished: list[str] = []

    @stream.consumer(drain_timeout=30)
    async def handle(message: StreamMessage) -> None:
        started.set()
        await may_finish.wait()
        finished.append(message.id)

    message_id = await stream.publish("k", {"n": 0})
    running.start(stream)
    await started.wait()
    stream.stop()
    await asyncio.sleep(0.05)
    assert not running.tasks[stream].done()  # draining: the handler is still running
    may_finish.set()
    await running.stop(stream)
    assert finished == [message_id]
    partition = stream.partition_of("k")
    assert await pending(client, stream, partition) == []
    # Nothing of the consumer is left: no owner, no membership.
    names = [name.decode() if isinstance(name, bytes) else name for name in await client.keys("*")]
    assert not [name for name in names if name.endswith((":holder", ":members}"))]
    assert names  # what is left: the stream, its fence history


async def test_consumers_share_partitions_evenly_and_take_them_back_when_one_leaves(
    streams: Streams, running: Running
) -> None:
    first, second = streams(partitions=8), streams(partitions=8)
    await consumers_share_partitions_and_take_them_back(first, second, running)


async def test_keys_keep_their_type_and_fields_arrive_as_text(
    streams: Streams, running: Running
) -> None:
    stream = streams()
    got: list[tuple[object, dict[str, str]]] = []

    @stream.consumer()
    async def handle(message: StreamMessage) -> None:
        got.append((message.key, dict(message.fields)))

    keys: list[Any] = ["1", 1, b"1", ("1",), ("seg", 7, b"\xff")]
    for key in keys:
        await stream.publish(key, {"text": "é", "raw": b"\xff", "n": 3, "x": 0.5})
    running.start(stream)
    await until(lambda: len(got) == len(keys), "all handled")
    assert sorted(map(repr, (key for key, _ in got))) == sorted(map(repr, keys))
    assert got[0][1] == {"text": "é", "raw": "\udcff", "n": "3", "x": "0.5"}


async def test_bad_input_is_refused_with_what_was_wrong(streams: Streams, clients: Clients) -> None:
    stream = streams()
    with pytest.raises(TypeError, match="must be str, bytes, int or tuples of them, not float"):
        await stream.publish(1.5, {"n": 1})
    with pytest.raises(ValueError, match=r"'keyserial\.' are reserved"):
        await stream.publish("k", {"keyserial.key": "x"})
    with pytest.raises(TypeError, match="field 'n' must be str, bytes, int or float, not NoneType"):
        await stream.publish("k", {"n": None})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="field 'n' is not a finite number"):
        await stream.publish("k", {"n": float("nan")})
    with pytest.raises(ValueError, match="partitions must be a positive int, got 0"):
        KeyedStream(clients(), "s", 0)
    with pytest.raises(ValueError, match=r"lease must be a finite number of seconds >= 0\.2"):
        KeyedStream(clients(), "s", lease=0.01)
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        KeyedStream(clients(), "")
    with pytest.raises(TypeError, match=r"needs a redis\.asyncio\.Redis or .*RedisCluster client"):
        KeyedStream(object(), "s")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="has no handler"):
        await stream.run()
    with pytest.raises(ValueError, match="max_in_flight must be a positive int, got 0"):
        stream.consumer(max_in_flight=0)
    with pytest.raises(ValueError, match="max_deliveries must be a positive int or None, got 0"):
        stream.consumer(max_deliveries=0)
    with pytest.raises(ValueError, match="max_deliveries must be a positive int or None, got True"):
        stream.consumer(max_deliveries=True)

    def not_async(message: StreamMessage) -> None: ...

    with pytest.raises(TypeError, match="must be an async def function"):
        stream.consumer()(not_async)  # type: ignore[type-var]

    async def handler(message: StreamMessage) -> None: ...

    stream.consumer()(handler)
    with pytest.raises(ValueError, match="already has a handler"):
        stream.consumer()(handler)


async def test_partitions_are_stable_and_cover_every_partition(streams: Streams) -> None:
    stream = streams(partitions=16)
    # A stable hash: the same as in every other process and release (pinned values).
    assert [stream.partition_of(f"seg-{n}") for n in range(8)] == PINNED_PARTITIONS
    assert {stream.partition_of(n) for n in range(2000)} == set(range(16))


PINNED_PARTITIONS = [1, 11, 13, 10, 0, 4, 2, 12]


async def test_a_failed_ack_holds_the_key_until_the_message_is_run_again_first(
    streams: Streams, running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = streams(partitions=1)
    source = redis_names(stream)
    real_ack = source.ack
    failures = [ConnectionError("Redis went away during the ack")]

    async def ack_failing_once(partition: int, fence: int, ids: Sequence[str]) -> int:
        if failures:
            raise failures.pop()
        return await real_ack(partition, fence, ids)

    monkeypatch.setattr(source, "ack", ack_failing_once)
    starts: list[tuple[str, int]] = []

    @stream.consumer()
    async def handle(message: StreamMessage) -> None:
        starts.append((message.fields["n"], message.deliveries))

    await stream.publish("k", {"n": "first"})
    await stream.publish("k", {"n": "second"})
    running.start(stream)
    await until(lambda: stream.stats().handled == 2, "both handled")
    # The unacknowledged first message ran again before the second one ever started (the
    # second was read by the first ownership too, but it never started there: a claim of
    # a message behind an earlier one of its key does not count as a delivery).
    assert starts == [("first", 1), ("first", 2), ("second", 1)]


async def test_the_observer_sees_each_message_under_its_key_and_the_handlers_name(
    streams: Streams, running: Running
) -> None:
    stream = streams()
    finished: list[tuple[object, str, str]] = []

    class Finishes(QueueObserver):
        def on_finish(
            self, key: Hashable, function: str, waited: float, ran: float | None, outcome: Outcome
        ) -> None:
            finished.append((key, function, outcome))

    @stream.consumer(observer=Finishes(), max_attempts=1)
    async def handle(message: StreamMessage) -> None:
        if message.fields["ok"] == "no":
            raise ValueError("refused")

    await stream.publish("a", {"ok": "yes"})
    await stream.publish("b", {"ok": "no"})  # fails once, then is dead-lettered: the turn completes
    running.start(stream)
    await until(lambda: len(finished) == 2, "both finished")
    name = handle.__qualname__
    assert sorted(map(repr, finished)) == sorted(
        [repr(("a", name, "completed")), repr(("b", name, "completed"))]
    )
    assert stream.stats().dead_lettered == 1


async def test_entries_not_published_by_a_keyed_stream_are_dead_lettered_not_run(
    streams: Streams, clients: Clients, running: Running
) -> None:
    stream = streams(partitions=1)
    client = clients()
    name = redis_names(stream).stream_name(0)
    no_key = text(await client.xadd(name, {"text": "from elsewhere"}))
    bad_key = text(await client.xadd(name, {"keyserial.key": "!!not base64!!", "text": "bad"}))
    handled: list[str] = []

    @stream.consumer()
    async def handle(message: StreamMessage) -> None:
        handled.append(message.fields["text"])

    await stream.publish("k", {"text": "good"})
    running.start(stream)
    await until(lambda: handled == ["good"], "the good message handled")
    await until(lambda: stream.stats().dead_lettered == 2, "both others dead-lettered")
    dead = {letter.id: letter for letter in await stream.dead_letters()}
    assert set(dead) == {no_key, bad_key}
    assert "not published by a KeyedStream" in dead[no_key].error
    assert "not a key serialized by KeyedStream" in dead[bad_key].error
    assert dead[bad_key].fields == {"text": "bad"}
    assert await pending(client, stream, 0) == []


async def test_a_handler_that_cancels_itself_holds_its_key_until_the_message_runs_again(
    streams: Streams, running: Running
) -> None:
    stream = streams(partitions=1)
    starts: list[tuple[str, int]] = []

    @stream.consumer()
    async def handle(message: StreamMessage) -> None:
        starts.append((message.fields["n"], message.deliveries))
        if len(starts) == 1:
            raise asyncio.CancelledError  # as a handler's own timeout handling might

    await stream.publish("k", {"n": "first"})
    await stream.publish("k", {"n": "second"})
    running.start(stream)
    await until(lambda: stream.stats().handled == 2, "both handled")
    assert starts == [("first", 1), ("first", 2), ("second", 1)]  # as for a failed ack


async def test_idle_partitions_beyond_the_pool_poll_instead_of_failing(
    clients: Clients, running: Running
) -> None:
    # 12 idle partitions, and a pool of 8 connections: not every idle partition can block on
    # a connection of its own. Messages still arrive, and no ownership is lost over it.
    stream = KeyedStream(clients(max_connections=8), "s", 12, lease=LEASE)
    handled: list[str] = []

    @stream.consumer()
    async def handle(message: StreamMessage) -> None:
        handled.append(str(message.key))

    try:
        running.start(stream)
        await until(lambda: len(stream.stats().partitions) == 12, "all partitions owned")
        await asyncio.sleep(LEASE / 2)  # every partition idle, waiting
        producer = KeyedStream(clients(), "s", 12, lease=LEASE)
        for n in range(24):
            await producer.publish(f"key-{n}", {"n": n})
        await until(lambda: len(handled) == 24, "all handled")
        assert stream.stats().ownerships_lost == 0
    finally:
        await running.stop(stream)
        await stream.aclose()


async def test_stop_ends_even_when_a_handler_turns_its_cancellation_into_an_error(
    streams: Streams, clients: Clients, running: Running
) -> None:
    # A handler's client may turn the cancellation into another error (a connection dropped
    # mid-call): the worker must neither retry nor dead-letter it, and must still end.
    stream = streams(partitions=1)
    started = asyncio.Event()

    @stream.consumer(drain_timeout=0.1, max_attempts=3, retry_delay=0)
    async def handle(message: StreamMessage) -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise ConnectionError("the connection broke while cancelling") from None

    message_id = await stream.publish("k", {"n": 1})
    running.start(stream)
    await started.wait()
    stream.stop()
    await asyncio.wait_for(running.tasks.pop(stream), 10)
    assert await stream.dead_letters() == []
    assert await pending(clients(), stream, 0) == [message_id]  # left for the next owner


async def test_a_user_restricted_to_the_documented_acl_publishes_and_consumes(
    clients: Clients, running: Running
) -> None:
    admin = clients()
    await admin.acl_setuser("worker", enabled=True, passwords=["+secret"], reset=True)
    rules = acl_rules("restricted").split()
    await admin.execute_command("ACL", "SETUSER", "worker", *rules)  # type: ignore[no-untyped-call]
    worker = {"username": "worker", "password": "secret"}
    stream = KeyedStream(clients(**worker), "restricted", 2, lease=LEASE)
    handled: list[str] = []

    @stream.consumer(max_attempts=1)
    async def handle(message: StreamMessage) -> None:
        handled.append(message.fields["n"])
        if message.fields["n"] == "bad":
            raise ValueError("dead-lettered, under the same rules")

    try:
        running.start(stream)
        for n in ("1", "bad", "2"):
            await stream.publish("k", {"n": n})
        await until(lambda: handled == ["1", "bad", "2"], "all handled")
        await until(lambda: stream.stats().dead_lettered == 1, "dead-lettered")
        assert [letter.fields["n"] for letter in await stream.dead_letters()] == ["bad"]
        # Another stream's keys are out of this user's reach.
        other = KeyedStream(clients(**worker), "other", 2, lease=LEASE)
        with pytest.raises(redis.ResponseError, match=r"NOPERM|no permissions"):
            await other.publish("k", {"n": "1"})
    finally:
        await running.stop(stream)
        await stream.aclose()


async def test_works_with_a_redis_cluster_client() -> None:
    async with one_node_cluster() as client:
        if not hasattr(client, "pubsub"):  # redis-py before 8.0: no asyncio cluster pub/sub
            with pytest.raises(TypeError, match=r"RedisCluster has it from redis-py 8\.0"):
                KeyedStream(client, "s")
            return
        stream = KeyedStream(client, "s", partitions=4, lease=LEASE)
        handled: list[tuple[Hashable, int]] = []

        @stream.consumer(max_attempts=1)
        async def handle(message: StreamMessage) -> None:
            if message.fields["n"] == "bad":
                raise ValueError("bad")
            handled.append((message.key, int(message.fields["n"])))

        for n in range(40):
            await stream.publish(f"k{n % 8}", {"n": n})
        await stream.publish("k0", {"n": "bad"})
        run = asyncio.create_task(stream.run())
        await until(
            lambda: len(handled) == 40 and stream.stats().dead_lettered == 1,
            "every message handled, the bad one dead-lettered",
        )
        for key in {key for key, _ in handled}:
            mine = [n for k, n in handled if k == key]
            assert mine == sorted(mine)
        [dead] = await stream.dead_letters()
        assert (dead.key, dead.error) == ("k0", "ValueError: bad")
        assert len({stream.source.partition_of(f"k{n}") for n in range(8)}) > 1
        stream.stop()
        await run
        await stream.aclose()
