"""Multi-key turns: atomic registration, no ABBA deadlock, per-key cleanup and order."""

from __future__ import annotations

import asyncio

import pytest

from keyserial import KeyedSerialQueue, QueueFull, serialized

from .scheduling import Recorder, settle

pytestmark = pytest.mark.asyncio


async def test_multi_key_call_holds_every_key_until_it_ends() -> None:
    queue, rec = KeyedSerialQueue(), Recorder()
    merge = asyncio.create_task(queue.run_all(["a", "b"], rec.step, "merge"))
    await settle()
    assert queue.locked("a") and queue.locked("b")
    on_a = asyncio.create_task(queue.run("a", rec.step, "on a"))
    on_b = asyncio.create_task(queue.run("b", rec.step, "on b"))
    on_c = asyncio.create_task(queue.run("c", rec.step, "on c"))
    await settle()
    assert rec.log == ["start merge", "start on c"]
    rec.gate("merge").set()
    await settle()
    assert rec.log[2:] == ["end merge", "start on a", "start on b"]
    for name in ("on a", "on b", "on c"):
        rec.gate(name).set()
    assert list(await asyncio.gather(merge, on_a, on_b, on_c)) == ["merge", "on a", "on b", "on c"]
    assert len(queue) == 0


async def test_multi_key_call_waits_for_all_keys_in_fifo_order() -> None:
    queue, rec = KeyedSerialQueue(), Recorder()
    first_a = asyncio.create_task(queue.run("a", rec.step, "a1"))
    await settle()
    merge = asyncio.create_task(queue.run_all(["a", "b"], rec.step, "merge"))
    await settle()
    # b is free, but merge registered on it at once: later calls on b queue behind merge.
    later_b = asyncio.create_task(queue.run("b", rec.step, "b2"))
    await settle()
    assert rec.log == ["start a1"]
    assert queue.locked("b")
    rec.gate("a1").set()
    await settle()
    assert rec.log == ["start a1", "end a1", "start merge"]
    rec.gate("merge").set()
    rec.gate("b2").set()
    await asyncio.gather(first_a, merge, later_b)
    assert rec.log[-2:] == ["start b2", "end b2"]
    assert len(queue) == 0


async def test_abba_multi_key_callers_never_deadlock() -> None:
    queue = KeyedSerialQueue()
    inside: dict[str, int] = {"a": 0, "b": 0}
    overlaps: list[str] = []

    async def both(label: str) -> str:
        for key in inside:
            inside[key] += 1
            if inside[key] > 1:
                overlaps.append(key)
        await asyncio.sleep(0)
        for key in inside:
            inside[key] -= 1
        return label

    calls = [queue.run_all(["a", "b"] if i % 2 else ["b", "a"], both, str(i)) for i in range(200)]
    results = await asyncio.wait_for(asyncio.gather(*calls), timeout=10)
    assert results == [str(i) for i in range(200)]
    assert overlaps == []
    assert len(queue) == 0


async def test_duplicates_count_once_and_bad_key_lists_fail() -> None:
    queue = KeyedSerialQueue(max_pending=1)

    async def noop() -> str:
        return "ok"

    assert await queue.run_all(["a", "a", "a"], noop) == "ok"
    with pytest.raises(ValueError, match="at least one key"):
        await queue.run_all([], noop)
    with pytest.raises(TypeError, match="iterable of keys"):
        await queue.run_all("ab", noop)
    with pytest.raises(TypeError, match="hashable"):
        await queue.run_all(["a", ["b"]], noop)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="timeout"):
        queue.lock_all(["a"], timeout=-1)
    assert len(queue) == 0


async def test_nested_multi_key_call_needs_only_the_keys_it_lacks() -> None:
    queue, rec = KeyedSerialQueue(), Recorder()
    log: list[str] = []

    async def inner() -> None:
        log.append("inner holds a and b")

    async def outer() -> None:
        await queue.run_all(["a", "b"], inner)  # a is held by this task already
        assert queue.locked("a")
        log.append("outer still holds a")

    b_holder = asyncio.create_task(queue.run("b", rec.step, "b holder"))
    await settle()
    task = asyncio.create_task(queue.run("a", outer))
    await settle()
    assert log == []
    rec.gate("b holder").set()
    await asyncio.gather(task, b_holder)
    assert log == ["inner holds a and b", "outer still holds a"]
    assert len(queue) == 0


