"""Re-entrant calls from the holder, child tasks that queue, and one queue across event loops."""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import warnings
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from keyserial import KeyedSerialQueue, default_queue, serialized
from keyserial._asyncio_internals import has_asyncio_accessors

from .scheduling import settle


@pytest.mark.asyncio
async def test_holder_task_reenters_its_own_key_inline() -> None:
    queue = KeyedSerialQueue(max_pending=1)
    log: list[str] = []

    async def inner() -> str:
        log.append("inner")
        return "inner-result"

    async def outer() -> str:
        log.append("outer start")
        result = await queue.run("k", inner)
        async with queue.lock("k"):
            log.append("nested lock")
        assert queue.locked("k")
        log.append("outer end")
        return result

    assert await queue.run("k", outer) == "inner-result"
    assert log == ["outer start", "inner", "nested lock", "outer end"]
    assert len(queue) == 0


@pytest.mark.asyncio
async def test_reentry_after_contention_still_runs_inline() -> None:
    queue = KeyedSerialQueue()
    log: list[str] = []
    proceed = asyncio.Event()

    async def inner(name: str) -> None:
        log.append(name)

    async def outer() -> None:
        await proceed.wait()  # by now another call queues behind this turn
        await queue.run("k", inner, "reentrant")
        log.append("outer end")

    holder = asyncio.create_task(queue.run("k", outer))
    await settle()
    behind = asyncio.create_task(queue.run("k", inner, "behind"))
    await settle()
    proceed.set()
    await asyncio.gather(holder, behind)
    assert log == ["reentrant", "outer end", "behind"]


@pytest.mark.asyncio
async def test_child_task_of_the_holder_queues() -> None:
    queue = KeyedSerialQueue()
    log: list[str] = []

    async def child_work() -> None:
        log.append("child")

    async def outer() -> asyncio.Task[None]:
        child = asyncio.create_task(queue.run("k", child_work))
        await settle()
        log.append("outer still holds the key")
        return child

    child = await queue.run("k", outer)
    await child
    assert log == ["outer still holds the key", "child"]


@pytest.mark.asyncio
async def test_submit_from_the_holder_queues_behind_it() -> None:
    queue = KeyedSerialQueue()
    log: list[str] = []

    async def child_work() -> None:
        log.append("submitted")

    async def outer() -> asyncio.Task[None]:
        task = queue.submit("k", child_work)
        await settle()
        log.append("outer end")
        return task

    task = await queue.run("k", outer)
    await task
    assert log == ["outer end", "submitted"]


def test_queue_works_in_one_asyncio_run_after_another() -> None:
    queue = KeyedSerialQueue()

    async def noop() -> int:
        await asyncio.sleep(0)
        return 1

    async def main() -> int:
        results = await asyncio.gather(*(queue.run("k", noop) for _ in range(5)))
        await default_queue().run("k", noop)
        return sum(results)

    assert asyncio.run(main()) == 5
    assert asyncio.run(main()) == 5


def test_loop_closed_with_work_registered_leaves_the_next_loop_unaffected() -> None:
    queue = KeyedSerialQueue()
    gate_holder: list[asyncio.Event] = []

    async def hold() -> None:
        gate = asyncio.Event()
        gate_holder.append(gate)
        await gate.wait()

    async def abandon_work() -> None:
        queue.submit("k", hold)
        queue.submit("k", hold)
        await settle()
        assert queue.pending("k") == 2
        await queue.aclose()  # closed, but only for this loop

    loop = asyncio.new_event_loop()
    # Its tasks are destroyed while pending, on purpose; keep asyncio's report of that quiet.
    loop.set_exception_handler(lambda loop, context: None)
    task = loop.create_task(abandon_work())
    loop.run_until_complete(asyncio.sleep(0.01))
    assert not task.done()
    # Close the loop with the key still held and the close still waiting.
    task.cancel()
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()

    async def use_again() -> tuple[int, bool, int]:
        async def noop() -> int:
            return 7

        assert queue.pending("k") == 0
        result = await asyncio.wait_for(queue.run("k", noop), timeout=5)
        return result, queue.closed, len(queue)

    assert asyncio.run(use_again()) == (7, False, 0)
    gc.collect()


