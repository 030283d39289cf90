"""What a waiting call waits for, read off its frame when it awaits a plain future."""

from __future__ import annotations

import asyncio

import pytest

from keyserial import KeyedSerialQueue
from keyserial._deadlock import turn_wait_of_task

from .scheduling import settle

pytestmark = pytest.mark.asyncio


async def test_a_wait_without_timeout_is_an_exact_future_and_says_what_it_waits_for() -> None:
    # asyncio's C task takes its fast path only for an exact Future; a subclass as the
    # waiter made every contended hand-off dearer (benchmarks: contended-100).
    queue = KeyedSerialQueue()
    gate = asyncio.Event()

    async def hold() -> None:
        await gate.wait()

    async def locked() -> None:
        async with queue.lock("b"):
            pass

    holders = [asyncio.create_task(queue.run(key, hold)) for key in ("a", "b")]
    await settle()
    waiting_run = asyncio.create_task(queue.run("a", hold))
    waiting_lock = asyncio.create_task(locked())
    await settle()
    for task, key in ((waiting_run, "a"), (waiting_lock, "b")):
        assert type(task._fut_waiter) is asyncio.Future  # type: ignore[attr-defined]
        found = turn_wait_of_task(task)
        assert found is not None and found.keys == (key,)
        assert found.since <= asyncio.get_running_loop().time()
    assert turn_wait_of_task(holders[0]) is None  # blocked on an event, not on a turn
    gate.set()
    await asyncio.gather(*holders, waiting_run, waiting_lock)


async def test_the_remembered_answer_is_not_reused_for_a_new_wait() -> None:
    # The last answer is remembered with the future it was read for: the same task waiting
    # again, for another key, must be read anew.
    queue = KeyedSerialQueue()
    gates = {"a": asyncio.Event(), "b": asyncio.Event()}

    async def hold(key: str) -> None:
        await gates[key].wait()

    async def nothing() -> None:
        return None

    async def one_then_other() -> None:
        await queue.run("a", nothing)
        await queue.run("b", nothing)

    holders = [asyncio.create_task(queue.run(key, hold, key)) for key in ("a", "b")]
    await settle()
    waiter = asyncio.create_task(one_then_other())
    await settle()
    first = turn_wait_of_task(waiter)
    assert first is not None and first.keys == ("a",)
    gates["a"].set()
    await settle()
    second = turn_wait_of_task(waiter)
    assert second is not None and second.keys == ("b",)
    gates["b"].set()
    await asyncio.gather(*holders, waiter)
