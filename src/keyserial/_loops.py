"""Fast access to the running event loop's current task, and upkeep of per-loop state.

``asyncio.current_task()`` is implemented in C from Python 3.12 on. On 3.10
and 3.11 it is a Python function that looks the running loop up again and
then reads a module-level dict; since the queue already holds the loop, it
reads that dict directly, which is what ``current_task(loop)`` does there.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Any, TypeVar

V = TypeVar("V")

TaskOf = Callable[[asyncio.AbstractEventLoop], "asyncio.Task[Any] | None"]


def _select_task_of() -> TaskOf:
    if sys.version_info < (3, 12):
        current_tasks = getattr(asyncio.tasks, "_current_tasks", None)
        if isinstance(current_tasks, dict):
            return current_tasks.get
    return asyncio.current_task


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
