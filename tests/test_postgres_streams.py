"""KeyedStream on PostgreSQL, in one process against the real server: order, the outbox,
exactly-once effects (the handler's writes commit with the acknowledgement), fences, retries,
dead letters, bad input. Faults with real processes are in test_postgres_stream_faults."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import psycopg
import pytest
import pytest_asyncio
import redis.asyncio as redis
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from keyserial.postgres import connection
from keyserial.streams import Entry, KeyedStream, PartitionLost, StreamMessage
from keyserial.streams import _partition as partition_module
from keyserial.streams import _postgres_source as postgres_source
from keyserial.streams._postgres_source import PostgresStreamSource

from .conftest import Pools
from .redis_helpers import until
from .stream_behaviour import (
    Running,
    consumers_share_partitions_and_take_them_back,
    same_key_in_order_different_keys_concurrently,
)

pytestmark = pytest.mark.asyncio

LEASE = 1.0

#: Makes a KeyedStream named "s" on a pool of its own (one per simulated consumer).
Streams = Callable[..., Awaitable[KeyedStream]]


@pytest_asyncio.fixture
async def streams(pools: Pools) -> AsyncIterator[Streams]:
    made: list[KeyedStream] = []

    async def make(
        partitions: int = 4, lease: float = LEASE, name: str = "s", pool_size: int = 20
    ) -> KeyedStream:
        pool = await pools(max_size=pool_size)
        made.append(KeyedStream(pool, name, partitions, lease=lease))
        return made[-1]

    yield make
    for stream in made:
        await stream.stop()
        await stream.aclose()


@pytest_asyncio.fixture
async def db(pools: Pools) -> AsyncConnectionPool[Any]:
    """A pool for the test's own look at the database, with the table handlers write to."""
    pool = await pools()
    async with pool.connection() as conn:
        await conn.execute("CREATE TABLE applied (key text, n int, at bigserial)")
    return pool


async def rows(pool: AsyncConnectionPool[Any], query: Any, *args: Any) -> list[tuple[Any, ...]]:
    async with pool.connection() as conn:
        found = await conn.execute(query, args)
        return list(await found.fetchall())


async def read_entries(source: PostgresStreamSource, fence: int) -> list[Entry]:
    """What the owner with ``fence`` reads of partition 0 (refused once it is stale)."""
    got = await source.read(0, fence, "owner", 10)
    assert not isinstance(got, str), "nothing to read"
    return list(got)


async def owner_fence(source: PostgresStreamSource, owner: str) -> int:
    """Take partition 0 over through ``source``, as ``owner``; the new fence."""
    taken = await source._owners.take_over(0, owner)  # pyright: ignore[reportPrivateUsage]
    assert taken is not None
    return taken[0]


async def applied(pool: AsyncConnectionPool[Any]) -> list[tuple[str, int]]:
    return [(k, n) for k, n in await rows(pool, "SELECT key, n FROM applied ORDER BY at")]


async def unacknowledged(pool: AsyncConnectionPool[Any]) -> list[str]:
    found = await rows(pool, "SELECT id FROM keyserial_stream_messages ORDER BY id")
    return [str(row[0]) for row in found]


@pytest_asyncio.fixture
async def running() -> AsyncIterator[Running]:
    runs = Running()
    yield runs
    await runs.stop_all()


async def test_same_key_in_publish_order_different_keys_concurrently(
    streams: Streams, running: Running
) -> None:
    await same_key_in_order_different_keys_concurrently(await streams(), running)


