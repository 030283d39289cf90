"""stats(), observer hooks and slow-turn warnings."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Hashable

import pytest

from keyserial import (
    KeyedSerialQueue,
    QueueFull,
    QueueObserver,
    QueueStats,
    Superseded,
    current_fence,
    serialized,
)

from .scheduling import settle

pytestmark = pytest.mark.asyncio


@pytest.mark.parametrize("count_calls", [True, False])
async def test_stats_counts_every_kind_of_outcome(count_calls: bool) -> None:
    queue = KeyedSerialQueue(max_pending=4, count_calls=count_calls)
    gate = asyncio.Event()

    async def hold() -> None:
        await gate.wait()

    async def ok() -> str:
        return "ok"

    async def boom() -> None:
        raise ValueError("boom")

    assert await queue.run("a", ok) == "ok"
    with pytest.raises(ValueError):
        await queue.run("a", boom)
    holder = asyncio.create_task(queue.run("k", hold))
    await settle()
    waiter = asyncio.create_task(queue.run("k", ok))
    coalesced = asyncio.create_task(queue.with_options(group="g").run("k", ok))
    await settle()
    superseding = asyncio.create_task(queue.with_options(group="g").run("k", ok))
    await settle()
    with pytest.raises(Superseded):
        await coalesced
    with pytest.raises(TimeoutError):
        await queue.with_options(timeout=0).run("k", ok)
    extra = asyncio.create_task(queue.run("k", ok))
    await settle()
    with pytest.raises(QueueFull):
        await queue.run("k", ok)
    extra.cancel()
    await settle()

    stats = queue.stats()
    assert isinstance(stats, QueueStats)
    assert (stats.keys, stats.running, stats.waiting) == (1, 1, 2)
    counted = (3, 1) if count_calls else (None, None)
    assert (stats.started, stats.completed, stats.failed) == (*counted, 1)
    assert (stats.cancelled, stats.timed_out, stats.rejected, stats.superseded) == (1, 1, 1, 1)
    assert stats.longest_running is not None and stats.longest_running[0] == "k"
    assert stats.longest_wait is not None and stats.longest_wait[0] == "k"
    with pytest.raises(AttributeError):
        stats.keys = 5  # type: ignore[misc]

    gate.set()
    await asyncio.gather(holder, waiter, superseding)
    final = queue.stats()
    assert (final.keys, final.running, final.waiting) == (0, 0, 0)
    counted = (5, 4) if count_calls else (None, None)
    assert (final.started, final.completed, final.failed) == (*counted, 1)
    assert final.longest_wait is None and final.longest_running is None


async def _wait_by(queue: KeyedSerialQueue, how: str, key: str) -> None:
    async def nothing() -> None:
        return None

    if how == "run":
        await queue.run(key, nothing)
    elif how == "call with timeout":
        await queue.with_options(timeout=60).run(key, nothing)
    elif how == "lock":
        async with queue.lock(key):
            pass
    elif how == "lock with timeout":
        async with queue.lock(key, timeout=60):
            pass
    elif how == "run_all":
        await queue.run_all([key, "other"], nothing)
    else:
        await queue.submit(key, nothing)


@pytest.mark.fake_clock
@pytest.mark.parametrize(
    "how", ["run", "call with timeout", "lock", "lock with timeout", "run_all", "submit"]
)
async def test_stats_longest_wait_is_the_oldest_waiter_of_any_kind(how: str) -> None:
    # A run or lock without a timeout waits on a plain future: its registration time is
    # read off the waiting frame. The others carry it.
    queue = KeyedSerialQueue()
    gate = asyncio.Event()

    async def hold() -> None:
        await gate.wait()

    holders = [asyncio.create_task(queue.run(k, hold)) for k in ("early", "late")]
    await settle()
    early = asyncio.create_task(_wait_by(queue, how, "early"))
    await asyncio.sleep(2)  # on the fake clock
    late = asyncio.create_task(queue.run("late", hold))
    await settle()
    stats = queue.stats()
    assert stats.longest_wait == ("early", 2)  # the oldest waiter, whatever its kind
    assert stats.waiting == 2
    gate.set()
    await asyncio.gather(*holders, early, late)


class Recording(QueueObserver):
    def __init__(self) -> None:
        self.events: list[tuple[object, ...]] = []

    def on_register(self, key: Hashable, function: str) -> None:
        self.events.append(("register", key, function))

    def on_start(self, key: Hashable, function: str, waited: float) -> None:
        assert waited >= 0
        self.events.append(("start", key, function))

    def on_finish(
        self, key: Hashable, function: str, waited: float, ran: float | None, outcome: str
    ) -> None:
        assert waited >= 0 and (ran is None or ran >= 0)
        self.events.append(("finish", key, function, outcome, ran is None))


async def test_observer_sees_register_start_and_finish() -> None:
    observer = Recording()
    queue = KeyedSerialQueue(observer=observer, max_pending=2)
    gate = asyncio.Event()

    async def hold() -> None:
        await gate.wait()

    async def fail() -> None:
        raise KeyError("x")

    @serialized(key="k", queue=queue)
    async def decorated(k: str) -> str:
        return k

    holder = asyncio.create_task(queue.run("k", hold))
    await settle()
    waiter = asyncio.create_task(queue.run("k", fail))
    await settle()
    with pytest.raises(QueueFull):
        await queue.run("k", hold)
    gate.set()
    await holder
    with pytest.raises(KeyError):
        await waiter
    assert await decorated("d") == "d"
    async with queue.lock("l"):
        pass
    await queue.submit("s", hold)
    assert observer.events == [
        ("register", "k", "test_observer_sees_register_start_and_finish.<locals>.hold"),
        ("start", "k", "test_observer_sees_register_start_and_finish.<locals>.hold"),
        ("register", "k", "test_observer_sees_register_start_and_finish.<locals>.fail"),
        ("register", "k", "test_observer_sees_register_start_and_finish.<locals>.hold"),
        (
            "finish",
            "k",
            "test_observer_sees_register_start_and_finish.<locals>.hold",
            "rejected",
            True,
        ),
        (
            "finish",
            "k",
            "test_observer_sees_register_start_and_finish.<locals>.hold",
            "completed",
            False,
        ),
        ("start", "k", "test_observer_sees_register_start_and_finish.<locals>.fail"),
        (
            "finish",
            "k",
            "test_observer_sees_register_start_and_finish.<locals>.fail",
            "failed",
            False,
        ),
        ("register", "d", "test_observer_sees_register_start_and_finish.<locals>.decorated"),
        ("start", "d", "test_observer_sees_register_start_and_finish.<locals>.decorated"),
        (
            "finish",
            "d",
            "test_observer_sees_register_start_and_finish.<locals>.decorated",
            "completed",
            False,
        ),
        ("register", "l", "lock"),
        ("start", "l", "lock"),
        ("finish", "l", "lock", "completed", False),
        ("register", "s", "test_observer_sees_register_start_and_finish.<locals>.hold"),
        ("start", "s", "test_observer_sees_register_start_and_finish.<locals>.hold"),
        (
            "finish",
            "s",
            "test_observer_sees_register_start_and_finish.<locals>.hold",
            "completed",
            False,
        ),
    ]
    assert len(queue) == 0


async def test_a_failing_observer_never_breaks_the_queue(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(QueueObserver):
        def on_start(self, key: Hashable, function: str, waited: float) -> None:
            raise RuntimeError("observer bug")

    queue = KeyedSerialQueue(observer=Broken())

    async def work() -> str:
        return "still works"

    with caplog.at_level(logging.ERROR, logger="keyserial"):
        assert await queue.run("k", work) == "still works"
    assert "observer" in caplog.text and "on_start" in caplog.text
    assert len(queue) == 0


async def test_slow_turn_logs_one_warning_naming_key_and_function(
    caplog: pytest.LogCaptureFixture,
) -> None:
    queue = KeyedSerialQueue(slow_turn=0.001)
    release = asyncio.Event()

    async def stuck_handler() -> None:
        await release.wait()

    async def quick() -> None:
        return None

    warned = asyncio.Event()

    class SetOnRecord(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warned.set()  # emitted by the loop's timer, in the loop's thread

    handler = SetOnRecord()
    logging.getLogger("keyserial").addHandler(handler)
    try:
        with caplog.at_level(logging.WARNING, logger="keyserial"):
            task = asyncio.create_task(queue.run("seg-9", stuck_handler))
            await warned.wait()
            release.set()
            await task
            await queue.run("seg-1", quick)
    finally:
        logging.getLogger("keyserial").removeHandler(handler)
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert "seg-9" in message and "stuck_handler" in message
    assert queue.stats().longest_running is None


async def test_observed_queue_times_uncontended_turns_exactly() -> None:
    queue = KeyedSerialQueue(observer=QueueObserver())
    gate = asyncio.Event()

    async def hold() -> None:
        await gate.wait()

    task = asyncio.create_task(queue.run("alone", hold))
    await settle()
    stats = queue.stats()
    assert stats.longest_running is not None and stats.longest_running[0] == "alone"
    gate.set()
    await task


async def test_bad_slow_turn_is_rejected() -> None:
    with pytest.raises(ValueError, match="slow_turn"):
        KeyedSerialQueue(slow_turn=0)


async def test_stats_count_a_multi_key_call_collecting_keys_as_waiting() -> None:
    queue = KeyedSerialQueue(count_calls=True)
    gate = asyncio.Event()

    async def hold() -> None:
        await gate.wait()

    holder = asyncio.create_task(queue.run("b", hold))
    await settle()
    merge = asyncio.create_task(queue.run_all(["a", "b"], hold))
    await settle()
    stats = queue.stats()
    assert (stats.keys, stats.running, stats.waiting) == (2, 1, 1)
    assert stats.longest_running is not None and stats.longest_running[0] == "b"
    gate.set()
    await asyncio.gather(holder, merge)
    assert queue.stats().started == 2


async def test_counting_covers_every_way_of_taking_a_turn() -> None:
    queue = KeyedSerialQueue(count_calls=True)

    async def ok() -> None:
        pass

    async def fenced() -> int:
        return current_fence()

    await queue.run("a", ok)
    await queue.run("a", ok)
    await queue.submit("a", ok)
    await queue.run_all(["a", "b"], ok)
    async with queue.lock("a"):
        pass
    async with queue.lock_all(["a", "b"]):
        pass
    assert queue.stats().started == 6
    # A fence handed out, then dropped at the turn's end, must not switch counting off
    # for the uncontended calls that follow.
    await queue.run("a", fenced)
    joined = asyncio.create_task(queue.join())
    await queue.run("b", ok)
    await joined
    await queue.run("a", ok)
    stats = queue.stats()
    assert (stats.started, stats.completed, stats.failed) == (9, 9, 0)


async def test_a_queue_not_counting_calls_still_counts_failures_and_cancellations() -> None:
    queue = KeyedSerialQueue()
    gate = asyncio.Event()

    async def boom() -> None:
        raise ValueError("boom")

    async def hold() -> None:
        await gate.wait()

    with pytest.raises(ValueError):
        await queue.run("a", boom)
    running = asyncio.create_task(queue.run("a", hold))
    await settle()
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    stats = queue.stats()
    assert (stats.started, stats.completed) == (None, None)
    assert (stats.failed, stats.cancelled) == (1, 1)
