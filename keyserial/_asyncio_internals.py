"""Every private field and frame of asyncio that keyserial reads, why, and where.

asyncio keeps no record of who waits for whom, nor a cheap way to ask for the running loop
on older Pythons; keyserial reads these from asyncio's own objects. They are private, so a
Python release may change them: ``tests/test_asyncio_internals.py`` checks each one named
here on the running Python and fails naming the field. Tested on CPython 3.10 to 3.13 and
uvloop (where a field is missing on uvloop, the public method is used instead).

Fields, read through the functions below unless noted:

``Task._fut_waiter``
    The future a blocked task's innermost ``await`` is parked on (None while it runs). The
    deadlock check and ``current_fence()`` follow it, and the in-process queue tells a
    running holder from a blocked one by it (``fut_waiter``).
``BaseEventLoop._task_factory``, ``BaseEventLoop._closed``
    What ``get_task_factory()`` and ``is_closed()`` return, read by ``_queue`` and
    ``_share`` on asyncio's own loops only (``has_asyncio_accessors``), through the C
    getters ``loop_task_factory`` and ``loop_closed``.
``BaseEventLoop._thread_id``
    The thread running the loop, or None while it does not run. Before Python 3.12,
    ``get_running_loop()`` makes a ``getpid()`` system call on every call (to notice a
    fork); ``run`` instead asks whether its cached share's loop runs in this thread
    (``loop_thread_id``, ``FIND_LOOP_BY_THREAD``), which only the running loop does. Only
    on asyncio's own loops (uvloop has no such field).
``asyncio.tasks._current_tasks``
    Before Python 3.12, the dict behind ``current_task()``: its ``get`` is the cheaper call
    (``current_tasks``).
``TaskGroup._tasks``
    The tasks a task group's ``__aexit__`` waits for (``waits_of_task``).
Frames of asyncio's helpers
    ``asyncio.wait`` (its locals ``fs`` and ``return_when``), ``wait_for`` up to Python 3.11
    (``fut``), ``TaskGroup.__aexit__`` (``self``) and ``concurrent.futures``' worker ``run``
    (``self``): what a helper parked on a private future waits for (``waits_of_task``).
Coroutine fields
    ``cr_await``, ``cr_frame``, ``cr_running`` (and the ``gi_`` ones of generator-based
    coroutines): public, but the chain they form is how a wait is followed (``coroutine_chain``).

Who waits for whom among asyncio tasks, read off asyncio's own objects
-------------------------------------------------------------------------

Two questions need it. The deadlock check asks what a blocked task waits for (forward):
``await task``, ``gather``, ``TaskGroup``, ``wait``, ``shield`` and ``wait_for`` each leave a
different trace. ``current_fence()`` asks, from a helper task or thread, which task waits
for it (backward), to find the turn that the helper works for.

asyncio keeps no wait-for graph, so both are reconstructed from what it does keep:

* a blocked task's ``_fut_waiter`` — the future its innermost ``await`` is parked on;
* its coroutine chain (``cr_await``) — the coroutines awaiting one another down to that
  future, whose frames say which asyncio helper is waiting (``TaskGroup.__aexit__``,
  ``wait``, and ``wait_for`` up to Python 3.11, which park on a private future);
* a future's done callbacks — a task's wake-up method, or a closure of ``gather``,
  ``shield``, ``wait`` or ``wait_for`` holding the future it completes in turn.

The attributes read here are private to asyncio but unchanged from Python 3.10 to 3.13,
and each read tolerates their absence: a wait that cannot be explained is treated as a wait
on something outside the graph (no edge), which can miss a cycle but never invents one.
"""

from __future__ import annotations

import asyncio
import operator
import sys
import time
from collections.abc import Iterable, Iterator
from types import FrameType
from typing import Any, NamedTuple, TypeGuard, cast