async def test_the_handlers_writes_commit_with_the_acknowledgement_before_its_key_moves_on(
    streams: Streams, running: Running, db: AsyncConnectionPool[Any]
) -> None:
    stream = await streams(partitions=1)
    first_may_finish = asyncio.Event()
    seen: list[tuple[list[tuple[str, int]], list[str]]] = []

    @stream.consumer()
    async def handle(message: StreamMessage) -> None:
        n = int(message.fields["n"])
        await connection().execute("INSERT INTO applied (key, n) VALUES (%s, %s)", (message.key, n))
        seen.append((await applied(db), await unacknowledged(db)))
        if n == 0:
            await first_may_finish.wait()

    first = await stream.publish("k", {"n": 0})
    second = await stream.publish("k", {"n": 1})
    running.start(stream)
    await until(lambda: len(seen) == 1, "the first handler wrote")
    # Written but not committed: others see neither the write nor the ack.
    assert seen[0] == ([], [first, second])
    assert await applied(db) == [] and await unacknowledged(db) == [first, second]
    first_may_finish.set()
    await until(lambda: len(seen) == 2, "the second handler wrote")
    # When the key's next message runs, the first's write and its ack have both committed.
    assert seen[1] == ([("k", 0)], [second])
    await until(lambda: stream.stats().handled == 2, "both handled")
    assert await applied(db) == [("k", 0), ("k", 1)]
    assert await unacknowledged(db) == []


async def test_a_failed_attempt_rolls_back_its_writes_then_the_message_is_dead_lettered(
    streams: Streams, running: Running, db: AsyncConnectionPool[Any]
) -> None:
    stream = await streams(partitions=1)
    attempts: list[int] = []

    @stream.consumer(max_attempts=3, retry_delay=0)
    async def handle(message: StreamMessage) -> None:
        n = int(message.fields["n"])
        await connection().execute("INSERT INTO applied (key, n) VALUES ('seg', %s)", (n,))
        if message.fields["kind"] == "poison":
            attempts.append(message.attempt)
            raise ValueError(f"cannot parse {message.fields['text']!r}")

    poison = await stream.publish(("seg", 1), {"kind": "poison", "text": "???", "n": 0})
    await stream.publish(("seg", 1), {"kind": "final", "text": "hello", "n": 1})
    running.start(stream)
    await until(lambda: stream.stats().handled == 1, "the next message of the key handled")
    assert attempts == [1, 2, 3]
    # The poison message's three writes were rolled back with their attempts.
    assert await applied(db) == [("seg", 1)]
    [dead] = await stream.dead_letters()
    assert (dead.key, dead.id, dead.partition) == (("seg", 1), poison, 0)
    assert dead.fields == {"kind": "poison", "text": "???", "n": "0"}
    assert (dead.error, dead.deliveries) == ("ValueError: cannot parse '???'", 1)
    assert await unacknowledged(db) == []


async def test_a_message_published_in_the_callers_transaction_exists_only_if_it_commits(
    streams: Streams, running: Running, db: AsyncConnectionPool[Any]
) -> None:
    stream = await streams(partitions=2)
    handled: list[str] = []

    @stream.consumer()
    async def handle(message: StreamMessage) -> None:
        handled.append(message.fields["kind"])

    async with db.connection() as conn:
        async with conn.transaction():
            await conn.execute("INSERT INTO applied (key, n) VALUES ('order-1', 1)")
            await stream.publish("order-1", {"kind": "kept"}, connection=conn)
        with pytest.raises(ZeroDivisionError):
            async with conn.transaction():
                await conn.execute("INSERT INTO applied (key, n) VALUES ('order-1', 2)")
                await stream.publish("order-1", {"kind": "rolled back"}, connection=conn)
                raise ZeroDivisionError
    running.start(stream)
    await until(lambda: handled == ["kept"], "the committed message handled")
    await stream.publish("order-1", {"kind": "later"})
    await until(lambda: handled == ["kept", "later"], "a later message handled")
    assert await applied(db) == [("order-1", 1)]


