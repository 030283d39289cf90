"""Latest-wins coalescing: a newer call supersedes the same group's waiting call."""

from __future__ import annotations

import asyncio

import pytest

from keyserial import KeyedSerialQueue, QueueFull, Superseded, serialized

from .scheduling import settle

pytestmark = pytest.mark.asyncio


async def test_newer_call_supersedes_the_waiting_one_of_its_function() -> None:
    queue = KeyedSerialQueue()
    saved: list[str] = []
    gate = asyncio.Event()

    @serialized(key="seg_id", queue=queue, coalesce=True)
    async def save_partial(seg_id: str, text: str) -> str:
        saved.append(text)
        if text == "p1":
            await gate.wait()
        return text

    @serialized(key="seg_id", queue=queue)
    async def finalize(seg_id: str, text: str) -> str:
        saved.append(text)
        return text

    running = asyncio.create_task(save_partial("s", "p1"))
    await settle()
    p2 = asyncio.create_task(save_partial("s", "p2"))
    final = asyncio.create_task(finalize("s", "final"))
    p3 = asyncio.create_task(save_partial("s", "p3"))
    p4 = asyncio.create_task(save_partial("s", "p4"))
    other_key = asyncio.create_task(save_partial("t", "t1"))
    await settle()
    # p2 and p3 were superseded: never started. finalize kept its place; p1 still runs.
    for superseded in (p2, p3):
        with pytest.raises(Superseded) as info:
            await superseded
        assert info.value.key == "s"
    assert queue.pending("s") == 3  # p1 running, final and p4 waiting
    gate.set()
    assert list(await asyncio.gather(running, final, p4, other_key)) == ["p1", "final", "p4", "t1"]
    assert saved == ["p1", "t1", "final", "p4"]
    assert len(queue) == 0


async def test_burst_keeps_one_running_and_one_waiting() -> None:
    queue = KeyedSerialQueue()
    gate = asyncio.Event()
    started: list[int] = []

    async def slow_save(i: int) -> int:
        started.append(i)
        await gate.wait()
        return i

    tasks = [
        asyncio.create_task(queue.with_options(group="partials").run("k", slow_save, i))
        for i in range(5000)
    ]
    await settle()
    assert started == [0]
    assert queue.pending("k") == 2  # one running, one waiting, whatever the burst's size
    gate.set()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    assert started == [0, 4999]
    assert outcomes[0] == 0 and outcomes[-1] == 4999
    assert all(isinstance(o, Superseded) for o in outcomes[1:-1])
    assert len(queue) == 0


async def test_coalescing_respects_max_pending_by_replacing() -> None:
    queue = KeyedSerialQueue(max_pending=2)
    gate = asyncio.Event()

    async def hold() -> None:
        await gate.wait()

    async def work(i: int) -> int:
        return i

    holder = asyncio.create_task(queue.run("k", hold))
    await settle()
    first = asyncio.create_task(queue.with_options(group="g").run("k", work, 1))
    await settle()
    # The key is full, but a call of the same group replaces the waiting one.
    second = asyncio.create_task(queue.with_options(group="g").run("k", work, 2))
    await settle()
    with pytest.raises(QueueFull):
        await queue.with_options(group="other group").run("k", work, 3)
    gate.set()
    await holder
    with pytest.raises(Superseded):
        await first
    assert await second == 2
    assert len(queue) == 0


async def test_superseded_then_cancelled_and_timed_out_waiters_leave_no_trace() -> None:
    queue = KeyedSerialQueue()
    gate = asyncio.Event()

    async def hold() -> None:
        await gate.wait()

    async def work(i: int) -> int:
        return i

    holder = asyncio.create_task(queue.run("k", hold))
    await settle()
    a = asyncio.create_task(queue.with_options(group="g").run("k", work, 1))
    await settle()
    b = asyncio.create_task(queue.with_options(group="g").run("k", work, 2))
    a.cancel()  # superseded and cancelled before it resumes
    await settle()
    with pytest.raises(TimeoutError):
        # The smallest wait that still waits (timeout=0 would be a try, which supersedes
        # nothing): its timer fires on the loop's next iteration.
        async with queue.lock("k", timeout=1e-9, group="g"):  # supersedes b, then times out
            raise AssertionError("must not enter")
    with pytest.raises(Superseded):
        await b
    assert queue.pending("k") == 1
    gate.set()
    await holder
    assert a.cancelled()
    assert len(queue) == 0


async def test_coalesce_is_for_single_keys() -> None:
    async def merge(a: str, b: str) -> None:
        return None

    with pytest.raises(TypeError, match="coalesce"):
        serialized(keys=lambda a, b: (a, b), coalesce=True)(merge)


async def test_a_view_with_a_group_coalesces_submit_and_lock_too() -> None:
    queue = KeyedSerialQueue()
    gate = asyncio.Event()
    ran: list[str] = []

    async def hold() -> None:
        await gate.wait()

    async def note(name: str) -> None:
        ran.append(name)

    partials = queue.with_options(group="partials")
    holder = queue.submit("k", hold)
    older = partials.submit("k", note, "older")
    newer = partials.submit("k", note, "newer")
    other = queue.submit("k", note, "ungrouped")
    await settle()
    assert older.done() and isinstance(older.exception(), Superseded)
    gate.set()
    await asyncio.gather(holder, newer, other)
    assert ran == ["newer", "ungrouped"]

    async def block() -> None:
        async with partials.lock("k"):
            ran.append("block")

    assert repr(partials).startswith("<MultiKeyWaitOptions timeout=None group='partials' of")
    await block()
    assert ran[-1] == "block"
    with pytest.raises(ValueError, match="several keys do not coalesce"):
        partials.lock_all(["a", "b"])
    with pytest.raises(TypeError, match="group must be hashable"):
        queue.with_options(group=["not", "hashable"])  # type: ignore[arg-type]