#: The private fields by object, for the test that checks them on each Python release.
FIELDS: dict[str, tuple[str, ...]] = {
    "asyncio.Task": ("_fut_waiter",),
    "asyncio.BaseEventLoop": ("_task_factory", "_closed", "_thread_id"),
    "asyncio.TaskGroup": ("_tasks",),
}
if sys.version_info < (3, 12):
    FIELDS["asyncio.tasks"] = ("_current_tasks",)

#: C getters of the loop's fields for the hot path (``_queue``, ``_share``): calling one
#: costs less than calling a Python method, and keeps the private names in this module.
#: Used only where ``has_asyncio_accessors`` says they are what the public methods return.
loop_task_factory = operator.attrgetter("_task_factory")
loop_closed = operator.attrgetter("_closed")
#: The loop's running thread (see ``BaseEventLoop._thread_id`` above), for ``run``'s hot path
#: before Python 3.12, on loops where ``finds_loop_by_thread`` holds.
loop_thread_id = operator.attrgetter("_thread_id")
#: Whether the hot path finds the running loop by its thread rather than by
#: ``get_running_loop()``: only where that call costs a system call (before Python 3.12).
FIND_LOOP_BY_THREAD = sys.version_info < (3, 12)


def fut_waiter(task: object) -> Any:
    """The future ``task`` is blocked on, or None (running, done, or not an asyncio task)."""
    return getattr(task, "_fut_waiter", None)


def is_blocked_task(candidate: object) -> bool:
    """Whether ``candidate`` is a task blocked on a future; True too for a non-task."""
    return getattr(candidate, "_fut_waiter", True) is not None


def current_tasks() -> dict[asyncio.AbstractEventLoop, asyncio.Task[Any]] | None:
    """Before Python 3.12, the dict of each loop's running task; else None."""
    found: Any = getattr(asyncio.tasks, "_current_tasks", None)
    if sys.version_info < (3, 12) and isinstance(found, dict):
        return cast("dict[asyncio.AbstractEventLoop, asyncio.Task[Any]]", found)
    return None


#: How long a thread waits for its work to be chained to the loop's future (seconds).
_CHAIN_WAIT = 1.0
#: How deep a coroutine chain or a callback chain is followed; deeper ones are not explained.
MAX_DEPTH = 64

_WAIT_CODES = {asyncio.tasks.wait.__code__.co_name: "wait", "_wait": "wait"}
_TASKS_FILE = asyncio.tasks.__file__


class WaitsOn(NamedTuple):
    """What a blocked task or a pending future waits for: all of ``on``, or any one of them."""

    every: bool
    on: tuple[Any, ...]
    via: str  # how, for messages: "awaits", "gather", "TaskGroup", "wait", "shield", ...


def is_task(candidate: object) -> TypeGuard[asyncio.Task[Any]]:
    """Whether ``candidate`` is an asyncio task: asyncio's own, or a Python ``Task`` subclass
    that does not derive from the C one (as some runners and test plugins use)."""
    return asyncio.isfuture(candidate) and hasattr(candidate, "get_coro")


def coroutine_chain(task: asyncio.Task[Any]) -> Iterator[Any]:
    """The coroutines of ``task`` awaiting one another, outermost first (none once it is done)."""
    if task.done():
        return  # and get_coro() of an eager task that finished at once crashes 3.12.0-3.12.1
    coro: Any = task.get_coro()
    for _ in range(MAX_DEPTH):
        if coro is None:
            return
        yield coro
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)


def frame_of(coro: Any) -> FrameType | None:
    return getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)


#: Only Python 3.12 and later start tasks eagerly; before 3.14 (``create_task(...,
#: eager_start=True)``) only through a task factory such as ``eager_task_factory``.
EAGER_TASKS = sys.version_info >= (3, 12)
EAGER_NEEDS_FACTORY = sys.version_info < (3, 14)