async def test_a_stale_owners_transaction_holds_off_the_takeover_and_later_ones_are_refused(
    pools: Pools,
) -> None:
    stale = PostgresStreamSource(await pools(), "s", 1, 0.5)
    new = PostgresStreamSource(await pools(), "s", 1, 0.5)
    first_id = await stale.publish("k", {"n": 0})
    second_id = await stale.publish("k", {"n": 1})
    taken = await stale._owners.take_over(0, "stale")  # pyright: ignore[reportPrivateUsage]
    assert taken is not None
    fence, handed_out = taken
    assert not handed_out  # nothing was read before: its claim would find nothing
    [first, second] = await read_entries(stale, fence)
    assert (first.id, second.id) == (first_id, second_id)
    async with stale._pool.connection() as conn:  # pyright: ignore[reportPrivateUsage]
        # The stale owner's lease runs out (it was paused and did not renew it).
        await conn.execute("UPDATE keyserial_stream_partitions SET lease_until = '-infinity'")
    async with stale.attempt(0, fence, first) as needed:
        assert needed
        # While the stale owner's transaction runs, no one takes the partition over.
        assert await new._owners.take_over(0, "new") is None  # pyright: ignore[reportPrivateUsage]
    # It committed before the takeover, which now happens and finds the first message gone.
    taken = await new._owners.take_over(0, "new")  # pyright: ignore[reportPrivateUsage]
    assert taken is not None
    new_fence, handed_out = taken
    assert handed_out  # the stale owner read the second message: the claim must look
    assert new_fence == fence + 1
    _, claimed = await new.claim(0, new_fence, "new", "0-0", 10)
    assert [entry.id for entry in claimed] == [second_id]
    # Whatever the stale owner tries next is refused inside its transaction.
    with pytest.raises(PartitionLost):
        async with stale.attempt(0, fence, second):
            raise AssertionError("a stale owner's handler ran")
    with pytest.raises(PartitionLost):
        await read_entries(stale, fence)
    with pytest.raises(PartitionLost):
        await stale.dead_letter(0, fence, second, "stale")
    await stale.aclose()
    await new.aclose()


async def test_an_attempt_for_a_message_whose_commit_did_land_runs_nothing(
    pools: Pools,
) -> None:
    source = PostgresStreamSource(await pools(), "s", 1, 0.5)
    await source.publish("k", {"n": 0})
    fence = await owner_fence(source, "owner")
    [entry] = await read_entries(source, fence)
    async with source.attempt(0, fence, entry) as needed:
        assert needed
    # The commit landed, but (say) its reply was lost: the attempt made again finds no work.
    async with source.attempt(0, fence, entry) as needed:
        assert not needed
    await source.aclose()


async def test_a_message_whose_commit_failed_runs_again_before_the_next_of_its_key(
    streams: Streams, running: Running, db: AsyncConnectionPool[Any]
) -> None:
    stream = await streams(partitions=1)
    log: list[tuple[int, int]] = []

    @stream.consumer()
    async def handle(message: StreamMessage) -> None:
        n = int(message.fields["n"])
        log.append((n, message.deliveries))
        await connection().execute("INSERT INTO applied (key, n) VALUES (%s, %s)", (message.key, n))
        if n == 0 and message.deliveries == 1:
            found = await connection().execute("SELECT pg_backend_pid()")
            row = await found.fetchone()
            assert row is not None
            # The handler returns normally, but its connection is gone before the commit.
            await rows(db, "SELECT pg_terminate_backend(%s)", row[0])

    await stream.publish("k", {"n": 0})
    await stream.publish("k", {"n": 1})
    running.start(stream)
    await until(lambda: stream.stats().handled == 2, "both handled", seconds=20)
    assert log == [(0, 1), (0, 2), (1, 1)]
    assert await applied(db) == [("k", 0), ("k", 1)]
    assert stream.stats().ownerships_lost == 0  # the partition was served again, not lost


