"""The contract users rely on: order per key, concurrency across keys, failure isolation."""

from __future__ import annotations

import asyncio

import pytest

from keyserial import KeyedSerialQueue, QueueClosed

from .conftest import RunInTurn
from .scheduling import settle

pytestmark = pytest.mark.asyncio


async def test_same_key_runs_serially_in_registration_order(run_in_turn: RunInTurn) -> None:
    queue = KeyedSerialQueue()
    log: list[str] = []
    gates = {name: asyncio.Event() for name in "abc"}

    async def step(name: str) -> str:
        log.append(f"start {name}")
        await gates[name].wait()
        log.append(f"end {name}")
        return name

    tasks = [asyncio.create_task(run_in_turn(queue, "seg", step, name)) for name in "abc"]
    await settle()
    assert log == ["start a"]
    assert queue.pending("seg") == 3
    # Release in reverse order: b and c must still wait for a.
    gates["c"].set()
    gates["b"].set()
    await settle()
    assert log == ["start a"]
    gates["a"].set()
    assert await asyncio.gather(*tasks) == ["a", "b", "c"]
    assert log == ["start a", "end a", "start b", "end b", "start c", "end c"]
    assert len(queue) == 0


async def test_different_keys_overlap(run_in_turn: RunInTurn) -> None:
    queue = KeyedSerialQueue()
    started: list[str] = []
    gate = asyncio.Event()

    async def hold(name: str) -> None:
        started.append(name)
        await gate.wait()

    tasks = [asyncio.create_task(run_in_turn(queue, key, hold, key)) for key in ("a", "b", "c")]
    await settle()
    assert started == ["a", "b", "c"]
    assert all(queue.locked(key) for key in "abc")
    gate.set()
    await asyncio.gather(*tasks)
    assert len(queue) == 0


async def test_failure_does_not_block_the_next_call(run_in_turn: RunInTurn) -> None:
    queue = KeyedSerialQueue()

    async def fail() -> None:
        await asyncio.sleep(0)
        raise ValueError("boom")

    async def succeed() -> str:
        return "ok"

    first = asyncio.create_task(run_in_turn(queue, "k", fail))
    second = asyncio.create_task(run_in_turn(queue, "k", succeed))
    with pytest.raises(ValueError, match="boom"):
        await first
    assert await second == "ok"
    assert len(queue) == 0


async def test_each_caller_gets_its_own_outcome(run_in_turn: RunInTurn) -> None:
    queue = KeyedSerialQueue()

    async def outcome(i: int) -> int:
        await asyncio.sleep(0)
        if i % 3 == 0:
            raise KeyError(i)
        return i * 10

    results = await asyncio.gather(
        *(run_in_turn(queue, "k", outcome, i) for i in range(9)), return_exceptions=True
    )
    for i, result in enumerate(results):
        if i % 3 == 0:
            assert isinstance(result, KeyError) and result.args == (i,)
        else:
            assert result == i * 10


async def test_registration_order_is_first_run_of_the_coroutine(run_in_turn: RunInTurn) -> None:
    queue = KeyedSerialQueue()
    log: list[str] = []

    async def record(name: str) -> None:
        log.append(name)

    gate = asyncio.Event()

    async def blocker() -> None:
        await gate.wait()

    holder = asyncio.create_task(run_in_turn(queue, "k", blocker))
    await settle()
    late = run_in_turn(queue, "k", record, "created first, awaited last")
    early = asyncio.create_task(run_in_turn(queue, "k", record, "b"))
    await settle()
    never = run_in_turn(queue, "k", record, "never awaited")
    assert queue.pending("k") == 2  # holder and b; unawaited coroutines registered nothing
    never.close()
    gate.set()
    await holder
    await early
    await late
    assert log == ["b", "created first, awaited last"]
    assert len(queue) == 0


async def test_submit_registers_before_returning() -> None:
    queue = KeyedSerialQueue()
    log: list[int] = []

    async def record(i: int) -> int:
        log.append(i)
        await asyncio.sleep(0)
        return i

    tasks = [queue.submit("k", record, i) for i in range(5)]
    assert queue.pending("k") == 5
    assert queue.locked("k")
    assert await asyncio.gather(*tasks) == [0, 1, 2, 3, 4]
    assert log == [0, 1, 2, 3, 4]
    assert len(queue) == 0