async def test_cancelled_multi_key_waiter_releases_what_it_got() -> None:
    queue, rec = KeyedSerialQueue(), Recorder()
    holder_b = asyncio.create_task(queue.run("b", rec.step, "holds b"))
    await settle()
    merge = asyncio.create_task(queue.run_all(["a", "b"], rec.step, "merge"))
    await settle()
    assert queue.locked("a")  # taken at registration, while merge waits for b
    waiting_a = asyncio.create_task(queue.run("a", rec.step, "on a"))
    await settle()
    merge.cancel()
    await settle()
    assert merge.cancelled()
    assert "start on a" in rec.log  # a was passed on
    assert queue.pending("b") == 1
    rec.gate("on a").set()
    rec.gate("holds b").set()
    await asyncio.gather(holder_b, waiting_a)
    assert "start merge" not in rec.log
    assert len(queue) == 0


async def test_multi_key_hand_off_race_passes_every_key_on() -> None:
    queue, rec = KeyedSerialQueue(), Recorder()
    first = asyncio.create_task(queue.run_all(["a", "b"], rec.step, "first"))
    await settle()
    second = asyncio.create_task(queue.run_all(["b", "a"], rec.step, "second"))
    third_a = asyncio.create_task(queue.run("a", rec.step, "third"))
    await settle()
    rec.gate("first").set()
    await asyncio.sleep(0)  # first ends: second is granted both keys but has not resumed
    assert first.done() and not second.done()
    second.cancel()
    await settle()
    assert second.cancelled()
    assert rec.log[-1] == "start third"
    rec.gate("third").set()
    await third_a
    assert len(queue) == 0


async def test_multi_key_timeout_and_max_pending_leave_no_trace() -> None:
    queue, rec = KeyedSerialQueue(max_pending=2), Recorder()
    holder = asyncio.create_task(queue.run("b", rec.step, "holds b"))
    await settle()
    with pytest.raises(TimeoutError, match="keys"):
        async with queue.lock_all(["a", "b"], timeout=0.001):
            raise AssertionError("must not enter")
    assert "a" not in queue
    assert queue.pending("b") == 1
    second = asyncio.create_task(queue.run("b", rec.step, "second on b"))
    await settle()
    with pytest.raises(QueueFull) as info:
        await queue.run_all(["a", "b"], rec.step, "never")
    assert info.value.key == "b"
    assert "a" not in queue  # nothing was registered on a either
    rec.gate("holds b").set()
    rec.gate("second on b").set()
    await asyncio.gather(holder, second)
    assert len(queue) == 0


async def test_failures_in_multi_key_calls_release_every_key() -> None:
    queue = KeyedSerialQueue()

    async def fail() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError):
        await queue.run_all(["a", "b", "c"], fail)
    assert len(queue) == 0


async def test_serialized_with_keys() -> None:
    log: list[str] = []
    gate = asyncio.Event()

    @serialized(keys=lambda src, dst, *a, **k: (src, dst))
    async def merge(src: str, dst: str) -> None:
        log.append(f"merge {src}->{dst}")
        await gate.wait()

    @serialized(key="seg")
    async def touch(seg: str) -> None:
        log.append(f"touch {seg}")

    @serialized(keys="segments", timeout=0)
    async def impatient(segments: list[str]) -> None:
        log.append("impatient")

    first = asyncio.create_task(merge("a", "b"))
    second = asyncio.create_task(merge("b", "a"))
    on_b = asyncio.create_task(touch("b"))
    await settle()
    assert log == ["merge a->b"]
    with pytest.raises(TimeoutError):
        await impatient(["a", "z"])
    gate.set()
    await asyncio.gather(first, second, on_b)
    assert log == ["merge a->b", "merge b->a", "touch b"]
    with pytest.raises(TypeError, match="not both"):
        serialized(key="src", keys="src")(merge)
