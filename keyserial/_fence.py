"""``current_fence()``: the fencing token of the turn the calling code runs in.

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
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from contextvars import ContextVar, Token
from types import CodeType, FrameType
from typing import Any

#: Reads the fence from a turn frame's locals; None if that frame holds no key of its own.
FenceReader = Callable[[Mapping[str, Any]], "int | None"]

_turn_readers: dict[CodeType, FenceReader] = {}
_lock_blocks: ContextVar[tuple[tuple[FrameType, Callable[[], int | None]], ...]] = ContextVar(
    "keyserial_lock_blocks", default=()
)


def register_turn_code(code: CodeType, reader: FenceReader) -> None:
    """Declare that a frame running ``code`` is inside a turn whose fence ``reader`` reads."""
    _turn_readers[code] = reader


def enter_lock_block(owner: FrameType, fence: Callable[[], int | None]) -> Token[Any]:
    """Mark the ``async with`` block of ``owner`` as running a turn, for current_fence()."""
    return _lock_blocks.set((*_lock_blocks.get(), (owner, fence)))


def exit_lock_block(token: Token[Any]) -> None:
    _lock_blocks.reset(token)


def current_fence() -> int:
    """The fencing token of the innermost turn that the calling code runs in.

    Fences increase strictly, per key, for every turn granted: pass the fence
    along with a write and let the store refuse a write whose fence is lower
    than the highest it has seen. With the Redis backend the fence comes from
    Redis and orders the turns of every process; with the in-process queue it
    comes from a counter of the queue (per event loop), handed out on first
    request and stable for the rest of the turn.

    Raises:
        RuntimeError: not called from inside a turn (a serialized call, a
            ``run``/``call``/``submit``/``run_all`` function, or a
            ``lock()``/``lock_all()`` block).

    Example:
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
    """
    blocks = {id(frame): fence for frame, fence in _lock_blocks.get()}
    # The coroutines awaiting each other are all running now, one calling the next:
    # their frames are on the call stack, innermost first.
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        reader = _turn_readers.get(frame.f_code)
        if reader is not None and (fence := reader(frame.f_locals)) is not None:
            return fence
        block = blocks.get(id(frame))
        if block is not None and (fence := block()) is not None:
            return fence
        frame = frame.f_back
    raise RuntimeError("current_fence() must be called inside a keyserial turn")