async def test_submit_and_run_share_one_order(run_in_turn: RunInTurn) -> None:
    queue = KeyedSerialQueue()
    log: list[str] = []

    async def record(name: str) -> None:
        log.append(name)
        await asyncio.sleep(0)

    first = queue.submit("k", record, "submit-1")
    run_task = asyncio.create_task(run_in_turn(queue, "k", record, "run"))
    await settle()
    second = queue.submit("k", record, "submit-2")
    await asyncio.gather(first, run_task, second)
    assert log == ["submit-1", "run", "submit-2"]


async def test_idle_keys_leave_no_entry(run_in_turn: RunInTurn) -> None:
    queue = KeyedSerialQueue()

    async def noop() -> None:
        return None

    for i in range(100_000):
        await run_in_turn(queue, i, noop)
    assert len(queue) == 0
    await asyncio.gather(*(run_in_turn(queue, i % 1000, noop) for i in range(10_000)))
    assert len(queue) == 0
    assert 5 not in queue


async def test_keyword_arguments_reach_the_function(run_in_turn: RunInTurn) -> None:
    queue = KeyedSerialQueue()

    async def join_words(a: str, *, b: str) -> str:
        return a + b

    assert await run_in_turn(queue, "k", join_words, "x", b="y") == "xy"
    assert await queue.with_options(timeout=1).run("k", join_words, "x", b="z") == "xz"


async def test_every_shape_of_arguments_reaches_the_function(run_in_turn: RunInTurn) -> None:
    # The turn calls fn without unpacking when it has no arguments: each shape takes its own
    # branch, and none may drop or add an argument.
    queue = KeyedSerialQueue()

    async def echo(*args: object, **kwargs: object) -> tuple[tuple[object, ...], dict[str, object]]:
        return args, kwargs

    assert await run_in_turn(queue, "k", echo) == ((), {})
    assert await run_in_turn(queue, "k", echo, 1) == ((1,), {})
    assert await run_in_turn(queue, "k", echo, b=2) == ((), {"b": 2})
    assert await run_in_turn(queue, "k", echo, 1, b=2) == ((1,), {"b": 2})


async def test_lock_holds_the_turn_for_a_block(run_in_turn: RunInTurn) -> None:
    queue = KeyedSerialQueue()
    log: list[str] = []

    async def record(name: str) -> None:
        log.append(name)

    async with queue.lock("k"):
        waiting = asyncio.create_task(run_in_turn(queue, "k", record, "after block"))
        await settle()
        log.append("in block")
        assert queue.locked("k")
        assert queue.pending("k") == 2
    await waiting
    assert log == ["in block", "after block"]
    assert len(queue) == 0


async def test_inspection_of_unknown_keys() -> None:
    queue = KeyedSerialQueue()
    assert queue.pending("x") == 0
    assert not queue.locked("x")
    assert "x" not in queue
    assert [] not in queue  # unhashable: simply not there
    assert "keys=0" in repr(queue)


@pytest.mark.asyncio
async def test_closing_refuses_a_call_that_would_queue_behind_a_running_holder(
    run_in_turn: RunInTurn,
) -> None:
    # The holder runs (it yields without parking on a future) while calls queue behind it:
    # the case run() and call() register without LoopShare.register, which must still see
    # that the queue is closed.
    queue, log = KeyedSerialQueue(), []

    async def spin() -> None:
        for _ in range(50):  # longer than the steps below take
            await asyncio.sleep(0)
        log.append("holder")

    async def record(name: str) -> None:
        log.append(name)

    holder = asyncio.create_task(run_in_turn(queue, "k", spin))
    await asyncio.sleep(0)
    queued = asyncio.create_task(run_in_turn(queue, "k", record, "queued"))
    await asyncio.sleep(0)
    closing = asyncio.create_task(queue.aclose())
    await asyncio.sleep(0)
    late = asyncio.create_task(run_in_turn(queue, "k", record, "late"))
    for _ in range(3):
        await asyncio.sleep(0)
    assert late.done()
    with pytest.raises(QueueClosed):
        late.result()
    await asyncio.gather(holder, queued, closing)
    assert log == ["holder", "queued"]


async def test_call_is_deprecated_and_still_runs_as_with_options_run() -> None:
    queue = KeyedSerialQueue()

    async def add(a: int, *, b: int) -> int:
        return a + b

    with pytest.warns(DeprecationWarning, match=r"with_options\(timeout=\.\.\., group=\.\.\.\)"):
        coroutine = queue.call("k", add, (1,), {"b": 2}, timeout=1.0)
    assert await coroutine == 3
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="timeout"):
        await queue.call("k", add, (1,), {"b": 2}, timeout=-1)
    assert len(queue) == 0