def _attributes_in_a_dict(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` keeps its attributes in a dict object (asked without making one)."""
    ready = getattr(loop, "_ready")  # noqa: B009  # a private field: pyright would flag the dot
    return any(type(r) is dict and r.get("_ready") is ready for r in gc.get_referents(loop))


def test_using_a_loop_leaves_its_attributes_where_the_interpreter_keeps_them() -> None:
    # On CPython 3.11 and 3.12 a new object keeps its attributes inline, and the interpreter's
    # fast attribute lookups need them there; reading loop.__dict__ once moves them into a
    # dict for good, and every lookup on the loop (asyncio's own call_soon on each hand-off)
    # is slower from then on. 3.10 always has the dict and 3.13 keeps the inline values, so
    # there the two answers agree whatever keyserial does.
    queue = KeyedSerialQueue()

    async def yield_once() -> None:
        await asyncio.sleep(0)

    async def contended_calls() -> bool:
        loop = asyncio.get_running_loop()
        before = _attributes_in_a_dict(loop)
        await asyncio.gather(*(queue.run("k", yield_once) for _ in range(3)))
        async with queue.lock("k", timeout=1.0):
            pass
        return before == _attributes_in_a_dict(loop)

    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(contended_calls())
    finally:
        loop.close()


def test_a_loop_that_stopped_without_closing_is_not_taken_for_the_next_one() -> None:
    # The first loop stops with "k" still held in its share, and is the queue's last used;
    # a second loop then runs in the same thread: its calls use its own share.
    queue = KeyedSerialQueue()
    first = asyncio.new_event_loop()
    second = asyncio.new_event_loop()
    release = asyncio.Event()

    async def hold() -> None:
        await release.wait()

    async def start_holder() -> asyncio.Task[None]:
        holder = asyncio.ensure_future(queue.run("k", hold))
        await asyncio.sleep(0)
        assert queue.locked("k")
        return holder

    async def double(x: int) -> int:
        return 2 * x

    async def in_second() -> int:
        # run() first: anything else would look the second loop's share up before it.
        return await asyncio.wait_for(queue.run("k", double, 21), timeout=5)

    try:
        holder = first.run_until_complete(start_holder())
        assert second.run_until_complete(in_second()) == 42
        holder.cancel()
        first.run_until_complete(asyncio.gather(holder, return_exceptions=True))
    finally:
        first.close()
        second.close()


def test_default_queue_is_shared_and_per_loop() -> None:
    async def main() -> bool:
        return default_queue() is default_queue() and len(default_queue()) == 0

    assert asyncio.run(main())
    assert asyncio.run(main())


def test_threads_with_their_own_loops_share_a_queue() -> None:
    import threading

    queue = KeyedSerialQueue()
    results: list[list[int]] = []

    async def worker(offset: int) -> list[int]:
        out: list[int] = []

        async def record(i: int) -> None:
            await asyncio.sleep(0)
            out.append(i)

        await asyncio.gather(*(queue.run("shared", record, offset + i) for i in range(200)))
        return out

    def thread_main(offset: int) -> None:
        results.append(asyncio.run(worker(offset)))

    threads = [threading.Thread(target=thread_main, args=(n * 1000,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(r[0] for r in results) == [0, 1000, 2000, 3000]
    for out in results:
        assert out == list(range(out[0], out[0] + 200))


def test_under_trio_the_error_says_keyserial_needs_asyncio() -> None:
    import trio

    queue = KeyedSerialQueue()

    @serialized(key="k", queue=queue)
    async def decorated(k: str) -> None:
        return None

    async def noop() -> None:
        return None

    async def under_trio() -> list[str]:
        attempts: list[Callable[[], Awaitable[None]]] = [
            lambda: queue.run("k", noop),
            lambda: decorated("k"),
            queue.join,
        ]
        messages: list[str] = []
        for attempt in attempts:
            with pytest.raises(RuntimeError) as info:
                await attempt()
            messages.append(str(info.value))
        with pytest.raises(RuntimeError) as info:
            queue.submit("k", noop)
        messages.append(str(info.value))
        return messages

    for message in trio.run(under_trio):
        assert "keyserial needs an asyncio event loop, but this code runs under trio" in message


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX-only")
@pytest.mark.asyncio
async def test_a_child_forked_inside_a_running_loop_runs_on_its_own_loop() -> None:
    # The child keeps the parent's loop object, marked as running in a thread with the
    # child's thread id: the queue must still find the child's own loop and tasks.
    queue = KeyedSerialQueue()
    log: list[str] = []

    async def step(name: str) -> None:
        log.append(f"start {name}")
        await asyncio.sleep(0)
        log.append(f"end {name}")

    await queue.run("k", step, "parent")  # the parent's loop is the queue's last one used
    log.clear()

    async def in_child() -> list[str]:
        await asyncio.gather(queue.run("k", step, "a"), queue.run("k", step, "b"))
        return log

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() of a threaded process
        pid = os.fork()
    if pid == 0:  # the child: report through the exit code only
        code = 3
        try:
            ordered = asyncio.run(in_child()) == ["start a", "end a", "start b", "end b"]
            code = 0 if ordered else 2
        finally:
            os._exit(code)
    _, status = await asyncio.to_thread(os.waitpid, pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_loop_with_its_own_accessors_is_asked_through_them() -> None:
    """The hand-off reads asyncio's loop fields directly only where the methods are asyncio's."""
    asked: list[str] = []

    class AskedLoop(asyncio.SelectorEventLoop):
        def is_closed(self) -> bool:
            asked.append("is_closed")
            return super().is_closed()

        def get_task_factory(self) -> Any:
            asked.append("get_task_factory")
            return super().get_task_factory()

    plain = asyncio.new_event_loop()
    loop = AskedLoop()
    try:
        assert has_asyncio_accessors(plain) and not has_asyncio_accessors(loop)
        assert not has_asyncio_accessors(None)
        queue = KeyedSerialQueue()

        async def step() -> None:
            await asyncio.sleep(0)

        async def main() -> None:
            await asyncio.gather(*(queue.run("k", step) for _ in range(3)))

        asked.clear()
        loop.run_until_complete(main())
        assert "is_closed" in asked  # each hand-off asked whether the loop had closed
        if sys.version_info >= (3, 12):
            assert "get_task_factory" in asked  # whether a holder may be mid-step
    finally:
        plain.close()
        loop.close()
