"""current_fence() with the in-process queue."""

from __future__ import annotations

import asyncio
import sys

import anyio
import pytest

from keyserial import KeyedSerialQueue, current_fence, serialized

from .scheduling import settle


@pytest.mark.asyncio
async def test_fences_increase_per_key_and_are_stable_within_a_turn() -> None:
    queue = KeyedSerialQueue()
    seen: list[tuple[str, int]] = []

    async def write(name: str) -> None:
        first = current_fence()
        await asyncio.sleep(0)
        assert current_fence() == first  # stable for the whole turn
        seen.append((name, first))

    await asyncio.gather(*(queue.run("k", write, f"w{i}") for i in range(5)))
    fences = [fence for _, fence in seen]
    assert [name for name, _ in seen] == [f"w{i}" for i in range(5)]
    assert fences == sorted(set(fences))
    share = queue._shares.cached
    assert not share.fences and not share.attention


@pytest.mark.asyncio
async def test_every_way_of_taking_a_turn_has_a_fence() -> None:
    queue = KeyedSerialQueue()
    fences: list[int] = []

    async def note() -> int:
        fences.append(current_fence())
        return fences[-1]

    @serialized(key="k", queue=queue)
    async def decorated(k: str) -> int:
        return await note()

    await queue.run("k", note)
    await queue.with_options(timeout=1.0).run("k", note)
    await decorated("k")
    await queue.submit("k", note)
    await queue.run_all(["k", "other"], note)
    async with queue.lock("k"):
        fences.append(current_fence())
    async with queue.lock_all(["k", "x"]):
        fences.append(current_fence())
    assert fences == sorted(set(fences)) and len(fences) == 7
    assert len(queue) == 0 and not queue._shares.cached.fences


@pytest.mark.asyncio
async def test_innermost_turn_wins_and_reentry_shares_the_outer_fence() -> None:
    queue = KeyedSerialQueue()
    record: dict[str, int] = {}

    async def inner_b() -> None:
        record["b"] = current_fence()

    async def reenter_a() -> None:
        record["a again"] = current_fence()

    async def outer_a() -> None:
        record["a"] = current_fence()
        await queue.run("b", inner_b)
        await queue.run("a", reenter_a)  # same task, same key: the same turn
        async with queue.lock("a"):
            record["a block"] = current_fence()
        record["a after"] = current_fence()

    await queue.run("a", outer_a)
    assert record["a"] == record["a again"] == record["a block"] == record["a after"]
    assert record["b"] != record["a"]


@pytest.mark.asyncio
async def test_outside_a_turn_is_a_runtime_error() -> None:
    with pytest.raises(RuntimeError, match="inside a keyserial turn"):
        current_fence()
    queue = KeyedSerialQueue()
    gate = asyncio.Event()

    async def hold() -> None:
        await gate.wait()

    holder = asyncio.create_task(queue.run("k", hold))
    await settle()
    # A child task of nothing, and code after a block ended, are outside any turn.
    async with queue.lock("other"):
        pass
    with pytest.raises(RuntimeError):
        current_fence()
    gate.set()
    await holder


def test_outside_any_task_is_a_runtime_error() -> None:
    with pytest.raises(RuntimeError, match="inside a keyserial turn"):
        current_fence()


async def _child_fence() -> int:
    await asyncio.sleep(0)
    return current_fence()


def _thread_fence() -> int:
    return current_fence()


@pytest.mark.asyncio
async def test_helpers_the_holder_waits_for_see_its_fence() -> None:
    queue = KeyedSerialQueue()
    seen: dict[str, int] = {}

    async def turn() -> None:
        mine = current_fence()
        seen["awaited task"] = await asyncio.create_task(_child_fence())
        seen["gather"], seen["gather 2"] = await asyncio.gather(_child_fence(), _child_fence())
        seen["to_thread"] = await asyncio.to_thread(_thread_fence)
        seen["shield"] = await asyncio.shield(_child_fence())
        seen["wait_for"] = await asyncio.wait_for(asyncio.ensure_future(_child_fence()), 5)
        done, _ = await asyncio.wait([asyncio.ensure_future(_child_fence())])
        seen["wait"] = done.pop().result()
        if sys.version_info >= (3, 11):
            async with asyncio.TaskGroup() as group:  # type: ignore[attr-defined,unused-ignore]
                in_group = group.create_task(_child_fence())
            seen["TaskGroup"] = in_group.result()
        async with anyio.create_task_group() as anyio_group:
            anyio_group.start_soon(_store_anyio_fence, seen)
        seen["own"] = mine

    await queue.run("k", turn)
    assert set(seen.values()) == {seen["own"]}, seen


async def _store_anyio_fence(seen: dict[str, int]) -> None:
    seen["anyio"] = await _child_fence()


@pytest.mark.asyncio
async def test_a_helper_of_a_lock_block_sees_the_blocks_fence() -> None:
    queue = KeyedSerialQueue()
    async with queue.lock("k"):
        mine = current_fence()
        assert list(await asyncio.gather(_child_fence())) == [mine]
        assert await asyncio.to_thread(_thread_fence) == mine


@pytest.mark.asyncio
async def test_a_helper_with_a_turn_of_its_own_sees_its_own_fence() -> None:
    queue = KeyedSerialQueue()

    async def other_key() -> int:
        return await queue.run("other", _child_fence)

    async def turn() -> tuple[int, int]:
        (child,) = await asyncio.gather(other_key())
        return current_fence(), child

    mine, child = await queue.run("k", turn)
    assert child != mine
    assert queue.locked("k") is False


@pytest.mark.asyncio
async def test_a_task_left_running_gets_no_fence() -> None:
    # Nobody in the turn waits for it, so it may outlive the turn: no fence for it.
    queue = KeyedSerialQueue()
    orphan: list[asyncio.Task[int]] = []

    async def turn() -> None:
        orphan.append(asyncio.create_task(_child_fence()))

    await queue.run("k", turn)
    with pytest.raises(RuntimeError, match="inside a keyserial turn"):
        await orphan[0]
    with pytest.raises(RuntimeError, match="inside a keyserial turn"):
        await asyncio.to_thread(_thread_fence)