async def test_reading_goes_on_while_the_handlers_hold_every_connection_of_the_pool(
    streams: Streams, running: Running
) -> None:
    # A handler's transaction holds a pool connection; reads go on a connection of the
    # stream's own, so the next messages are read meanwhile, ready when a connection is.
    stream, producer = await streams(partitions=1, pool_size=1), await streams(partitions=1)
    release = asyncio.Event()
    started: list[str] = []

    @stream.consumer()
    async def handle(message: StreamMessage) -> None:
        started.append(str(message.fields["n"]))
        await release.wait()

    await producer.publish("a", {"n": 0})
    running.start(stream)
    try:
        await until(lambda: started == ["0"], "the handler holds the pool's only connection")
        for n in range(1, 4):
            await producer.publish("b", {"n": n})
        await until(lambda: stream.stats().in_flight == 4, "read while the pool was held")
    finally:
        release.set()
    await until(lambda: stream.stats().handled == 4, "all handled")
    assert started == ["0", "1", "2", "3"]


def scans_of(plan: Any, table: str) -> list[dict[str, Any]]:
    """Each scan of ``table`` in ``plan`` (EXPLAIN ANALYZE's JSON), and whether it is the
    scan an UPDATE changes the rows of (``"Updated"``)."""
    found: list[dict[str, Any]] = []
    nodes = [(plan[0]["Plan"], False)]
    while nodes:
        node, updated = nodes.pop()
        for child in node.get("Plans", []):
            # An UPDATE's rows come from its outer plan (through a Result, if any), not
            # from its subplans.
            outer = child.get("Parent Relationship") == "Outer"
            nodes.append((child, outer and (updated or node["Node Type"] == "ModifyTable")))
        if node.get("Relation Name") == table and "Scan" in node["Node Type"]:
            found.append({**node, "Updated": updated})
    return found


async def test_a_read_looks_its_messages_up_once_however_many_wait_in_the_partition(
    streams: Streams, pools: Pools
) -> None:
    # Looked up once per message waiting in the partition, or found among them all, a read
    # of a few messages costs the whole backlog: the planner picks either on a table whose
    # statistics are not yet gathered, as after a burst of publications.
    stream = await streams(partitions=1)
    for n in range(300):
        await stream.publish("k", {"n": n})
    source = PostgresStreamSource(await pools(), "s", 1, 10.0)
    fence = await owner_fence(source, "owner")
    assert len(await read_entries(source, fence)) == 10  # handed out: what a claim finds
    args = {"stream": "s", "partition": 0, "fence": fence, "count": 50, "after": 0}
    pool = await pools()

    async def hands_out_without_the_backlog(statement: str, handed: int) -> None:
        async with pool.connection() as conn, conn.transaction(force_rollback=True):
            explain = "EXPLAIN (ANALYZE, FORMAT JSON) " + statement
            found = await conn.execute(explain, args)  # pyright: ignore[reportArgumentType]
            row = await found.fetchone()
        assert row is not None
        plan = row[0]
        assert plan[0]["Plan"]["Actual Rows"] == handed
        scans = scans_of(plan, "keyserial_stream_messages")
        assert scans, plan
        assert all(scan["Actual Loops"] == 1 for scan in scans), scans
        # The UPDATE reads the messages it hands out, not the rest of the backlog; so does a
        # read's pick (a claim's looks for handed-out messages among all of the partition's).
        [updated] = [scan for scan in scans if scan["Updated"]]
        assert updated["Actual Rows"] == handed, updated
        checked = scans if statement is postgres_source._READ else [updated]
        assert all(scan.get("Rows Removed by Filter", 0) == 0 for scan in checked), scans

    await hands_out_without_the_backlog(postgres_source._READ, 50)
    await hands_out_without_the_backlog(postgres_source._CLAIM, 10)
    async with pool.connection() as conn:  # and once the server has the table's statistics
        await conn.execute("ANALYZE keyserial_stream_messages")
    await hands_out_without_the_backlog(postgres_source._READ, 50)
    await hands_out_without_the_backlog(postgres_source._CLAIM, 10)
    await source.aclose()


