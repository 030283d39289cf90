"""Deadlock detection behind long chains of blocked holders.

A call queued behind a chain of holders, each waiting for the next one's key, must not
walk the whole chain on every registration (see ``keyserial._deadlock.unreachable``), and
must still report every cycle it closes, however the waiting task reaches back into the
chain: through a key it holds in a turn or a lock block (even one kept open by a
suspended async generator), or through a holder awaiting it directly or through gather.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import pytest

from keyserial import DeadlockError, KeyedSerialQueue

from .scheduling import settle

pytestmark = pytest.mark.asyncio

LENGTH = 40  # holders in the chain: far more nodes than the bounded walk visits
BOUND = 10.0


async def work() -> str:
    return "ran"


class Chain:
    """Holders 1..LENGTH: holder i holds key i and waits for key i + 1; the last runs ``end``."""

    def __init__(self, queue: KeyedSerialQueue, end: Callable[[], Awaitable[Any]]) -> None:
        self.queue = queue
        self.end = end
        self.tasks: list[asyncio.Task[Any]] = []

    async def build(self) -> None:
        queue = self.queue
        self.tasks.append(asyncio.create_task(queue.run(LENGTH, self.end)))
        await settle()
        for key in range(LENGTH - 1, 0, -1):
            nxt = key + 1
            self.tasks.append(asyncio.create_task(queue.run(key, queue.run, nxt, work)))
            await settle()
        assert all(queue.locked(key) for key in range(1, LENGTH + 1))

    async def outcomes(self) -> list[Any]:
        return await asyncio.wait_for(
            asyncio.gather(*self.tasks, return_exceptions=True), timeout=BOUND
        )

    async def refused_once(self, go: asyncio.Event) -> DeadlockError:
        """Build the chain, let its end close the cycle (``go``), and return the error its
        last holder got; every key is free afterwards."""
        await self.build()
        go.set()
        outcomes = await self.outcomes()
        assert isinstance(outcomes[0], DeadlockError)
        assert len(self.queue) == 0
        return outcomes[0]


async def test_calls_queued_behind_a_long_chain_are_accepted_and_ordered() -> None:
    queue = KeyedSerialQueue()
    release = asyncio.Event()
    chain = Chain(queue, release.wait)
    await chain.build()
    done: list[int] = []

    async def record(i: int) -> None:
        done.append(i)

    waiters = [asyncio.create_task(queue.run(1, record, i)) for i in range(50)]
    await settle()
    assert queue.pending(1) == 51  # the head's turn and the 50 waiting calls
    release.set()
    await asyncio.wait_for(asyncio.gather(*waiters), timeout=BOUND)
    assert done == list(range(50))
    assert all(outcome in (True, "ran") for outcome in await chain.outcomes())
    assert len(queue) == 0


async def test_a_holder_at_the_end_waiting_for_the_head_is_refused() -> None:
    queue = KeyedSerialQueue()
    go = asyncio.Event()

    async def end() -> str:
        await go.wait()
        return await queue.run(1, work)  # holds LENGTH, waits for 1: closes the chain

    error = await Chain(queue, end).refused_once(go)
    assert 1 in error.keys


BlockOf = Callable[[KeyedSerialQueue], contextlib.AbstractAsyncContextManager[Any]]


async def _closed_through_a_block(block_of: BlockOf) -> None:
    """A task holding key "x" in a block queues behind the chain whose end waits for "x"."""
    queue = KeyedSerialQueue()
    entered, go = asyncio.Event(), asyncio.Event()

    async def in_block() -> str:
        async with block_of(queue):
            entered.set()
            await go.wait()
            return await queue.run(1, work)

    async def end() -> str:
        await entered.wait()
        return await queue.run("x", work)

    holder = asyncio.create_task(in_block())
    await entered.wait()
    chain = Chain(queue, end)
    await chain.build()
    go.set()
    with pytest.raises(DeadlockError) as info:
        await asyncio.wait_for(holder, timeout=BOUND)
    assert info.value.keys[0] == 1
    assert "x" in info.value.keys
    await chain.outcomes()
    assert len(queue) == 0


async def test_a_waiter_holding_a_key_in_a_lock_block_is_refused() -> None:
    await _closed_through_a_block(lambda queue: queue.lock("x"))


async def test_a_waiter_holding_a_key_in_a_generator_kept_lock_block_is_refused() -> None:
    @contextlib.asynccontextmanager
    async def block(queue: KeyedSerialQueue) -> AsyncGenerator[None]:
        async with queue.lock("x"):  # the block's frame is the suspended generator's
            yield

    await _closed_through_a_block(block)


async def test_a_waiter_holding_keys_in_a_lock_all_block_is_refused() -> None:
    await _closed_through_a_block(lambda queue: queue.lock_all(["x", "y"]))


async def test_a_waiter_awaited_by_the_last_holder_is_refused() -> None:
    queue = KeyedSerialQueue()
    go = asyncio.Event()

    async def waiter() -> str:
        await go.wait()
        return await queue.run(1, work)

    child = asyncio.create_task(waiter())

    async def end() -> str:
        return await child  # holds LENGTH while awaiting the task that queues for 1

    await Chain(queue, end).refused_once(go)


async def test_a_waiter_gathered_by_the_last_holder_is_refused() -> None:
    queue = KeyedSerialQueue()
    go = asyncio.Event()

    async def waiter() -> str:
        await go.wait()
        return await queue.run(1, work)

    async def end() -> Any:
        return await asyncio.gather(waiter(), asyncio.sleep(0))

    await Chain(queue, end).refused_once(go)


async def test_a_waiter_started_by_the_last_holder_is_refused() -> None:
    # With an eager task factory, the child registers while the last holder is still in
    # the middle of the step that then awaits it.
    queue = KeyedSerialQueue()
    go = asyncio.Event()

    async def end() -> str:
        await go.wait()
        child = asyncio.get_running_loop().create_task(queue.run(1, work))
        return await child

    await Chain(queue, end).refused_once(go)


async def test_the_check_of_a_call_that_closes_no_cycle_does_not_walk_the_chain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from keyserial import _deadlock

    visited: list[object] = []
    edges = _deadlock._Search._edges  # pyright: ignore[reportPrivateUsage]

    def counting(search: Any, node: Any) -> Any:
        visited.append(node)
        return edges(search, node)

    queue = KeyedSerialQueue()
    release = asyncio.Event()
    chain = Chain(queue, release.wait)
    await chain.build()
    monkeypatch.setattr(_deadlock._Search, "_edges", counting)  # pyright: ignore[reportPrivateUsage]
    waiters = [asyncio.create_task(queue.run(1, work)) for _ in range(10)]
    await settle()
    assert queue.pending(1) == 11
    # A full walk visits two nodes (a holder and its waiter) per link: 80 per call. A
    # bounded one stops at its budget, and runs twice for a task started eagerly (once
    # as it registers, once after its creator's step).
    budget = _deadlock._FORWARD_BUDGET  # pyright: ignore[reportPrivateUsage]
    assert budget < LENGTH
    assert len(visited) <= 10 * 2 * budget
    release.set()
    await asyncio.wait_for(asyncio.gather(*waiters), timeout=BOUND)
    await chain.outcomes()
