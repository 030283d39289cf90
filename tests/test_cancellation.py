"""Cancellation and wait timeouts never wedge a key or disturb the others' order."""

from __future__ import annotations

import asyncio

import pytest

from keyserial import KeyedSerialQueue

from .conftest import RunInTurn
from .scheduling import Recorder, settle

pytestmark = pytest.mark.asyncio


async def test_cancelled_waiter_never_starts_and_order_is_kept(run_in_turn: RunInTurn) -> None:
    queue, rec = KeyedSerialQueue(), Recorder()
    tasks = {n: asyncio.create_task(run_in_turn(queue, "k", rec.step, n)) for n in "abcd"}
    await settle()
    tasks["b"].cancel()
    await settle()
    assert tasks["b"].cancelled()
    assert queue.pending("k") == 3
    for n in "acd":
        rec.gate(n).set()
    await asyncio.gather(tasks["a"], tasks["c"], tasks["d"])
    assert rec.log == ["start a", "end a", "start c", "end c", "start d", "end d"]
    assert len(queue) == 0


async def test_cancelling_the_running_call_passes_the_turn_when_it_exits(
    run_in_turn: RunInTurn,
) -> None:
    queue, rec = KeyedSerialQueue(), Recorder()
    first = asyncio.create_task(run_in_turn(queue, "k", rec.step, "a"))
    second = asyncio.create_task(run_in_turn(queue, "k", rec.step, "b"))
    await settle()
    first.cancel()
    await settle()
    assert first.cancelled()
    assert rec.log == ["start a", "end a", "start b"]
    rec.gate("b").set()
    assert await second == "b"
    assert len(queue) == 0


async def test_hand_off_race_cancelled_after_grant_passes_the_turn_on(
    run_in_turn: RunInTurn,
) -> None:
    queue, rec = KeyedSerialQueue(), Recorder()
    first = asyncio.create_task(run_in_turn(queue, "k", rec.step, "a"))
    second = asyncio.create_task(run_in_turn(queue, "k", rec.step, "b"))
    third = asyncio.create_task(run_in_turn(queue, "k", rec.step, "c"))
    await settle()
    # Release a and, before b's task resumes with the granted turn, cancel it.
    rec.gate("a").set()
    await asyncio.sleep(0)  # a finishes and hands the turn to b
    assert first.done() and not second.done()
    assert queue.locked("k")
    second.cancel()
    await settle()
    assert second.cancelled()
    assert rec.log == ["start a", "end a", "start c"]
    rec.gate("c").set()
    assert await third == "c"
    assert len(queue) == 0


async def test_hand_off_race_with_no_one_behind_frees_the_key(run_in_turn: RunInTurn) -> None:
    queue, rec = KeyedSerialQueue(), Recorder()
    first = asyncio.create_task(run_in_turn(queue, "k", rec.step, "a"))
    second = asyncio.create_task(run_in_turn(queue, "k", rec.step, "b"))
    await settle()
    rec.gate("a").set()
    await asyncio.sleep(0)
    second.cancel()
    await settle()
    assert first.done() and second.cancelled()
    assert len(queue) == 0
    assert not queue.locked("k")


async def test_cancelled_waiter_whose_turn_came_meanwhile(run_in_turn: RunInTurn) -> None:
    # The waiter is cancelled, then the holder releases in the same loop iteration
    # before the waiter's task resumes: the dead waiter must be skipped.
    queue, rec = KeyedSerialQueue(), Recorder()
    first = asyncio.create_task(run_in_turn(queue, "k", rec.step, "a"))
    second = asyncio.create_task(run_in_turn(queue, "k", rec.step, "b"))
    third = asyncio.create_task(run_in_turn(queue, "k", rec.step, "c"))
    await settle()
    second.cancel()
    rec.gate("a").set()
    await settle()
    assert second.cancelled()
    assert rec.log == ["start a", "end a", "start c"]
    rec.gate("c").set()
    await asyncio.gather(first, third)
    assert len(queue) == 0


async def test_submitted_task_cancelled_before_it_starts_leaves_no_trace() -> None:
    queue, rec = KeyedSerialQueue(), Recorder()
    holder = queue.submit("k", rec.step, "h")
    first = queue.submit("k", rec.step, "a")
    first.cancel()  # before its first step (with eager tasks: while it waits for its turn)
    second = queue.submit("k", rec.step, "b")
    third = queue.submit("k", rec.step, "c")
    third.cancel()
    await settle()
    assert first.cancelled() and third.cancelled()
    assert queue.pending("k") == 2
    rec.gate("h").set()
    await settle()
    assert rec.log == ["start h", "end h", "start b"]
    rec.gate("b").set()
    assert await holder == "h" and await second == "b"
    assert len(queue) == 0


async def test_submitted_task_granted_then_cancelled_before_starting() -> None:
    queue = KeyedSerialQueue()
    log: list[str] = []

    async def quick(name: str) -> None:
        log.append(name)

    async with queue.lock("k"):
        second = queue.submit("k", quick, "b")
        third = queue.submit("k", quick, "c")
    # Leaving the block handed the turn to b, whose task has not taken a step yet.
    assert queue.locked("k")
    second.cancel()
    await settle()
    assert second.cancelled()
    assert log == ["c"]
    assert third.done()
    assert len(queue) == 0