def may_start_eagerly(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether a task created on ``loop`` may run its first step inside ``create_task()``."""
    return EAGER_TASKS and (not EAGER_NEEDS_FACTORY or loop.get_task_factory() is not None)


def has_asyncio_accessors(loop: asyncio.AbstractEventLoop | None) -> bool:
    """Whether ``loop.is_closed()`` and ``loop.get_task_factory()`` are asyncio's own, which
    return the fields ``_closed`` and ``_task_factory``: a hand-off asks both, and reading
    the field spares the frame of a Python method each time (uvloop's are C methods).
    """
    base = asyncio.BaseEventLoop
    return (
        isinstance(loop, base)
        and type(loop).is_closed is base.is_closed
        and type(loop).get_task_factory is base.get_task_factory
    )


def finds_loop_by_thread(loop: asyncio.AbstractEventLoop | None) -> bool:
    """Whether ``loop`` runs exactly while its ``_thread_id`` is the running thread's id:
    asyncio's own loops set it as they start running and clear it as they stop."""
    return FIND_LOOP_BY_THREAD and isinstance(loop, asyncio.BaseEventLoop)


def is_running(task: asyncio.Task[Any]) -> bool:
    """Whether ``task`` is in the middle of a step (another task started eagerly inside it)."""
    return not task.done() and bool(getattr(task.get_coro(), "cr_running", False))


def tasks_mid_step(task: asyncio.Task[Any]) -> list[asyncio.Task[Any]]:
    """The tasks other than the running ``task`` that are in the middle of a step: those that
    started ``task`` eagerly (inside ``create_task``), whose waits are not settled yet.

    Only a loop that starts tasks eagerly can have any; elsewhere this reads nothing.
    """
    loop = task.get_loop()
    if not may_start_eagerly(loop):
        return []
    return [other for other in asyncio.all_tasks(loop) if other is not task and is_running(other)]


def _task_group_tasks(frame: FrameType) -> tuple[Any, ...] | None:
    """The tasks a task group waits for, if ``frame`` is its ``__aexit__`` (asyncio or anyio)."""
    if frame.f_code.co_name not in ("__aexit__", "_aexit"):
        return None
    group = frame.f_locals.get("self")
    tasks: Any = getattr(group, "_tasks", None)
    if type(group).__name__ != "TaskGroup" or not isinstance(tasks, (set, list)):
        return None
    return tuple(cast("Iterable[Any]", tasks))


def _explained_by_frame(frame: FrameType) -> WaitsOn | None:
    """The wait of an asyncio helper parked on a future of its own, read from its frame."""
    code = frame.f_code
    tasks = _task_group_tasks(frame)
    if tasks is not None:
        return WaitsOn(True, tasks, "TaskGroup")
    if code.co_filename != _TASKS_FILE:
        return None
    local = frame.f_locals
    if code.co_name in _WAIT_CODES and "fs" in local:
        every = local.get("return_when", asyncio.ALL_COMPLETED) == asyncio.ALL_COMPLETED
        return WaitsOn(every, tuple(local["fs"]), "asyncio.wait")
    if code.co_name == "wait_for" and isinstance(local.get("fut"), asyncio.Future):
        return WaitsOn(True, (local["fut"],), "wait_for")  # Python 3.10 and 3.11
    return None


def waits_of_task(task: asyncio.Task[Any]) -> WaitsOn | None:
    """What the blocked ``task`` waits for; None if it is not blocked on a future."""
    future = fut_waiter(task)
    if future is None:
        return None
    for coro in coroutine_chain(task):
        frame = frame_of(coro)
        if frame is not None and (found := _explained_by_frame(frame)) is not None:
            return found
    if is_task(future):
        return WaitsOn(True, (future,), "awaits")
    return waits_of_future(future)


def _closure_value(function: Any, name: str) -> Any:
    code = getattr(function, "__code__", None)
    cells = getattr(function, "__closure__", None)
    if code is None or cells is None or name not in code.co_freevars:
        return None
    try:
        return cells[code.co_freevars.index(name)].cell_contents
    except ValueError:  # an empty cell
        return None


def _callbacks(future: Any) -> list[Any]:
    return [callback for callback, _context in getattr(future, "_callbacks", None) or ()]


def waits_of_future(future: Any) -> WaitsOn | None:
    """What completes the pending ``future`` in turn (a gather's children, a shield's inner)."""
    children: Any = getattr(future, "_children", None)
    if type(future).__name__ == "_GatheringFuture" and isinstance(children, list):
        found: list[Any] = children  # pyright: ignore[reportUnknownVariableType]
        return WaitsOn(True, tuple(found), "gather")
    for callback in _callbacks(future):
        if getattr(callback, "__qualname__", "") == "shield.<locals>._outer_done_callback":
            inner = _closure_value(callback, "inner")
            if inner is not None:
                return WaitsOn(True, (inner,), "shield")
    return None


# -- backward: who waits for a task ---------------------------------------------------------


def _completes(callback: Any) -> Iterator[Any]:
    """What finishing the future with this done callback wakes: tasks, futures, task groups."""
    owner = getattr(callback, "__self__", None)
    if is_task(owner):  # the wake-up method of a task awaiting the future
        yield owner
        return
    parent = getattr(owner, "_parent_task", None)  # TaskGroup._on_task_done (asyncio, anyio)
    if is_task(parent):
        yield parent
        return
    name = getattr(callback, "__qualname__", "")
    if name in ("gather.<locals>._done_callback", "shield.<locals>._inner_done_callback"):
        yield _closure_value(callback, "outer")
    elif name == "_wait.<locals>._on_completion":
        yield _closure_value(callback, "waiter")
    elif name == "_chain_future.<locals>._call_set_state":  # a thread's future -> the loop's
        yield _closure_value(callback, "destination")
    elif name == "TaskGroup._spawn.<locals>.task_done":  # anyio's task group on asyncio
        scope = getattr(_closure_value(callback, "self"), "cancel_scope", None)
        yield getattr(scope, "_host_task", None)
    else:
        partial_of = getattr(callback, "func", None)  # wait_for's partial(_release_waiter, w)
        if getattr(partial_of, "__name__", "") == "_release_waiter":
            yield from getattr(callback, "args", ())[:1]


def woken_by(future: Any) -> Iterator[Any]:
    """What finishing the asyncio ``future`` wakes directly: tasks, futures, or None."""
    for callback in _callbacks(future):
        yield from _completes(callback)


def tasks_waiting_for(future: Any) -> list[asyncio.Task[Any]]:
    """The tasks that wait, directly or through asyncio helpers, for ``future`` to finish."""
    found: list[asyncio.Task[Any]] = []
    seen: set[int] = set()
    frontier = [future]
    while frontier and len(seen) < MAX_DEPTH * 4:
        current = frontier.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        callbacks = (
            getattr(current, "_done_callbacks", None)  # a concurrent.futures.Future
            if not asyncio.isfuture(current)
            else _callbacks(current)
        )
        for callback in callbacks or ():
            for woken in _completes(callback):
                if is_task(woken):
                    found.append(woken)
                elif woken is not None:
                    frontier.append(woken)
    return found


def future_of_thread_work() -> asyncio.Future[Any] | None:
    """The loop's future for the executor work this thread runs (``to_thread``), if any."""
    frame: FrameType | None = sys._getframe(1)  # pyright: ignore[reportPrivateUsage]
    while frame is not None:
        if frame.f_code.co_name == "run" and "concurrent" in frame.f_code.co_filename:
            work = getattr(frame.f_locals.get("self"), "future", None)
            return None if work is None else _loop_future_of(work)
        frame = frame.f_back
    return None


def _loop_future_of(work: Any) -> asyncio.Future[Any] | None:
    # run_in_executor() chains the loop's future to the work's just after submitting it,
    # so a thread that starts at once can get here first: give the loop's thread a moment.
    deadline = time.monotonic() + _CHAIN_WAIT
    while True:
        for callback in list(getattr(work, "_done_callbacks", None) or ()):
            for woken in _completes(callback):
                if asyncio.isfuture(woken):
                    return woken
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.0005)
