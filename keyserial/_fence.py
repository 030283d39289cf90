"""``current_fence()``: the fencing token of the turn the calling code runs in, or works for.

A turn's fence is an int that increases strictly, per key, from one granted
turn to the next; a resource that remembers the highest fence it has seen can
refuse a late write from a holder that lost its turn.

Finding the current turn costs the queues nothing on their hot path: it is
found on demand. While current_fence() runs, the coroutines awaiting each other
down to the caller are all on the call stack, so it walks the stack to the
innermost frame of a queue method that runs a turn (each queue module registers
those code objects with a reader of the frame's fence), or to the frame that
entered a ``lock()`` block (recorded in a context variable, since a block has
no frame of its own).

Code that works *for* a turn in another task or thread — a child task the holder
awaits (directly, or through ``gather``, ``TaskGroup``, ``wait``, ``shield``,
``wait_for``), or a function the holder awaits in ``asyncio.to_thread`` — finds
the holder by following who waits for it (``keyserial._awaits``) and reads the
holder's suspended coroutines the same way. Carrying the turn in a context
variable instead would cost every call a ``ContextVar.set`` and ``reset`` (about as
much as an uncontended call itself), and would hand a stale fence to a task that
outlives the turn.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar, Token
from types import CodeType, FrameType
from typing import Any, TypeVar

from ._asyncio_internals import (
    MAX_DEPTH,
    coroutine_chain,
    frame_of,
    future_of_thread_work,
    tasks_waiting_for,
)

V = TypeVar("V")

#: Reads the fence from a turn frame's locals; None if that frame holds no key of its own.
FenceReader = Callable[[Mapping[str, Any]], "int | None"]

#: How long a thread waits for the loop to read the fence of the turn it works for.
_LOOP_ANSWER_TIMEOUT = 10.0

_turn_readers: dict[CodeType, FenceReader] = {}
_lock_blocks: ContextVar[tuple[tuple[FrameType, Callable[[], int | None]], ...]] = ContextVar(
    "keyserial_lock_blocks", default=()
)


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

    def fence_for(self, keys: Sequence[Hashable]) -> int | None:
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


def register_fence_reader(code: CodeType, reader: FenceReader) -> None:
    """Declare that a frame running ``code`` is inside a turn whose fence ``reader`` reads."""
    _turn_readers[code] = reader


def enter_lock_block(owner: FrameType, fence: Callable[[], int | None]) -> Token[Any]:
    """Mark the ``async with`` block of ``owner`` as running a turn, for current_fence()."""
    return _lock_blocks.set((*_lock_blocks.get(), (owner, fence)))


def exit_lock_block(token: Token[Any]) -> None:
    _lock_blocks.reset(token)


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
    blocks = {id(frame): fence for frame, fence in _lock_blocks.get()}
    fence = innermost_turn(_turn_readers, blocks, sys._getframe(1))  # pyright: ignore[reportPrivateUsage]
    if fence is not None:
        return fence
    raise RuntimeError(
        "current_fence() must be called inside a keyserial turn, or in a task or thread "
        "that a turn's holder awaits"
    )


def innermost_turn(
    readers: Mapping[CodeType, Callable[[Mapping[str, Any]], V | None]],
    blocks: Mapping[int, Callable[[], V | None]],
    frame: FrameType | None,
) -> V | None:
    """What ``readers`` (or ``blocks``) read off the innermost turn ``frame`` runs in or works for.

    First the call stack from ``frame`` outwards: the coroutines awaiting each other are
    all running, one calling the next. Then, for a helper task or thread, the suspended
    coroutines of the nearest task in a turn that waits for it.
    """
    found = _on_frames(readers, blocks, _stack(frame))
    if found is not None:
        return found
    return _of_holder_waiting(readers, blocks)


def _stack(frame: FrameType | None) -> Iterator[FrameType]:
    while frame is not None:
        yield frame
        frame = frame.f_back


def _on_frames(
    readers: Mapping[CodeType, Callable[[Mapping[str, Any]], V | None]],
    blocks: Mapping[int, Callable[[], V | None]],
    frames: Iterable[FrameType],
) -> V | None:
    """What the first frame, innermost first, that runs a turn gives."""
    for frame in frames:
        reader = readers.get(frame.f_code)
        if reader is not None and (found := reader(frame.f_locals)) is not None:
            return found
        block = blocks.get(id(frame))
        if block is not None and (found := block()) is not None:
            return found
    return None


def _of_holder_waiting(
    readers: Mapping[CodeType, Callable[[Mapping[str, Any]], V | None]],
    blocks: Mapping[int, Callable[[], V | None]],
) -> V | None:
    """What the nearest task in a turn that waits for this task or thread gives."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no event loop in this thread
        task = None
    if task is not None:
        return _of_waiters(readers, blocks, task)
    future = future_of_thread_work()
    if future is None:
        return None
    # The holder's frames and its queue's fence book belong to the loop's thread: read them
    # there. The loop is free (the holder awaits this very thread), so it answers at once.
    loop = future.get_loop()
    answer: concurrent.futures.Future[V | None] = concurrent.futures.Future()

    def look() -> None:
        try:
            answer.set_result(_of_waiters(readers, blocks, future))
        except BaseException as exc:
            answer.set_exception(exc)

    loop.call_soon_threadsafe(look)
    try:
        return answer.result(timeout=_LOOP_ANSWER_TIMEOUT)
    except concurrent.futures.TimeoutError:
        raise RuntimeError("keyserial: the event loop of the turn did not answer") from None


def _of_waiters(
    readers: Mapping[CodeType, Callable[[Mapping[str, Any]], V | None]],
    blocks: Mapping[int, Callable[[], V | None]],
    awaited: object,
) -> V | None:
    seen: set[int] = set()
    frontier = tasks_waiting_for(awaited)
    while frontier and len(seen) < MAX_DEPTH:
        task = frontier.pop(0)
        if id(task) in seen:
            continue
        seen.add(id(task))
        frames = [frame_of(coro) for coro in coroutine_chain(task)]
        found = _on_frames(readers, blocks, reversed([f for f in frames if f is not None]))
        if found is not None:
            return found
        frontier.extend(tasks_waiting_for(task))
    return None
