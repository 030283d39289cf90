"""Deadlock detection: the task that would close a cycle gets DeadlockError instead of a hang."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from keyserial import DeadlockError, KeyedSerialQueue

from .scheduling import settle

pytestmark = pytest.mark.asyncio


async def test_nested_single_keys_in_opposite_order() -> None:
    queue = KeyedSerialQueue()
    both_hold_one = asyncio.Event()
    holding: list[str] = []
    log: list[str] = []

    async def nested(first: str, second: str) -> str:
        async def inner() -> None:
            log.append(f"{first} then {second}")

        async def outer() -> None:
            holding.append(first)
            if len(holding) == 2:
                both_hold_one.set()
            await both_hold_one.wait()
            await queue.run(second, inner)

        await queue.run(first, outer)
        return first

    ab = asyncio.create_task(nested("a", "b"), name="ab")
    ba = asyncio.create_task(nested("b", "a"), name="ba")
    done, _ = await asyncio.wait([ab, ba], timeout=5)
    assert len(done) == 2
    errors = [t.exception() for t in (ab, ba) if t.exception() is not None]
    assert len(errors) == 1
    error = errors[0]
    assert isinstance(error, DeadlockError)
    assert sorted(map(str, error.keys)) == ["a", "b"]
    assert {t.get_name() for t in error.tasks} == {"ab", "ba"}  # type: ignore[attr-defined]
    assert "'ab'" in str(error) and "'ba'" in str(error)
    # The other task proceeded and finished its nested call.
    assert len(log) == 1
    assert len(queue) == 0


async def test_awaiting_a_child_that_queues_for_my_key() -> None:
    queue = KeyedSerialQueue()

    async def child_work() -> None:
        raise AssertionError("the child must not get the turn while its parent holds it")

    async def parent() -> None:
        child = asyncio.create_task(queue.run("k", child_work), name="child")
        await child  # the parent awaits a task that waits for the parent's own key

    with pytest.raises(
        DeadlockError, match=r"parent \(task .*\) awaits .*child_work \(task 'child'\)"
    ) as info:
        await asyncio.wait_for(queue.run("k", parent), timeout=5)
    assert info.value.keys == ["k"]
    assert len(queue) == 0


async def test_awaiting_a_submitted_task_for_my_key() -> None:
    queue = KeyedSerialQueue()

    async def work() -> str:
        return "ran"

    async def parent() -> None:
        await queue.submit("k", work)

    with pytest.raises(DeadlockError):
        await asyncio.wait_for(queue.run("k", parent), timeout=5)
    assert len(queue) == 0


async def test_three_task_cycle_through_multi_and_single_keys() -> None:
    queue = KeyedSerialQueue()
    ready = asyncio.Event()
    holders: list[str] = []

    async def hold_then_want(mine: str, wanted: list[str]) -> None:
        async def nothing() -> None:
            return None

        async def body() -> None:
            holders.append(mine)
            if len(holders) == 3:
                ready.set()
            await ready.wait()
            await queue.run_all(wanted, nothing)

        await queue.run(mine, body)

    tasks = [
        asyncio.create_task(hold_then_want("a", ["b"]), name="t1"),
        asyncio.create_task(hold_then_want("b", ["c", "x"]), name="t2"),
        asyncio.create_task(hold_then_want("c", ["a"]), name="t3"),
    ]
    done, _ = await asyncio.wait(tasks, timeout=5)
    assert len(done) == 3
    errors = [t.exception() for t in tasks if t.exception() is not None]
    assert len(errors) == 1 and isinstance(errors[0], DeadlockError)
    assert len(errors[0].tasks) == 3
    assert len(queue) == 0


async def test_plain_contention_is_not_a_deadlock() -> None:
    queue = KeyedSerialQueue()
    gate = asyncio.Event()

    async def hold() -> None:
        await gate.wait()

    async def parent() -> None:
        # A chain of holders waiting for each other that does not come back to us.
        async def noop() -> None:
            return None

        await queue.run("b", noop)

    holder = asyncio.create_task(queue.run("b", hold))
    await settle()
    waiter = asyncio.create_task(queue.run("a", parent))
    await settle()
    assert not waiter.done()
    gate.set()
    await asyncio.gather(holder, waiter)


async def test_detection_can_be_switched_off() -> None:
    queue = KeyedSerialQueue(detect_deadlocks=False)

    async def child_work() -> None:
        return None

    async def parent() -> None:
        await asyncio.create_task(queue.run("k", child_work))

    # Without detection the cycle is a plain hang, here cut short by the test's own timeout.
    with pytest.raises(asyncio.TimeoutError):  # not the built-in one before Python 3.11
        await asyncio.wait_for(queue.run("k", parent), timeout=0.05)
    await settle()
    assert len(queue) == 0


def _wait_for_k2(queue: KeyedSerialQueue, how: str) -> Callable[[], Awaitable[None]]:
    """A way of waiting for key "k2", with or without a timeout."""

    async def nothing() -> None:
        return None

    async def wait() -> None:
        if how == "run":
            await queue.run("k2", nothing)
        elif how == "call with timeout":
            await queue.with_options(timeout=30).run("k2", nothing)
        elif how == "lock":
            async with queue.lock("k2"):
                pass
        elif how == "lock with timeout":
            async with queue.lock("k2", timeout=30):
                pass
        else:
            await queue.submit("k2", nothing)

    return wait


@pytest.mark.parametrize("how", ["run", "call with timeout", "lock", "lock with timeout", "submit"])
async def test_a_cycle_through_any_kind_of_wait_is_found(how: str) -> None:
    # The cycle passes through a wait of each kind: an exact future whose frame says what it
    # waits for (run, lock), a waiter with a timer (call and lock with a timeout), a waiter
    # registered before its task started (submit). A wait with a timeout was once missed:
    # the second task hung until the first one's timeout.
    queue = KeyedSerialQueue()
    second_holds, first_waits = asyncio.Event(), asyncio.Event()
    wait_for_k2 = _wait_for_k2(queue, how)

    async def nothing() -> None:
        return None

    async def first() -> None:
        async def body() -> None:
            await second_holds.wait()
            first_waits.set()
            await wait_for_k2()

        await queue.run("k1", body)

    async def second() -> None:
        async def body() -> None:
            second_holds.set()
            await first_waits.wait()
            await settle()  # the first task now waits for k2, which this task holds
            await queue.run("k1", nothing)

        await queue.run("k2", body)

    one = asyncio.create_task(first(), name="first")
    two = asyncio.create_task(second(), name="second")
    with pytest.raises(DeadlockError) as caught:
        await asyncio.wait_for(two, timeout=5)
    assert [str(key) for key in caught.value.keys] == ["k1", "k2"]
    names = {t.get_name() for t in caught.value.tasks}  # type: ignore[attr-defined]
    # With submit, the first task awaits the submitted task, which waits for k2.
    assert {"first", "second"} <= names and len(names) == (3 if how == "submit" else 2)
    await asyncio.wait_for(one, timeout=5)  # it got k2 once the second task gave it up
    assert len(queue) == 0
