"""Bad input fails early with a clear message and leaves nothing behind."""

from __future__ import annotations

import asyncio

import pytest

from keyserial import KeyedSerialQueue, QueueClosed, QueueFull
from keyserial._turns import RUNNING

from .conftest import RunInTurn
from .scheduling import settle

pytestmark = pytest.mark.asyncio


async def noop() -> None:
    return None


async def test_unhashable_key_is_a_type_error_naming_the_key(run_in_turn: RunInTurn) -> None:
    queue = KeyedSerialQueue()
    with pytest.raises(TypeError, match=r"hashable.*list"):
        await run_in_turn(queue, ["not", "hashable"], noop)
    with pytest.raises(TypeError, match="hashable"):
        queue.submit({"a": 1}, noop)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="hashable"):
        async with queue.lock([1]):  # type: ignore[arg-type]
            pass
    assert len(queue) == 0


async def test_submit_rejects_non_callables() -> None:
    queue = KeyedSerialQueue()
    with pytest.raises(TypeError, match="needs an async function to call, got 42"):
        queue.submit("k", 42)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3"])
async def test_max_pending_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(ValueError, match="max_pending"):
        KeyedSerialQueue(max_pending=bad)  # type: ignore[arg-type]


async def test_negative_timeout_is_rejected_before_waiting() -> None:
    queue = KeyedSerialQueue()
    with pytest.raises(ValueError, match="timeout"):
        queue.lock("k", timeout=-1)
    with pytest.raises(ValueError, match="timeout"):
        await queue.with_options(timeout=-0.5).run("k", noop)


async def test_max_pending_rejects_the_call_that_would_exceed_it(run_in_turn: RunInTurn) -> None:
    queue = KeyedSerialQueue(max_pending=2)
    gate = asyncio.Event()
    started: list[str] = []

    async def hold(name: str) -> None:
        started.append(name)
        await gate.wait()

    first = asyncio.create_task(run_in_turn(queue, "k", hold, "first"))
    second = asyncio.create_task(run_in_turn(queue, "k", hold, "second"))
    await settle()
    with pytest.raises(QueueFull) as info:
        await run_in_turn(queue, "k", hold, "third")
    assert info.value.key == "k" and info.value.max_pending == 2
    with pytest.raises(QueueFull):
        queue.submit("k", hold, "fourth")
    with pytest.raises(QueueFull):
        async with queue.lock("k"):
            pass
    # Other keys are bounded separately.
    other = asyncio.create_task(run_in_turn(queue, "other", hold, "other"))
    await settle()
    assert queue.pending("k") == 2
    gate.set()
    await asyncio.gather(first, second, other)
    assert started == ["first", "other", "second"]
    assert len(queue) == 0


async def test_max_pending_one_allows_exactly_one(run_in_turn: RunInTurn) -> None:
    queue = KeyedSerialQueue(max_pending=1)
    gate = asyncio.Event()

    async def hold() -> None:
        await gate.wait()

    running = queue.submit("k", hold)
    with pytest.raises(QueueFull):
        await run_in_turn(queue, "k", hold)
    gate.set()
    await running
    await run_in_turn(queue, "k", noop)
    assert len(queue) == 0


async def test_closed_queue_refuses_new_work_but_finishes_registered_work(
    run_in_turn: RunInTurn,
) -> None:
    queue = KeyedSerialQueue()
    gate = asyncio.Event()
    log: list[str] = []

    async def hold(name: str) -> None:
        await gate.wait()
        log.append(name)

    first = queue.submit("k", hold, "first")
    second = queue.submit("k", hold, "second")
    closing = asyncio.create_task(queue.aclose())
    await settle()
    assert queue.closed
    assert not closing.done()
    with pytest.raises(QueueClosed):
        await run_in_turn(queue, "other", noop)
    with pytest.raises(QueueClosed):
        await run_in_turn(queue, "k", noop)
    with pytest.raises(QueueClosed):
        queue.submit("k", noop)
    with pytest.raises(QueueClosed):
        async with queue.lock("k"):
            pass
    gate.set()
    await closing
    assert log == ["first", "second"]
    assert first.done() and second.done()
    assert len(queue) == 0