async def test_an_idle_consumer_reads_only_when_a_publication_is_notified(
    streams: Streams, running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An owner that found nothing asks again after IDLE_WAIT at the latest, if its source
    # does not wait longer: shortened here, so that polling would show at once.
    monkeypatch.setattr(partition_module, "IDLE_WAIT", 0.01)
    stream = await streams(partitions=2)
    reads: list[int] = []
    source = stream.source
    read = source.read

    async def counted(partition: int, fence: int, consumer: str, count: int) -> Any:
        reads.append(partition)
        return await read(partition, fence, consumer, count)

    monkeypatch.setattr(source, "read", counted)
    handled: list[str] = []

    @stream.consumer()
    async def handle(message: StreamMessage) -> None:
        handled.append(message.fields["n"])

    running.start(stream)
    await until(lambda: sorted(set(reads)) == [0, 1], "both partitions read once")
    await asyncio.sleep(0.3)
    idle_reads = len(reads)
    assert idle_reads <= 4  # a first read each, and one each when the listener came up
    await stream.publish("k", {"n": 1})
    await until(lambda: handled == ["1"], "the published message handled")
    assert len(reads) <= idle_reads + 2


async def test_bad_input_is_refused_with_what_was_wrong(streams: Streams, pools: Pools) -> None:
    stream = await streams(partitions=4)
    await stream.publish("k", {"n": 1})
    other = await streams(partitions=8)
    with pytest.raises(ValueError, match="has 4 partitions in the database, not 8"):
        await other.publish("k", {"n": 1})
    with pytest.raises(TypeError, match="psycopg AsyncConnection"):
        await stream.publish("k", {"n": 1}, connection="not a connection")
    with pytest.raises(ValueError, match="reserved"):
        await stream.publish("k", {"keyserial.key": 1})
    with pytest.raises(TypeError, match=r"psycopg_pool\.AsyncConnectionPool"):
        PostgresStreamSource(object(), "s", 1, 1.0)  # type: ignore[arg-type]
    pool = await pools()
    async with pool.connection() as conn:
        with pytest.raises(TypeError, match="connection= is for a stream on PostgreSQL"):
            await KeyedStream(redis.Redis(), "r").publish("k", {}, connection=conn)


async def test_connection_outside_a_turn_or_a_handler_names_both() -> None:
    with pytest.raises(RuntimeError, match="handler of a KeyedStream on PostgreSQL"):
        connection()


async def test_the_setup_command_makes_the_stream_tables_for_a_role_without_create(
    postgres_dsn: str, pools: Pools
) -> None:
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    from keyserial.postgres import SetupRequired, setup

    role = f"ks_stream_app_{secrets.token_hex(4)}"
    async with await psycopg.AsyncConnection.connect(postgres_dsn, autocommit=True) as admin:
        await admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    app_dsn = make_conninfo(postgres_dsn, user=role)
    try:
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(app_dsn, open=False, max_size=4)
        await pool.open(wait=True)
        try:
            stream = KeyedStream(pool, "s", 2)
            with pytest.raises(SetupRequired, match=r"python -m keyserial\.postgres setup"):
                await stream.publish("k", {"n": 1})
            await setup(postgres_dsn, grant_to=role)
            stream = KeyedStream(pool, "s", 2)
            await stream.publish("k", {"n": 1})
            handled: list[str] = []

            @stream.consumer()
            async def handle(message: StreamMessage) -> None:
                handled.append(message.fields["n"])
                stream.stop()

            await asyncio.wait_for(stream.run(), 20)
            await stream.aclose()
            assert handled == ["1"] and conninfo_to_dict(app_dsn)["user"] == role
        finally:
            await pool.close()
    finally:
        async with await psycopg.AsyncConnection.connect(postgres_dsn, autocommit=True) as admin:
            await admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            await admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


async def test_leaving_an_ownership_ends_its_keeper_when_a_renewal_ends_with_the_cancel(
    pools: Pools, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before Python 3.12, asyncio.wait_for returns the result of a request that completes
    # in the same step as its task is cancelled, and the cancellation is lost: a keeper
    # that relied on it alone renewed the lease for ever, and leaving the block hung.
    # A lease long enough that a loaded machine does not let it run out before the block ends.
    source = PostgresStreamSource(await pools(), "s", 1, 3.0)
    owners = source._owners  # pyright: ignore[reportPrivateUsage]
    renewing, answer = asyncio.Event(), asyncio.Event()

    async def renew(partition: int, fence: int) -> bool:
        renewing.set()
        await answer.wait()
        return True

    monkeypatch.setattr(owners, "renew", renew)

    async def own_then_leave() -> None:
        async with source.own(0):
            await renewing.wait()
            answer.set()  # the renewal completes in the step the block is left

    await asyncio.wait_for(own_then_leave(), 10)
    await source.aclose()


async def test_a_new_owner_first_runs_the_previous_owners_unacknowledged_messages(
    streams: Streams, running: Running, pools: Pools
) -> None:
    stream = await streams(partitions=1)
    for n in range(3):
        await stream.publish("k", {"n": n})
    # An earlier owner read the first two and died before acknowledging them.
    dead = PostgresStreamSource(await pools(), "s", 1, 0.3)
    fence = await owner_fence(dead, "dead")
    got = await dead.read(0, fence, "dead", 2)
    assert [entry.id for entry in got if isinstance(entry, Entry)] != []
    await stream.publish("k", {"n": 3})
    assert await stream.source.lag(0) == 2  # the last two: never handed out
    log: list[tuple[int, int]] = []

    @stream.consumer()
    async def handle(message: StreamMessage) -> None:
        log.append((int(message.fields["n"]), message.deliveries))

    running.start(stream)
    await until(lambda: len(log) == 4, "all four handled")
    # Message 1 sat behind message 0 of its key: it never started, so the claim that
    # handed it out again does not count as a delivery.
    assert log == [(0, 2), (1, 1), (2, 1), (3, 1)]
    assert await stream.source.lag(0) == 0
    await dead.aclose()


async def test_a_message_handed_out_more_than_max_deliveries_times_is_dead_lettered_unrun(
    streams: Streams, running: Running, pools: Pools, db: AsyncConnectionPool[Any]
) -> None:
    stream = await streams(partitions=1)
    poison = await stream.publish("k", {"n": 0})
    await stream.publish("k", {"n": 1})
    # Owners kept dying while it ran: it was handed out three times already.
    dead = PostgresStreamSource(await pools(), "s", 1, 0.3)
    fence = await owner_fence(dead, "dead")
    await dead.read(0, fence, "dead", 1)
    await rows(
        db, "UPDATE keyserial_stream_messages SET deliveries = 3 WHERE id = %s RETURNING id", poison
    )
    handled: list[str] = []

    @stream.consumer(max_deliveries=3)
    async def handle(message: StreamMessage) -> None:
        handled.append(message.fields["n"])

    running.start(stream)
    await until(lambda: handled == ["1"], "the next message of the key handled")
    [letter] = await stream.dead_letters()
    assert (letter.id, letter.deliveries) == (poison, 4)
    assert letter.error.startswith("delivered 4 times, more than max_deliveries=3")
    await dead.aclose()


async def test_a_handler_that_swallows_a_statements_error_fails_its_attempt(
    streams: Streams, running: Running, db: AsyncConnectionPool[Any]
) -> None:
    # PostgreSQL answers the COMMIT of a failed transaction with a rollback, not an error:
    # taken as done, the message's acknowledgement would be undone while its key moved on.
    stream = await streams(partitions=1)
    attempts: list[tuple[int, int]] = []

    @stream.consumer(max_attempts=3, retry_delay=0)
    async def handle(message: StreamMessage) -> None:
        n = int(message.fields["n"])
        attempts.append((n, message.attempt))
        await connection().execute("INSERT INTO applied (key, n) VALUES ('k', %s)", (n,))
        if n == 0 and message.attempt == 1:
            with contextlib.suppress(psycopg.errors.DivisionByZero):
                await connection().execute("SELECT 1 / 0")

    await stream.publish("k", {"n": 0})
    await stream.publish("k", {"n": 1})
    running.start(stream)
    await until(lambda: stream.stats().handled == 2, "both handled")
    assert attempts == [(0, 1), (0, 2), (1, 1)]
    assert await applied(db) == [("k", 0), ("k", 1)]
    assert await unacknowledged(db) == []
    assert stream.stats().failed_attempts == 1


async def test_a_handler_that_commits_itself_gives_the_partition_up(
    streams: Streams, running: Running, db: AsyncConnectionPool[Any]
) -> None:
    stream = await streams(partitions=1)
    attempts: list[tuple[int, int]] = []

    @stream.consumer(retry_delay=0)
    async def handle(message: StreamMessage) -> None:
        n = int(message.fields["n"])
        attempts.append((n, message.deliveries))
        await connection().execute("INSERT INTO applied (key, n) VALUES ('k', %s)", (n,))
        if n == 0 and message.deliveries == 1:
            await connection().rollback()  # its write and the acknowledgement undone

    await stream.publish("k", {"n": 0})
    await stream.publish("k", {"n": 1})
    running.start(stream)
    await until(lambda: stream.stats().handled == 2, "both handled", seconds=20)
    # Run again first, by the partition's next ownership, before the key's next message.
    assert attempts == [(0, 1), (0, 2), (1, 1)]
    assert await applied(db) == [("k", 0), ("k", 1)]


async def test_reading_resumes_once_an_eighth_of_max_in_flight_is_free() -> None:
    in_flight = partition_module.InFlight(16)
    in_flight.readers = 2
    assert in_flight.share() == 16  # an even share (8) would be a read of too few
    in_flight.readers = 1
    assert in_flight.reserve(100) == 16
    in_flight.release(1)
    assert in_flight.reserve(5) == 0  # one free place: not yet worth a request
    in_flight.release(1)
    assert in_flight.reserve(5) == 2


async def test_a_read_takes_an_even_share_of_a_large_max_in_flight() -> None:
    in_flight = partition_module.InFlight(1000)
    in_flight.readers = 16
    assert in_flight.share() == 62  # sixteen of them fit 1000
    # Each partition gets its whole share at once, the last too, though less than an
    # eighth of the bound is free by then: a whole share is worth a request.
    assert [in_flight.reserve(62) for _ in range(16)] == [62] * 16
    in_flight.readers = 0  # no partition reading yet: one read may take it all
    assert in_flight.share() == 1000


async def test_consumers_share_partitions_evenly_and_take_them_back_when_one_leaves(
    streams: Streams, running: Running
) -> None:
    first, second = await streams(partitions=8), await streams(partitions=8)
    await consumers_share_partitions_and_take_them_back(first, second, running)


async def test_a_stray_notification_on_the_channel_leaves_the_listener_running(
    streams: Streams, running: Running, db: AsyncConnectionPool[Any]
) -> None:
    stream = await streams(partitions=1)
    handled: list[str] = []

    @stream.consumer()
    async def handle(message: StreamMessage) -> None:
        handled.append(message.fields["n"])

    running.start(stream)
    await until(lambda: stream.stats().partitions == (0,), "the partition owned")
    await rows(db, "SELECT pg_notify('keyserial_streams', 'not ours'), 1")
    await rows(db, "SELECT pg_notify('keyserial_streams', 'p:x:s'), 1")
    await stream.publish("k", {"n": 1})
    # Woken by the publication's notification, not by the re-read of an idle owner.
    await until(lambda: handled == ["1"], "the message handled", seconds=5)
