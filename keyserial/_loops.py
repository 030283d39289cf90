"""The running loop and its current task, fast; and routing from a loop to a queue's share.

Every queue behaves as if each event loop had its own: ``LoopShares`` keeps one
``LoopShare`` per loop, remembers the last one used (the common case is one loop), and
forgets the shares of loops that closed.

``asyncio.current_task()`` is implemented in C from Python 3.12 on. On 3.10
and 3.11 it is a Python function that looks the running loop up again and
then reads a module-level dict; since the queue already holds the loop, it
reads that dict directly, which is what ``current_task(loop)`` does there.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, TypeVar

from ._asyncio_internals import current_tasks
from ._errors import called, closed_error, key_error
from ._share import LoopShare

V = TypeVar("V")
T = TypeVar("T")

TaskOf = Callable[[asyncio.AbstractEventLoop], "asyncio.Task[Any] | None"]


def _select_task_of() -> TaskOf:
    tasks = current_tasks()
    return asyncio.current_task if tasks is None else tasks.get


task_of: TaskOf = _select_task_of()
get_running_loop = asyncio.get_running_loop


def _async_library() -> str | None:
    """The async library running this code, as sniffio names it (``"trio"``), if known."""
    try:
        import sniffio

        return sniffio.current_async_library()
    except Exception:  # sniffio missing, or no library it knows of
        return None


def no_event_loop() -> RuntimeError:
    """The error for a keyserial call made with no asyncio event loop running."""
    library = _async_library()
    if library is not None and library != "asyncio":
        return RuntimeError(
            f"keyserial needs an asyncio event loop, but this code runs under {library}: "
            "run it with asyncio, uvloop, or anyio on its asyncio backend"
        )
    return RuntimeError("keyserial needs a running asyncio event loop; none runs in this thread")


def running_loop() -> asyncio.AbstractEventLoop:
    """The running asyncio event loop.

    Raises:
        RuntimeError: none is running (no loop at all, or another library's, such as trio).
    """
    try:
        return get_running_loop()
    except RuntimeError:
        raise no_event_loop() from None


def drop_closed_loops(per_loop: dict[asyncio.AbstractEventLoop, V]) -> None:
    """Forget the entries of loops that are closed: such a loop never runs its tasks again."""
    for closed in [loop for loop in per_loop if loop.is_closed()]:
        del per_loop[closed]


def outside_task() -> RuntimeError:
    return RuntimeError("keyserial calls must run inside an asyncio task")


class LoopShares:
    """A queue's shares, one per event loop; ``cached`` is the last one used."""

    __slots__ = ("by_loop", "cached", "count_calls", "detect_deadlocks", "switch")

    def __init__(self, detect_deadlocks: bool, count_calls: bool) -> None:
        self.detect_deadlocks = detect_deadlocks
        self.count_calls = count_calls
        self.by_loop: dict[asyncio.AbstractEventLoop, LoopShare] = {}
        # The last share used; it carries its loop, so one read gives a consistent pair
        # even when threads with loops of their own share the queue.
        self.cached = LoopShare(None, detect_deadlocks, count_calls)
        self.switch = threading.Lock()

    def of(self, loop: asyncio.AbstractEventLoop) -> LoopShare:
        """The share of ``loop``, made on first use."""
        share = self.cached
        if share.loop is loop:
            return share
        with self.switch:
            found = self.by_loop.get(loop)
            if found is None:
                # A closed loop never runs its tasks again: dropping its share keeps a later
                # loop unaffected by work it left registered, and frees what it held.
                drop_closed_loops(self.by_loop)
                found = self.by_loop[loop] = LoopShare(
                    loop, self.detect_deadlocks, self.count_calls
                )
            self.cached = share = found
        return share

    def close(self, loop: asyncio.AbstractEventLoop) -> None:
        """Close ``loop``'s share for good: it refuses new calls; registered ones still run."""
        self.of(loop).close()

    def running(self) -> tuple[LoopShare, asyncio.Task[Any]]:
        """The running loop's share and the current task.

        Raises:
            RuntimeError: no asyncio loop runs, or the caller is not in a task.
        """
        loop = running_loop()
        share = self.of(loop)
        task = task_of(loop)
        if task is None:
            raise outside_task()
        return share, task

    def inspected(self) -> LoopShare:
        """The running loop's share, or the last one used when no loop runs (for reading)."""
        try:
            loop = get_running_loop()
        except RuntimeError:
            return self.cached
        return self.of(loop)


async def on_closed_share(
    share: LoopShare,
    key: Hashable,
    fn: Callable[..., Awaitable[T]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> T:
    """A call that found its loop's share closed: it runs only inside its task's own turn.

    A task holding ``key``'s turn may still call in it (a re-entry runs at once, as on an
    open queue); any other call is refused. The errors come in ``run``'s order.

    Raises:
        RuntimeError: awaited outside an asyncio task.
        TypeError: ``key`` is not hashable.
        QueueClosed: the call is not a re-entry.
    """
    task = asyncio.current_task()
    if task is None:
        raise outside_task()
    try:
        holder = share.holder_of(key)
    except Exception as exc:
        raise key_error(key, exc) from exc
    if holder is not task:
        raise closed_error(key)
    return await called(fn, args, kwargs)
