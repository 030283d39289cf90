"""``current_fence()``: the fencing token of the turn the calling code runs in, or works for.

A turn's fence is an int that increases strictly, per key, from one granted
turn to the next; a resource that remembers the highest fence it has seen can
refuse a late write from a holder that lost its turn.

The current turn is found in the records of ``keyserial._turns``: every turn, of the
in-process queue or of a backend, records itself for its task while it runs, with what
gives its fence. current_fence() reads the running task's innermost record.

Code that works *for* a turn in another task or thread — a child task the holder
awaits (directly, or through ``gather``, ``TaskGroup``, ``wait``, ``shield``,
``wait_for``), or a function the holder awaits in ``asyncio.to_thread`` — finds
the holder by following who waits for it (``keyserial._asyncio_internals``) and reads
the holder's records the same way; a child started eagerly finds it, during its first
step, as the task in the middle of the step that created it. Carrying the turn in a
context variable instead would hand a stale fence to a task that outlives the turn.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

from ._asyncio_internals import MAX_DEPTH, future_of_thread_work, tasks_mid_step, tasks_waiting_for
from ._turns import TurnRecord, fence_of_record, innermost

V = TypeVar("V")

#: How long a thread waits for the loop to read the fence of the turn it works for.
_LOOP_ANSWER_TIMEOUT = 10.0


class FenceBook:
    """The fences handed out to the running turns of one loop's share, by key.

    A turn gets its fence on first request (from a counter of the share) and keeps it
    until it ends; most turns never ask, and cost nothing here.
    """

    __slots__ = ("by_key", "counter")

    def __init__(self) -> None:
        self.by_key: dict[Hashable, int] = {}
        self.counter = 0

    def __bool__(self) -> bool:
        return bool(self.by_key)

    def fence_of(self, keys: Sequence[Hashable]) -> int | None:
        """The fence of the running turn holding ``keys``, handed out on first request."""
        if not keys:
            return None  # a nested multi-key turn that needed no key of its own
        fence = self.by_key.get(keys[0])
        if fence is None:
            self.counter += 1
            fence = self.counter
            for key in keys:
                self.by_key[key] = fence
        return fence

    def drop(self, key: Hashable) -> None:
        """The turn of ``key`` ended: forget its fence."""
        self.by_key.pop(key, None)

    def drop_identical(self, key: object) -> None:
        """Forget the fence of a key that can no longer be looked up (it broke)."""
        self.by_key = {k: v for k, v in self.by_key.items() if k is not key}


def current_fence() -> int:
    """The fencing token of the innermost turn that the calling code runs in, or works for.

    Fences increase strictly, per key, for every turn granted: pass the fence
    along with a write and let the store refuse a write whose fence is lower
    than the highest it has seen. With the Redis backend the fence comes from
    Redis and orders the turns of every process; with the in-process queue it
    comes from a counter of the queue (per event loop), handed out on first
    request and stable for the rest of the turn.

    Inside a turn (a serialized call, a ``run``/``call``/``submit``/``run_all``
    function, a ``lock()``/``lock_all()`` block) it is that turn's fence. A task
    or thread that a turn's holder is waiting for gets the fence of the turn the
    holder is in: a child task awaited directly or through ``asyncio.gather``,
    ``TaskGroup``, ``asyncio.wait``, ``shield`` or ``wait_for``, and a function
    run by ``asyncio.to_thread`` (or awaited ``run_in_executor``). A task that
    nobody in a turn waits for — started and left running — gets no fence: it may
    outlive the turn.

    Raises:
        RuntimeError: not called from inside a turn, nor from a task or thread
            that a turn's holder is waiting for.

    Example:
        ```pycon
        >>> import asyncio
        >>> from keyserial import KeyedSerialQueue, current_fence
        >>> async def main() -> bool:
        ...     queue = KeyedSerialQueue()
        ...     async def write() -> int:
        ...         return current_fence()
        ...     first = await queue.run("k", write)
        ...     second = await queue.run("k", write)
        ...     return second > first
        >>> asyncio.run(main())
        True

        ```
    """
    fence = innermost_turn(fence_of_record)
    if fence is not None:
        return fence
    raise RuntimeError(
        "current_fence() must be called inside a keyserial turn, or in a task or thread "
        "that a turn's holder awaits"
    )


def innermost_turn(pick: Callable[[TurnRecord], V | None]) -> V | None:
    """What ``pick`` gives for the innermost turn the calling code runs in or works for.

    First the running task's own turns; then, for a helper task or thread, the turns of
    the nearest task that waits for it.
    """
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no event loop in this thread
        task = None
    if task is not None:
        found = innermost(task, pick)
        if found is None:
            found = _of_waiters(pick, task)
        if found is None:
            # A task started eagerly runs its first step inside its creator's, before the
            # creator can await it (gather, TaskGroup): the creator works for it meanwhile.
            for creator in tasks_mid_step(task):
                found = innermost(creator, pick)
                if found is not None:
                    break
        return found
    future = future_of_thread_work()
    if future is None:
        return None
    # The holder's records and its queue's fence book belong to the loop's thread: read them
    # there. The loop is free (the holder awaits this very thread), so it answers at once.
    loop = future.get_loop()
    answer: concurrent.futures.Future[V | None] = concurrent.futures.Future()

    def look() -> None:
        try:
            answer.set_result(_of_waiters(pick, future))
        except BaseException as exc:
            answer.set_exception(exc)

    loop.call_soon_threadsafe(look)
    try:
        return answer.result(timeout=_LOOP_ANSWER_TIMEOUT)
    except concurrent.futures.TimeoutError:
        raise RuntimeError("keyserial: the event loop of the turn did not answer") from None


def _of_waiters(pick: Callable[[TurnRecord], V | None], awaited: object) -> V | None:
    """What the nearest task in a turn that waits for ``awaited`` gives."""
    seen: set[int] = set()
    frontier = tasks_waiting_for(awaited)
    while frontier and len(seen) < MAX_DEPTH:
        task = frontier.pop(0)
        if id(task) in seen:
            continue
        seen.add(id(task))
        found = innermost(task, pick)
        if found is not None:
            return found
        frontier.extend(tasks_waiting_for(task))
    return None
