"""Every private field and frame of asyncio that keyserial reads, why, and where.

asyncio keeps no record of who waits for whom, nor a cheap way to ask for the running loop
on older Pythons; keyserial reads these from asyncio's own objects. They are private, so a
Python release may change them: ``tests/test_asyncio_internals.py`` checks each one named
here on the running Python and fails naming the field. Tested on CPython 3.10 to 3.13 and
uvloop (where a field is missing on uvloop, the public method is used instead).

Fields, read through the functions below unless noted:

``Task._fut_waiter``
    The future a blocked task's innermost ``await`` is parked on (None while it runs). The
    deadlock check and ``current_fence()`` follow it (``fut_waiter``). The in-process hot
    path reads it directly as ``getattr(task, "_fut_waiter", ...)`` (``_queue``, ``_share``)
    to tell a running holder from a blocked one without a call.
``BaseEventLoop._thread_id``
    The thread a loop runs in. Before Python 3.12, ``get_running_loop()`` makes a
    ``getpid()`` system call; ``_queue``'s hot path compares this field with the thread's id
    instead, read directly.
``BaseEventLoop._task_factory``, ``BaseEventLoop._closed``
    What ``get_task_factory()`` and ``is_closed()`` return, read directly by ``_queue`` and
    ``_share`` on asyncio's own loops only (``has_asyncio_accessors`` in ``_awaits``).
``asyncio.tasks._current_tasks``
    Before Python 3.12, the dict behind ``current_task()``: its ``get`` is the cheaper call
    (``current_tasks``).
``TaskGroup._tasks``
    The tasks a task group's ``__aexit__`` waits for (read in ``_awaits``).
Frames of asyncio's helpers
    ``asyncio.wait`` (its locals ``fs`` and ``return_when``), ``wait_for`` up to Python 3.11
    (``fut``), ``TaskGroup.__aexit__`` (``self``) and ``concurrent.futures``' worker ``run``
    (``self``): what a helper parked on a private future waits for (read in ``_awaits``).
Coroutine fields
    ``cr_await``, ``cr_frame``, ``cr_running`` (and the ``gi_`` ones of generator-based
    coroutines): public, but the chain they form is how a wait is followed (``_awaits``).
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any, cast

#: The private fields by object, for the test that checks them on each Python release.
FIELDS: dict[str, tuple[str, ...]] = {
    "asyncio.Task": ("_fut_waiter",),
    "asyncio.BaseEventLoop": ("_thread_id", "_task_factory", "_closed"),
    "asyncio.TaskGroup": ("_tasks",),
}
if sys.version_info < (3, 12):
    FIELDS["asyncio.tasks"] = ("_current_tasks",)


def fut_waiter(task: object) -> Any:
    """The future ``task`` is blocked on, or None (running, done, or not an asyncio task)."""
    return getattr(task, "_fut_waiter", None)


def current_tasks() -> dict[asyncio.AbstractEventLoop, asyncio.Task[Any]] | None:
    """Before Python 3.12, the dict of each loop's running task; else None."""
    found: Any = getattr(asyncio.tasks, "_current_tasks", None)
    if sys.version_info < (3, 12) and isinstance(found, dict):
        return cast("dict[asyncio.AbstractEventLoop, asyncio.Task[Any]]", found)
    return None