async def test_timeout_bounds_only_the_wait(run_in_turn: RunInTurn) -> None:
    queue, rec = KeyedSerialQueue(), Recorder()
    holder = asyncio.create_task(run_in_turn(queue, "k", rec.step, "holder"))
    await settle()

    async def never_runs() -> None:
        raise AssertionError("a timed-out call must not start")

    with pytest.raises(TimeoutError, match="'k'"):
        await queue.with_options(timeout=0).run("k", never_runs)
    with pytest.raises(TimeoutError):
        async with queue.lock("k", timeout=0.001):
            raise AssertionError("a timed-out lock must not be entered")
    assert queue.pending("k") == 1
    behind = asyncio.create_task(run_in_turn(queue, "k", rec.step, "behind"))
    await settle()
    rec.gate("holder").set()
    rec.gate("behind").set()
    await asyncio.gather(holder, behind)
    assert rec.log == ["start holder", "end holder", "start behind", "end behind"]
    assert len(queue) == 0


async def test_timeout_does_not_fire_when_the_turn_comes_in_time(run_in_turn: RunInTurn) -> None:
    queue, rec = KeyedSerialQueue(), Recorder()
    holder = asyncio.create_task(run_in_turn(queue, "k", rec.step, "holder"))
    await settle()
    waiter = asyncio.create_task(queue.with_options(timeout=3600).run("k", rec.step, "waiter"))
    await settle()
    rec.gate("holder").set()
    rec.gate("waiter").set()
    assert await waiter == "waiter"
    await holder
    # A long running call is not cut by the wait timeout once it started.
    queue2, rec2 = KeyedSerialQueue(), Recorder()
    running = asyncio.create_task(queue2.with_options(timeout=0).run("k", rec2.step, "slow"))
    await settle()
    assert rec2.log == ["start slow"]
    rec2.gate("slow").set()
    assert await running == "slow"


async def test_external_cancel_wins_over_an_expired_timeout(run_in_turn: RunInTurn) -> None:
    queue, rec = KeyedSerialQueue(), Recorder()
    holder = asyncio.create_task(run_in_turn(queue, "k", rec.step, "holder"))
    await settle()
    # The smallest wait that still waits (timeout=0 is a try, which never registers).
    waiter = asyncio.create_task(queue.with_options(timeout=1e-9).run("k", rec.step, "w"))
    await asyncio.sleep(0)  # the waiter registers and its timer is armed
    await asyncio.sleep(0)  # the timer fires: the waiter is woken as timed out
    waiter.cancel()  # ... and cancelled before it resumes
    with pytest.raises(asyncio.CancelledError):
        await waiter
    rec.gate("holder").set()
    await holder
    assert len(queue) == 0


async def test_cancelling_many_waiters_leaves_the_queue_empty(run_in_turn: RunInTurn) -> None:
    queue, rec = KeyedSerialQueue(), Recorder()
    holder = asyncio.create_task(run_in_turn(queue, "k", rec.step, "holder"))
    await settle()
    waiters = [asyncio.create_task(run_in_turn(queue, "k", rec.step, f"w{i}")) for i in range(2000)]
    await settle()
    assert queue.pending("k") == 2001
    for task in waiters[::2]:
        task.cancel()
    await settle()
    assert queue.pending("k") == 1001
    for i in range(1, 2000, 2):
        rec.gate(f"w{i}").set()
    rec.gate("holder").set()
    await asyncio.gather(holder, *waiters[1::2])
    starts = [entry for entry in rec.log if entry.startswith("start")]
    assert starts == ["start holder"] + [f"start w{i}" for i in range(1, 2000, 2)]
    assert len(queue) == 0


async def test_base_exceptions_propagate_and_release_the_turn(run_in_turn: RunInTurn) -> None:
    queue = KeyedSerialQueue()

    async def interrupt() -> None:
        raise KeyboardInterrupt

    async def exit_() -> None:
        raise SystemExit(3)

    async def fine() -> str:
        return "fine"

    with pytest.raises(KeyboardInterrupt):
        await run_in_turn(queue, "k", interrupt)
    with pytest.raises(SystemExit):
        async with queue.lock("k"):
            raise SystemExit(2)
    with pytest.raises(SystemExit):
        await run_in_turn(queue, "k", exit_)
    assert len(queue) == 0
    assert await run_in_turn(queue, "k", fine) == "fine"


async def test_newcomer_takes_a_free_turn_while_a_dead_waiter_is_still_counted(
    run_in_turn: RunInTurn,
) -> None:
    # Found by the random-schedule test: the holder releases while the only waiter has
    # been cancelled but not resumed; a call registering right then must not wait.
    queue, rec = KeyedSerialQueue(), Recorder()
    async with queue.lock("k"):
        waiter = asyncio.create_task(run_in_turn(queue, "k", rec.step, "cancelled"))
        await settle()
        waiter.cancel()
    # Registered synchronously, before the cancelled waiter resumes; the timeout turns
    # the old hang into a failure.
    async with queue.lock("k", timeout=5):
        rec.log.append("newcomer")
    await settle()
    assert waiter.cancelled()
    assert rec.log == ["newcomer"]
    assert len(queue) == 0
