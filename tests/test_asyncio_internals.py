"""The private parts of asyncio that keyserial reads are still there on this Python.

Each check names the field: when a Python release renames or drops one, this fails first
and says which, before the deadlock check or the hot path misbehave in many places at once.
See keyserial/_asyncio_internals.py for why each is read.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from typing import Any

import pytest

from keyserial import _asyncio_internals as internals

pytestmark = pytest.mark.timeout(30)


def test_every_catalogued_field_exists_on_this_python() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        blocked = asyncio.ensure_future(asyncio.sleep(10))
        await asyncio.sleep(0)
        samples: dict[str, Any] = {
            "asyncio.Task": blocked,
            "asyncio.BaseEventLoop": loop,
            "asyncio.tasks": asyncio.tasks,
        }
        if sys.version_info >= (3, 11):
            async with asyncio.TaskGroup() as group:
                samples["asyncio.TaskGroup"] = group
        for owner, fields in internals.FIELDS.items():
            if owner not in samples:
                continue  # TaskGroup before Python 3.11
            for field in fields:
                assert hasattr(samples[owner], field), (
                    f"{owner}.{field} is gone in Python {sys.version.split()[0]}: "
                    "keyserial/_asyncio_internals.py says what reads it"
                )
        assert internals.fut_waiter(blocked) is not None, "Task._fut_waiter: no longer set"
        blocked.cancel()
        await asyncio.gather(blocked, return_exceptions=True)
        assert internals.fut_waiter(blocked) is None

    asyncio.run(main())


def test_current_tasks_is_asyncios_own_table_before_312() -> None:
    async def main() -> None:
        tasks = internals.current_tasks()
        if sys.version_info < (3, 12):
            assert tasks is not None, "asyncio.tasks._current_tasks is gone"
            assert tasks.get(asyncio.get_running_loop()) is asyncio.current_task()
        else:
            assert tasks is None

    asyncio.run(main())


def test_the_wait_helpers_frames_still_hold_what_is_read() -> None:
    # asyncio.wait's locals ``fs`` and ``return_when`` explain what a waiting task waits for.
    code = asyncio.tasks._wait.__code__  # type: ignore[attr-defined]  # pyright: ignore[reportAttributeAccessIssue]
    assert {"fs", "return_when"} <= set(code.co_varnames), (
        f"asyncio.tasks._wait no longer has the locals fs and return_when: {code.co_varnames}"
    )


def test_the_hot_paths_getters_read_the_catalogued_fields() -> None:
    catalogued = {field for fields in internals.FIELDS.values() for field in fields}
    getters = (internals.loop_task_factory, internals.loop_closed, internals.loop_thread_id)
    read = {repr(getter).split("'")[1] for getter in getters}  # operator.attrgetter('_x')
    assert read <= catalogued

    async def main() -> None:
        loop = asyncio.get_running_loop()
        if not internals.has_asyncio_accessors(loop):
            return  # uvloop: the getters are not used (see LoopShare)
        assert internals.loop_task_factory(loop) is loop.get_task_factory(), (
            "BaseEventLoop._task_factory is no longer what get_task_factory() returns"
        )
        assert internals.loop_closed(loop) is loop.is_closed() is False, (
            "BaseEventLoop._closed is no longer what is_closed() returns"
        )

    asyncio.run(main())


def test_a_loops_thread_id_names_its_thread_exactly_while_it_runs() -> None:
    # What run() relies on where FIND_LOOP_BY_THREAD holds (see LoopShare.quick_loop).
    loop = asyncio.new_event_loop()
    try:
        assert internals.finds_loop_by_thread(loop) is internals.FIND_LOOP_BY_THREAD
        assert internals.loop_thread_id(loop) is None, (
            "BaseEventLoop._thread_id is set before the loop runs"
        )

        async def seen() -> object:
            return internals.loop_thread_id(asyncio.get_running_loop())

        assert loop.run_until_complete(seen()) == threading.get_ident(), (
            "BaseEventLoop._thread_id is no longer the running thread's id while the loop runs"
        )
        assert internals.loop_thread_id(loop) is None, (
            "BaseEventLoop._thread_id is no longer cleared when the loop stops"
        )
    finally:
        loop.close()