@pytest.mark.parametrize("contended", [False, True], ids=["alone", "with a waiter"])
async def test_a_turn_may_still_call_into_its_own_key_after_close(
    run_in_turn: RunInTurn, contended: bool
) -> None:
    # A closed queue refuses new work, but a turn that re-enters its own key runs, as on an
    # open queue: the call is part of work already registered.
    queue = KeyedSerialQueue()
    log: list[str] = []
    waiters: list[asyncio.Task[None]] = []

    async def note(name: str) -> None:
        log.append(name)

    async def outer() -> None:
        if contended:
            waiters.append(queue.submit("k", note, "behind"))
        closing = asyncio.create_task(queue.aclose())
        await settle()
        assert queue.closed
        await run_in_turn(queue, "k", note, "re-entry")
        with pytest.raises(QueueClosed):
            await run_in_turn(queue, "other", note, "refused")
        log.append("outer end")
        assert not closing.done()

    await queue.run("k", outer)
    await queue.join()
    expected = ["re-entry", "outer end", "behind"] if contended else ["re-entry", "outer end"]
    assert log == expected
    assert all(waiter.done() for waiter in waiters)
    assert len(queue) == 0


async def test_a_closed_queue_names_a_bad_key_or_a_missing_task_before_it_refuses(
    run_in_turn: RunInTurn,
) -> None:
    # The same errors, in the same order, as on an open queue: the caller's mistake first.
    queue = KeyedSerialQueue()
    await queue.aclose()
    with pytest.raises(TypeError, match="must be hashable"):
        await run_in_turn(queue, ["unhashable"], noop)
    coro = run_in_turn(queue, "k", noop)
    with pytest.raises(RuntimeError, match="inside an asyncio task"):
        _drive_outside_task(coro)
    with pytest.raises(QueueClosed):
        await run_in_turn(queue, "k", noop)


async def test_run_outside_a_task_is_a_clear_error(run_in_turn: RunInTurn) -> None:
    queue = KeyedSerialQueue()
    coro = run_in_turn(queue, "k", noop)
    with pytest.raises(RuntimeError, match="inside an asyncio task"):
        _drive_outside_task(coro)


def _drive_outside_task(coro: object) -> None:
    import asyncio.tasks as tasks

    loop = asyncio.get_running_loop()
    current = tasks.current_task(loop)
    assert current is not None
    # Temporarily leave the current task so that the coroutine sees none.
    tasks._leave_task(loop, current)
    try:
        coro.send(None)  # type: ignore[attr-defined]
    finally:
        tasks._enter_task(loop, current)


async def test_lock_object_cannot_be_entered_twice() -> None:
    queue = KeyedSerialQueue()
    lock = queue.lock("k")
    async with lock:
        with pytest.raises(RuntimeError, match="twice"):
            await lock.__aenter__()
    assert len(queue) == 0


class HashRaises:
    """A key whose ``__hash__`` raises something other than TypeError."""

    def __hash__(self) -> int:
        raise ValueError("no hash today")


async def test_a_key_whose_hash_raises_is_a_type_error_everywhere(run_in_turn: RunInTurn) -> None:
    queue = KeyedSerialQueue()
    key = HashRaises()
    with pytest.raises(TypeError, match=r"hashable and comparable.*no hash today") as info:
        await run_in_turn(queue, key, noop)
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(TypeError, match="no hash today"):
        await queue.run(key, noop)
    with pytest.raises(TypeError, match="no hash today"):
        queue.submit(key, noop)
    with pytest.raises(TypeError, match="no hash today"):
        async with queue.lock(key):
            pass
    with pytest.raises(TypeError, match="no hash today"):
        await queue.run_all(["a", key], noop)
    with pytest.raises(TypeError, match="no hash today"):
        queue.pending(key)
    with pytest.raises(TypeError, match="no hash today"):
        queue.locked(key)
    assert key not in queue  # a key that cannot be hashed has no work registered
    assert len(queue) == 0


