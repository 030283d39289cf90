"""A stop asked for before run() is kept, and stats().lag counts unread messages live, asked
less often where counting is slow."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, cast

import pytest

from keyserial import KeyedSerialQueue
from keyserial.streams import KeyedStream, StreamMessage
from keyserial.streams import _partition as partition_module
from keyserial.streams._message import StreamCounts

from .redis_helpers import Clients, until

pytestmark = pytest.mark.asyncio


async def test_a_stop_before_run_makes_the_next_run_return_at_once(clients: Clients) -> None:
    stream = KeyedStream(clients(), "stops", partitions=2, lease=1.0)
    handled: list[str] = []

    @stream.consumer()
    async def handle(message: StreamMessage) -> None:
        handled.append(str(message.key))

    stream.stop()  # not running yet: kept for the next run()
    await asyncio.wait_for(stream.run(), timeout=5)
    # The stop was used up: the next run consumes until stopped again.
    await stream.publish("k", {"n": 1})
    running = asyncio.create_task(stream.run())
    await until(lambda: handled == ["k"], "the second run handles the message")
    stream.stop()
    await asyncio.wait_for(running, timeout=10)
    stream.stop()  # between two runs
    await asyncio.wait_for(stream.run(), timeout=5)
    await stream.aclose()


async def test_lag_counts_unread_messages_while_the_handler_is_busy(clients: Clients) -> None:
    stream = KeyedStream(clients(), "lag", partitions=1, lease=1.0)
    busy, release = asyncio.Event(), asyncio.Event()

    @stream.consumer(max_in_flight=1)
    async def handle(message: StreamMessage) -> None:
        busy.set()
        await release.wait()

    for n in range(6):
        await stream.publish("k", {"n": n})
    running = asyncio.create_task(stream.run())
    await asyncio.wait_for(busy.wait(), timeout=10)
    # One message is being handled, five are unread: lag says so within a couple of seconds,
    # though nothing has been acknowledged yet.
    await until(lambda: stream.stats().lag == {0: 5}, "lag shows the five unread messages")
    assert stream.stats().handled == 0
    release.set()
    await until(lambda: stream.stats().handled == 6, "all six handled")
    await until(lambda: stream.stats().lag == {0: 0}, "nothing unread")
    stream.stop()
    await asyncio.wait_for(running, timeout=10)
    await stream.aclose()


async def test_stop_may_be_awaited_and_then_returns_once_run_has_returned(
    clients: Clients,
) -> None:
    stream = KeyedStream(clients(), "awaited-stop", partitions=1, lease=1.0)
    started, release = asyncio.Event(), asyncio.Event()
    finished: list[str] = []

    @stream.consumer()
    async def handle(message: StreamMessage) -> None:
        started.set()
        await release.wait()
        finished.append(str(message.key))

    await stream.publish("k", {"n": 1})
    running = asyncio.create_task(stream.run())
    await asyncio.wait_for(started.wait(), timeout=10)
    stopping = asyncio.ensure_future(stream.stop())
    await asyncio.sleep(0.05)
    assert not stopping.done()  # the handler still runs: run() is draining
    release.set()
    await asyncio.wait_for(stopping, timeout=10)
    assert finished == ["k"] and running.done()
    await running
    await stream.stop()  # not running: returns at once (and is kept for the next run)
    await asyncio.wait_for(stream.run(), timeout=5)
    await stream.aclose()


class SlowLag:
    """A source whose lag takes ``cost`` seconds to answer (or fails, if ``cost`` is None);
    it records when it was asked."""

    def __init__(self, cost: float | None) -> None:
        self.cost = cost
        self.asked: list[float] = []

    async def lag(self, partition: int) -> int:
        self.asked.append(asyncio.get_running_loop().time())
        if self.cost is None:
            raise ConnectionError("the broker is away")
        await asyncio.sleep(self.cost)
        return 7


#: How often the reader of ``spacing_of_lag_questions`` would ask, in seconds.
POLL = 0.25


async def spacing_of_lag_questions(cost: float | None, partitions: int) -> list[float]:
    """The time between the lag questions of one of ``partitions`` partitions, whose reader
    would ask every quarter of a second for two minutes."""
    source = SlowLag(cost)
    in_flight = partition_module.InFlight(100)
    in_flight.readers = partitions
    worker = partition_module.PartitionWorker(
        cast("Any", source), 0, 1, "me", handle_nothing, KeyedSerialQueue(),
        in_flight, StreamCounts(), 1, None, 0.0,
    )  # fmt: skip
    for _ in range(480):
        await worker._follow_lag()  # pyright: ignore[reportPrivateUsage]
        await asyncio.sleep(POLL)
    return [b - a for a, b in itertools.pairwise(source.asked)]


def spaced_by(spacings: list[float], seconds: float, cost: float) -> bool:
    """Whether every spacing is ``seconds``, give or take the reader's next poll."""
    return bool(spacings) and all(seconds <= s < seconds + cost + POLL for s in spacings)


async def handle_nothing(message: StreamMessage) -> None:
    pass


@pytest.mark.fake_clock
async def test_a_lag_slow_to_count_is_asked_for_less_often_over_all_partitions() -> None:
    # Counting a large backlog (PostgreSQL counts its unread rows) can take a good part of
    # a second. Asked every second by every partition, the counts would fill the connection
    # that reads and lease renewals go on: together they keep to LAG_SHARE of it.
    every = partition_module.LAG_INTERVAL
    assert spaced_by(await spacing_of_lag_questions(0.01, 4), every, 0.01)  # quick
    slow = 0.1 * 16 / partition_module.LAG_SHARE  # 16 partitions, 0.1 s each
    assert slow > 10 * every
    assert spaced_by(await spacing_of_lag_questions(0.1, 16), slow, 0.1)
    most = partition_module.LAG_INTERVAL_MOST  # but never less often than that
    assert spaced_by(await spacing_of_lag_questions(5.0, 16), most, 5.0)
    # A question that failed is asked again as soon as a quick one would be.
    assert spaced_by(await spacing_of_lag_questions(None, 16), every, 0)
