"""Timeouts and durations on a fake clock: exact, and independent of the machine's speed."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from keyserial import KeyedSerialQueue, QueueObserver

from .scheduling import Recorder, settle

pytestmark = [pytest.mark.asyncio, pytest.mark.fake_clock]


async def test_the_clock_jumps_to_the_next_timer() -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    await asyncio.sleep(3600)
    assert loop.time() - start == 3600


async def test_a_wait_times_out_exactly_at_its_timeout() -> None:
    loop = asyncio.get_running_loop()
    queue, rec = KeyedSerialQueue(), Recorder()
    holder = asyncio.create_task(queue.run("k", rec.step, "holder"))
    await settle()
    start = loop.time()
    waiter = asyncio.create_task(queue.with_options(timeout=5).run("k", rec.step, "waiter"))
    await asyncio.sleep(4.999)
    assert not waiter.done()
    with pytest.raises(TimeoutError):
        await waiter
    assert loop.time() - start == 5
    assert queue.stats().timed_out == 1
    rec.gate("holder").set()
    await holder
    assert rec.log == ["start holder", "end holder"]
    assert len(queue) == 0


async def test_a_timeout_does_not_cut_a_turn_that_came_in_time() -> None:
    queue, rec = KeyedSerialQueue(), Recorder()
    holder = asyncio.create_task(queue.run("k", rec.step, "holder"))
    await settle()
    waiter = asyncio.create_task(queue.with_options(timeout=5).run("k", rec.step, "waiter"))
    await asyncio.sleep(4)
    rec.gate("holder").set()
    await asyncio.sleep(10)  # the waiter runs past its wait timeout: not cut
    assert rec.log == ["start holder", "end holder", "start waiter"]
    rec.gate("waiter").set()
    assert await waiter == "waiter"
    await holder


async def test_stats_durations_are_exact() -> None:
    queue = KeyedSerialQueue()
    gate = asyncio.Event()

    async def hold() -> None:
        await gate.wait()

    holder = asyncio.create_task(queue.run("k", hold))
    await settle()
    first = asyncio.create_task(queue.run("k", hold))  # contended from here on
    await asyncio.sleep(2)
    second = asyncio.create_task(queue.run("other", hold))
    late = asyncio.create_task(queue.run("other", hold))
    await asyncio.sleep(3)
    stats = queue.stats()
    assert stats.longest_wait == ("k", 5)  # the first waiter, registered five seconds ago
    assert stats.longest_running == ("k", 5)  # timed from when the first call queued
    gate.set()
    await asyncio.gather(holder, first, second, late)


async def test_observer_durations_and_slow_turn_warnings_are_exact(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Durations(QueueObserver):
        def __init__(self) -> None:
            self.seen: list[tuple[str, float, float | None]] = []

        def on_finish(
            self, key: object, function: str, waited: float, ran: float | None, outcome: str
        ) -> None:
            self.seen.append((outcome, waited, ran))

    observer = Durations()
    queue = KeyedSerialQueue(observer=observer, slow_turn=30)

    async def work(seconds: float) -> None:
        await asyncio.sleep(seconds)

    with caplog.at_level(logging.WARNING, logger="keyserial"):
        first = asyncio.create_task(queue.run("k", work, 20))
        await settle()
        second = asyncio.create_task(queue.run("k", work, 40))
        await asyncio.gather(first, second)
    assert observer.seen == [("completed", 0, 20), ("completed", 20, 40)]
    assert [r.getMessage() for r in caplog.records] == [
        "keyserial: test_observer_durations_and_slow_turn_warnings_are_exact.<locals>.work "
        "has held the turn of key 'k' for more than 30 s"
    ]


async def test_a_share_reads_the_clock_its_loop_reads() -> None:
    from keyserial._clock import loop_clock

    loop = asyncio.new_event_loop()
    try:
        # asyncio's own loop.time() is time.monotonic(): the share calls that directly.
        assert loop_clock(loop) is time.monotonic
        loop.time = lambda: 42.0  # type: ignore[method-assign]  # a clock set on the loop
        assert loop_clock(loop)() == 42.0
    finally:
        loop.close()

    class OwnClock(asyncio.SelectorEventLoop):
        def time(self) -> float:
            return 7.0

    own = OwnClock()
    try:
        assert loop_clock(own)() == 7.0
    finally:
        own.close()