class Flaky:
    """Keys that all hash alike and whose equality can be made to fail."""

    broken = False

    def __init__(self, name: str) -> None:
        self.name = name

    def __hash__(self) -> int:
        return 1

    def __eq__(self, other: object) -> bool:
        if Flaky.broken:
            raise RuntimeError("equality broke")
        return isinstance(other, Flaky) and other.name == self.name

    def __repr__(self) -> str:
        return f"Flaky({self.name!r})"


async def test_a_key_whose_equality_breaks_during_its_turn_is_not_left_registered(
    run_in_turn: RunInTurn,
) -> None:
    queue = KeyedSerialQueue()
    first, second = Flaky("first"), Flaky("second")
    gates = {name: asyncio.Event() for name in ("first", "second", "waiter")}
    log: list[str] = []

    async def hold(name: str) -> None:
        await gates[name].wait()
        log.append(name)

    try:
        holder_first = asyncio.create_task(run_in_turn(queue, first, hold, "first"))
        holder_second = asyncio.create_task(run_in_turn(queue, second, hold, "second"))
        await settle()
        waiter = asyncio.create_task(run_in_turn(queue, Flaky("second"), hold, "waiter"))
        await settle()
        assert queue.pending(second) == 2
        Flaky.broken = True  # from now on, finding "second" compares it with "first"
        gates["second"].set()
        gates["waiter"].set()
        with pytest.raises(TypeError, match="failed to hash or compare") as info:
            await asyncio.wait_for(holder_second, timeout=5)
        assert isinstance(info.value.__cause__, RuntimeError)
        # The waiter is refused, not left hanging on a key nobody can hand on.
        with pytest.raises(TypeError, match="failed to hash or compare"):
            await asyncio.wait_for(waiter, timeout=5)
    finally:
        Flaky.broken = False
    assert log == ["second"]
    assert len(queue) == 1  # only "first" is registered now
    gates["first"].set()
    await holder_first
    assert len(queue) == 0
    await run_in_turn(queue, Flaky("second"), noop)  # the key works again once it compares again
    assert len(queue) == 0
    # No record of a turn or a wait outlives its call, the refused one's included.
    assert [task for task in (holder_first, holder_second, waiter) if task in RUNNING] == []


async def test_a_key_whose_hash_changes_during_its_turn_is_not_left_registered(
    run_in_turn: RunInTurn,
) -> None:
    queue = KeyedSerialQueue()

    class Mutable:
        def __init__(self) -> None:
            self.value = 1

        def __hash__(self) -> int:
            return self.value

    key = Mutable()

    async def mutate() -> None:
        key.value = 2

    with pytest.raises(TypeError, match="failed to hash or compare"):
        await run_in_turn(queue, key, mutate)
    assert len(queue) == 0


async def test_a_join_that_times_out_or_is_cancelled_leaves_nothing_behind(
    run_in_turn: RunInTurn,
) -> None:
    queue = KeyedSerialQueue()
    gate = asyncio.Event()

    async def hold() -> None:
        await gate.wait()

    holder = asyncio.create_task(run_in_turn(queue, "k", hold))
    await settle()
    for _ in range(100):
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(queue.join(), timeout=0.0001)
        joining = asyncio.create_task(queue.join())
        await settle()
        joining.cancel()
        await settle()
        assert joining.cancelled()
    share = queue._shares.inspected()
    assert share.idle_waiters == []
    assert not share.attention  # the uncontended path is fast again
    gate.set()
    await holder
    await asyncio.wait_for(queue.join(), timeout=5)
