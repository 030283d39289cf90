"""A stop asked for before run() is kept, and stats().lag counts unread messages live."""

from __future__ import annotations

import asyncio

import pytest

from keyserial.streams import KeyedStream, StreamMessage

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
