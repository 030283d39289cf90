"""The event loop setups every async test runs on: asyncio's default, eager tasks, uvloop.

``pytest_asyncio_loop_factories`` in ``conftest.py`` parametrizes each async test over
``LOOP_FACTORIES``; tests that start loops themselves (``asyncio.run`` style) take the
``loop_factory`` fixture and use :func:`run_on`.

``KEYSERIAL_TEST_LOOPS`` (names separated by commas, such as ``default,uvloop``) keeps only
the named setups of those this Python has: CI runs every setup on its newest Python and the
default loop on the others, to stay within its time.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def eager_loop() -> asyncio.AbstractEventLoop:
    """A default loop whose tasks start eagerly, inside ``create_task`` (Python 3.12+)."""
    loop = asyncio.new_event_loop()
    loop.set_task_factory(asyncio.eager_task_factory)  # type: ignore[attr-defined,unused-ignore]
    return loop


def _factories() -> dict[str, LoopFactory]:
    factories: dict[str, LoopFactory] = {"default": asyncio.new_event_loop}
    if sys.version_info >= (3, 12):
        factories["eager"] = eager_loop
    try:
        import uvloop
    except ImportError:  # not installable on this platform (Windows)
        pass
    else:
        factories["uvloop"] = uvloop.new_event_loop
    wanted = os.environ.get("KEYSERIAL_TEST_LOOPS")
    if wanted is None:
        return factories
    names = [name.strip() for name in wanted.split(",") if name.strip()]
    unknown = [name for name in names if name not in ("default", "eager", "uvloop")]
    if unknown or "default" not in names:
        raise ValueError(
            f"KEYSERIAL_TEST_LOOPS={wanted!r}: name loop setups among default, eager and "
            "uvloop, default among them (the fair-mode tests run on it)"
        )
    return {name: factory for name, factory in factories.items() if name in names}


LOOP_FACTORIES = _factories()


def run_on(factory: LoopFactory, main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on a loop made by ``factory``."""
    loop = factory()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
