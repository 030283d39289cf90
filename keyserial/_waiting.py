"""What a waiting call waits for: the keys, the share that holds them, and since when.

A ``run``, ``call`` or ``lock`` without a timeout waits on an exact ``asyncio.Future``.
asyncio's C task takes its fast path only for an exact future: awaiting a subclass costs it
an attribute lookup, a method call and a bound method more, on every contended call
(benchmarks: contended-100). An exact future carries nothing, so what
it waits for is read where it already is: in the locals of the frame that awaits it, the
registering coroutine of the queue (``key``, the share, and ``since``, the time of the
registration). A frame is registered here with `register_waiting_code`.

Every other wait carries the same facts itself, as a ``Waiter``: one with a timeout (its
timer is a slot of it), one that ``submit`` registers before its task exists (no frame
awaits it yet), and one for several keys.

Reading a frame costs microseconds, but only the deadlock check (when the holder it looks
at is blocked) and ``stats()`` read them, never a hand-off. A burst of calls queued behind
one blocked holder would read the same frame again and again, so the last answer is
remembered (weakly) with the future it was read for: a task still blocked on that future
still waits for the same keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Hashable
from types import CodeType
from typing import Any, NamedTuple

from ._asyncio_internals import fut_waiter
from ._awaits import coroutine_chain, frame_of, tasks_waiting_for
from ._records import KeyHolders, MultiWaiter, TimedWaiter, Waiter

#: id of a registering coroutine's code -> the name of its local that holds the share.
_waiting_codes: dict[int, str] = {}
#: The registered code objects, kept so that their ids stay theirs.
_kept_codes: list[CodeType] = []


class TurnWait(NamedTuple):
    """What a blocked call waits for (a node of the deadlock check's walk, like a waiter)."""

    share: KeyHolders
    keys: tuple[Hashable, ...]
    since: float  # when the call registered, on the loop's clock


def register_waiting_code(code: CodeType, share_local: str) -> None:
    """Declare that a frame running ``code`` may await an exact future for a turn.

    Such a frame must have the locals ``waiter`` (the future), ``key``, ``since`` and
    ``share_local`` (the share), all set before it awaits ``waiter``.
    """
    _kept_codes.append(code)
    _waiting_codes[id(code)] = share_local


#: The last answer read off a frame: the task, the future it awaited, and what it waits for.
_last: tuple[weakref.ref[Any], weakref.ref[Any], TurnWait] | None = None


def turn_wait_of_task(task: asyncio.Task[Any]) -> TurnWait | None:
    """What ``task`` waits for, if it is blocked waiting for a turn; else None."""
    awaited: Any = fut_waiter(task)
    if awaited is None:
        return None
    global _last
    last = _last
    if last is not None and last[1]() is awaited and last[0]() is task:
        return last[2]  # asked first: a burst of calls behind one holder asks this
    kind: object = awaited.__class__
    if kind is Waiter or kind is TimedWaiter:
        return TurnWait(awaited.share, (awaited.key,), awaited.since)
    if kind is MultiWaiter:
        return TurnWait(awaited.share, awaited.keys, awaited.since)
    if kind is not asyncio.Future:
        return None
    found = _read_frames(task, awaited)
    if found is not None:
        with contextlib.suppress(TypeError):  # a task type without weak references
            _last = (weakref.ref(task), weakref.ref(awaited), found)
    return found


def waited_since(waiter: asyncio.Future[Any]) -> float | None:
    """When the call waiting on ``waiter`` registered; None if no frame says so."""
    if isinstance(waiter, Waiter):
        return waiter.since
    for task in tasks_waiting_for(waiter):
        found = _read_frames(task, waiter)
        if found is not None:
            return found.since
    return None


def _read_frames(task: asyncio.Task[Any], future: object) -> TurnWait | None:
    """What the innermost registering frame of ``task`` that awaits ``future`` waits for."""
    for coro in reversed(list(coroutine_chain(task))):
        frame = frame_of(coro)
        if frame is None:
            continue
        share_local = _waiting_codes.get(id(frame.f_code))
        if share_local is None:
            continue
        names = frame.f_locals
        if names.get("waiter") is not future:
            return None  # the innermost registering frame waits for something else
        try:
            return TurnWait(names[share_local], (names["key"],), names["since"])
        except KeyError:
            return None
    return None
