"""Deadlocks through the ways asyncio code waits for its children are reported, not hung.

A holder that waits for a child queued for the holder's own key can never finish: each
pattern below reaches the child differently (gather, TaskGroup, wait, shield, wait_for,
anyio task groups, eager tasks), and each must end in DeadlockError in the child, which
then fails the holder's wait, instead of a hang. Every test bounds the whole run, so a
regression fails with a timeout instead of hanging the suite.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

from keyserial import DeadlockError, KeyedSerialQueue

from .scheduling import settle

pytestmark = pytest.mark.asyncio

BOUND = 5.0  # seconds: far beyond any of these runs, short enough to fail instead of hang


async def work() -> str:
    return "ran"


async def bounded(awaitable: Awaitable[Any]) -> Any:
    return await asyncio.wait_for(awaitable, timeout=BOUND)


def child_error(outcome: BaseException) -> DeadlockError:
    """The DeadlockError inside ``outcome`` (itself, or the one an exception group holds)."""
    if isinstance(outcome, DeadlockError):
        return outcome
    inner: tuple[BaseException, ...] = getattr(outcome, "exceptions", ())
    assert len(inner) == 1, outcome
    return child_error(inner[0])


async def holder_waiting_through(
    wait_for_child: Callable[[KeyedSerialQueue], Awaitable[Any]],
) -> tuple[KeyedSerialQueue, DeadlockError]:
    """Run ``wait_for_child`` inside the turn of key "k"; return the DeadlockError it met."""
    queue = KeyedSerialQueue()

    async def parent() -> None:
        await wait_for_child(queue)

    with pytest.raises(BaseException) as info:  # DeadlockError, or a group holding it
        await bounded(queue.run("k", parent))
    return queue, child_error(info.value)


async def test_gather() -> None:
    async def through_gather(queue: KeyedSerialQueue) -> None:
        await asyncio.gather(queue.run("k", work))

    queue, error = await holder_waiting_through(through_gather)
    assert error.keys == ["k"]
    assert "through gather" in str(error)
    assert len(queue) == 0


async def test_gather_of_a_helper_that_queues() -> None:
    async def helper(queue: KeyedSerialQueue) -> str:
        return await queue.run("k", work)

    async def through_gather(queue: KeyedSerialQueue) -> None:
        await asyncio.gather(helper(queue), asyncio.sleep(0))

    queue, _ = await holder_waiting_through(through_gather)
    assert len(queue) == 0


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.TaskGroup is new in 3.11")
async def test_task_group() -> None:
    async def through_task_group(queue: KeyedSerialQueue) -> None:
        async with asyncio.TaskGroup() as group:  # type: ignore[attr-defined,unused-ignore]
            group.create_task(queue.run("k", work))

    queue, error = await holder_waiting_through(through_task_group)
    assert "through TaskGroup" in str(error)
    assert len(queue) == 0


async def test_anyio_task_group_on_asyncio() -> None:
    async def through_anyio(queue: KeyedSerialQueue) -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(queue.run, "k", work)

    queue, _ = await holder_waiting_through(through_anyio)
    assert len(queue) == 0


async def test_asyncio_wait_for_all() -> None:
    async def through_wait(queue: KeyedSerialQueue) -> None:
        done, _ = await asyncio.wait([asyncio.ensure_future(queue.run("k", work))])
        raise done.pop().exception()  # type: ignore[misc]

    queue, error = await holder_waiting_through(through_wait)
    assert "through asyncio.wait" in str(error)
    assert len(queue) == 0


async def test_shield() -> None:
    async def through_shield(queue: KeyedSerialQueue) -> None:
        await asyncio.shield(queue.run("k", work))

    queue, error = await holder_waiting_through(through_shield)
    assert "through shield" in str(error)
    assert len(queue) == 0


async def test_wait_for_with_a_timeout() -> None:
    async def through_wait_for(queue: KeyedSerialQueue) -> None:
        # A task: from 3.12 on, wait_for() runs a bare coroutine inline, in the holder's task
        # (which is re-entry, not a child).
        await asyncio.wait_for(asyncio.ensure_future(queue.run("k", work)), timeout=60)

    queue, _ = await holder_waiting_through(through_wait_for)
    assert len(queue) == 0


async def test_submitted_task_awaited_by_its_submitter() -> None:
    # The docs' own example; with eager tasks the child registers inside submit(), while
    # the holder still runs, and the cycle closes only when the holder suspends.
    async def awaiting_submitted(queue: KeyedSerialQueue) -> None:
        await queue.submit("k", work)

    queue, _ = await holder_waiting_through(awaiting_submitted)
    assert len(queue) == 0


async def test_created_task_awaited_by_its_creator() -> None:
    async def awaiting_created(queue: KeyedSerialQueue) -> None:
        await asyncio.create_task(queue.run("k", work))

    queue, _ = await holder_waiting_through(awaiting_created)
    assert len(queue) == 0


async def test_two_levels_of_helpers() -> None:
    async def middle(queue: KeyedSerialQueue) -> None:
        done, _ = await asyncio.wait([asyncio.ensure_future(queue.run("k", work))])
        raise done.pop().exception()  # type: ignore[misc]

    async def through_two_levels(queue: KeyedSerialQueue) -> None:
        await asyncio.gather(middle(queue))

    queue, _ = await holder_waiting_through(through_two_levels)
    assert len(queue) == 0


async def test_a_try_lock_never_waits_so_it_times_out_instead_of_reporting_a_deadlock() -> None:
    # timeout=0 never waits, so it closes no cycle: a held key is a TimeoutError at once,
    # even when its holder awaits the trying task (as anyio's acquire_nowait raises
    # WouldBlock). A wait with a positive timeout still reports the cycle.
    queue = KeyedSerialQueue()
    tried: list[str] = []

    async def try_lock() -> None:
        with pytest.raises(TimeoutError, match="timeout=0"):
            async with queue.lock("k", timeout=0):
                raise AssertionError("the child must not get the turn its parent holds")
        with pytest.raises(TimeoutError, match="timeout=0"):
            async with queue.lock_all(["k", "other"], timeout=0):
                raise AssertionError("the child must not get the turn its parent holds")
        with pytest.raises(TimeoutError, match="timeout=0"):
            await queue.with_options(timeout=0).run("k", work)
        tried.append("tried")

    async def parent() -> None:
        await asyncio.gather(try_lock())

    await bounded(queue.run("k", parent))
    assert tried == ["tried"]
    assert len(queue) == 0
    assert queue.stats().timed_out == 3

    async def wait_a_little(other: KeyedSerialQueue) -> None:
        async with other.lock("k", timeout=5):
            raise AssertionError("the child must not get the turn its parent holds")

    async def through_gather(other: KeyedSerialQueue) -> None:
        await asyncio.gather(wait_a_little(other))

    other, error = await holder_waiting_through(through_gather)
    assert error.keys == ["k"]
    assert len(other) == 0


async def test_the_error_names_the_functions_involved() -> None:
    queue = KeyedSerialQueue()

    async def finalize_segment() -> None:
        await asyncio.gather(queue.run("seg-1", work))

    with pytest.raises(DeadlockError) as info:
        await bounded(queue.run("seg-1", finalize_segment))
    message = str(info.value)
    assert "work (task " in message
    assert "finalize_segment (task " in message
    assert "waits for key 'seg-1' held by" in message
    assert "Task-" not in message.split("(task")[0]


async def test_cycle_through_a_key_and_a_gather() -> None:
    # a's holder awaits a child that wants "b"; b's holder wants "a": a three-edge cycle.
    queue = KeyedSerialQueue()
    both_held = asyncio.Event()
    held: list[str] = []

    async def hold_then(mine: str, then: Callable[[], Awaitable[Any]]) -> None:
        async def body() -> None:
            held.append(mine)
            if len(held) == 2:
                both_held.set()
            await both_held.wait()
            await then()

        await queue.run(mine, body)

    async def a_side() -> None:
        await asyncio.gather(queue.run("b", work))

    async def b_side() -> None:
        await settle()  # a's child queues for "b" first
        await queue.run("a", work)

    first = asyncio.create_task(hold_then("a", a_side))
    second = asyncio.create_task(hold_then("b", b_side))
    done, _ = await asyncio.wait([first, second], timeout=BOUND)
    assert len(done) == 2
    errors = [task.exception() for task in (first, second) if task.exception() is not None]
    assert len(errors) == 1 and isinstance(errors[0], DeadlockError)
    assert sorted(map(str, errors[0].keys)) == ["a", "b"]
    assert len(queue) == 0


async def test_wait_for_the_first_of_a_child_and_a_free_task_is_not_a_deadlock() -> None:
    # FIRST_COMPLETED over the child and a task that can finish: the holder will resume
    # when the other finishes, release the key, and the child then runs.
    queue = KeyedSerialQueue()
    release = asyncio.Event()
    log: list[str] = []

    async def child_work() -> None:
        log.append("child ran")

    async def parent() -> None:
        child = asyncio.ensure_future(queue.run("k", child_work))
        other = asyncio.ensure_future(release.wait())
        await asyncio.wait([child, other], return_when=asyncio.FIRST_COMPLETED)
        log.append("parent resumed")

    holder = asyncio.create_task(queue.run("k", parent))
    await settle()
    assert not holder.done() and log == []
    release.set()
    await bounded(holder)
    await bounded(queue.join())
    assert log == ["parent resumed", "child ran"]


async def test_gather_of_a_child_waiting_for_another_holder_is_not_a_deadlock() -> None:
    queue = KeyedSerialQueue()
    gate = asyncio.Event()

    async def hold_other() -> None:
        await gate.wait()

    async def parent() -> None:
        await asyncio.gather(queue.run("other", work))

    other = asyncio.create_task(queue.run("other", hold_other))
    await settle()
    holder = asyncio.create_task(queue.run("k", parent))
    await settle()
    assert not holder.done()
    gate.set()
    await bounded(asyncio.gather(other, holder))
    assert len(queue) == 0


async def test_a_holder_seen_blocked_elsewhere_is_walked_again_once_it_waits_on_its_child() -> None:
    # Calls queued behind a holder blocked on an event find a dead end, which the check
    # remembers; once the holder resumes and gathers a child queued for its own key, the
    # remembered dead end must not hide the cycle.
    queue = KeyedSerialQueue()
    event = asyncio.Event()

    async def parent() -> None:
        await event.wait()
        await asyncio.gather(queue.run("k", work))

    holder = asyncio.create_task(queue.run("k", parent))
    await settle()
    behind = asyncio.create_task(queue.run("k", work))  # registers behind the dead end
    await settle()
    assert queue.pending("k") == 2
    event.set()
    with pytest.raises(DeadlockError) as info:
        await bounded(holder)
    assert "parent" in str(info.value)
    assert await bounded(behind) == "ran"
