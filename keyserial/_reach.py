"""Showing, without walking a chain of holders, that no wait can lead back to a task.

The deadlock check walks forward from the holders a task is about to wait for, looking for
the task. Behind a long chain of blocked holders that walk is long, and every call queued
behind the chain would repeat it. The backward question is usually short instead: who could
a path end at? A path into a task ends either with a key it holds (or that a task awaiting
it holds), or with plain waits from a holder that awaits it. So if neither the task nor
anything awaiting it holds a key or is one of the holders, no path exists.

"Holds a key" must never be missed, so it is read conservatively and the answer is only
ever "surely not" or "unsure": a keyserial turn or registration on a task's await chain
(registered code objects), a lock block the task is in (recorded per task: a block has no
frame of its own, and may even be kept open by a suspended async generator), an await chain
that cannot be read to its end, or a task in the middle of a step.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any

from ._asyncio_internals import fut_waiter
from ._awaits import MAX_DEPTH, frame_of, is_running, is_task, may_start_eagerly, woken_by

Task = asyncio.Task[Any]

#: Nodes `unreachable` visits before it gives up (and the forward walk runs in full).
_BACKWARD_BUDGET = 32

_COROUTINE_FLAGS = 0x80 | 0x100 | 0x200  # CO_COROUTINE, CO_ITERABLE_COROUTINE, CO_ASYNC_GENERATOR

#: The ids of the code objects of every keyserial coroutine that registers for keys or holds
#: them while it runs: the entry codes, and the registering ones of lock blocks and multi-key
#: calls. Ids, because hashing a code object hashes its bytecode and constants; the codes
#: themselves are kept in `_kept_codes`, so their ids stay theirs.
_holding_codes: set[int] = set()
_kept_codes: list[Any] = []
#: Tasks inside ``lock()``/``lock_all()`` blocks, with how many: a block has no frame of its
#: own on its task's await chain (it may even belong to a suspended async generator).
_block_holders: dict[Task, int] = {}


def register_holding_code(code: Any) -> None:
    """Declare that a frame running ``code`` registers for keys or holds some."""
    _kept_codes.append(code)
    _holding_codes.add(id(code))


def block_entered(task: Task) -> None:
    """``task`` now holds keys for a lock block."""
    _block_holders[task] = _block_holders.get(task, 0) + 1


def block_left(task: Task) -> None:
    """``task`` left a lock block it entered with `block_entered`."""
    left = _block_holders.pop(task, 1) - 1
    if left:
        _block_holders[task] = left


#: What `unreachable` answers when the running task was started eagerly by a task still in
#: the middle of its step: nothing can be said until that step ends.
LATER = "later"


def unreachable(task: Task, holders: Sequence[Task | None], running: bool) -> bool | str:
    """Whether nothing can lead from ``holders`` back to ``task``: True, False if unsure,
    or LATER.

    A path to ``task`` ends either with a key that ``task``, or a task awaiting it, holds,
    or with waits only, from a holder awaiting it. So when neither ``task`` nor anything
    that awaits it (directly or through asyncio helpers, followed backwards through done
    callbacks) holds a key or is a holder, there is no path, however long the chain of
    holders is. Holding is read conservatively: any keyserial turn or registration on a
    task's await chain (but the one registering now), an open lock block, an await chain
    that cannot be read to its end, or a task in the middle of a step all count as "might
    hold". ``running``: ``task`` is the task registering now, else it is suspended in its
    registration.
    """
    if running:
        own = _stack_holds_nothing(task)
        if own is not True:
            return own
    elif not _suspended_holds_nothing(task, registering=True):
        return False
    targets = {id(holder) for holder in holders if holder is not None}
    seen = {id(task)}
    frontier = list(woken_by(task))
    while frontier:
        node = frontier.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if len(seen) > _BACKWARD_BUDGET or id(node) in targets:
            return False
        if is_task(node) and not _suspended_holds_nothing(node):
            return False
        if asyncio.isfuture(node):
            frontier.extend(woken_by(node))
    return True


def _stack_holds_nothing(task: Task) -> bool | str:
    """Whether the running ``task``, registering now, holds no key: True, False if unsure,
    or LATER if another task is in the middle of the step that started it."""
    if task in _block_holders:
        return False
    outermost = frame_of(task.get_coro())
    registrant_seen = False
    frame: FrameType | None = sys._getframe(1)  # pyright: ignore[reportPrivateUsage]
    while frame is not None:
        if id(frame.f_code) in _holding_codes:
            if registrant_seen:  # the innermost one is the call registering now
                return False
            registrant_seen = True
        if frame is outermost:
            break
        frame = frame.f_back
    if frame is None:
        return False  # the task's own frames are not where they should be: unsure
    # Below a task's frames there is only the loop, unless another task is in the middle
    # of a step that started this one eagerly: its waits are not settled yet. Where no task
    # starts eagerly, the loop's frames (each read makes a frame object) need not be read.
    if not may_start_eagerly(task.get_loop()):
        return True
    frame = frame.f_back
    while frame is not None:
        if frame.f_code.co_flags & _COROUTINE_FLAGS:
            return LATER
        frame = frame.f_back
    return True


def _suspended_holds_nothing(task: Task, registering: bool = False) -> bool:
    """Whether the suspended ``task`` holds no key (False if unsure); ``registering``: it
    waits in a registration of its own, which holds nothing yet."""
    if task.done():
        return True
    if task in _block_holders or is_running(task):
        return False
    allowed = 1 if registering else 0  # holding frames: only the innermost may register
    coro: Any = task.get_coro()
    for _ in range(MAX_DEPTH):
        frame = frame_of(coro)
        if frame is None:
            return False
        if id(frame.f_code) in _holding_codes:
            allowed -= 1
            if allowed < 0:
                return False
        inner = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        if inner is None:
            return True  # suspended at a bare yield: this is the whole chain
        if frame_of(inner) is None:
            # The chain ends awaiting a future; anything else (an async generator's
            # asend, a custom awaitable) may hide frames further in.
            waiter = fut_waiter(task)
            return waiter is not None and type(inner) is type(waiter.__await__())
        coro = inner
    return False
