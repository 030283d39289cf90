"""Static typing checks, run by ``mypy --strict`` in CI (not collected by pytest).

``@serialized`` must keep the decorated parameter and return types, for
functions and methods alike.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from keyserial import KeyedSerialQueue, KeyLock, serialized

if TYPE_CHECKING:
    from typing_extensions import assert_type


@serialized(key="seg_id")
async def save(seg_id: str, revision: int, *, final: bool = False) -> float:
    return 1.0


@serialized
async def no_key(x: int) -> list[int]:
    return [x]


class Service:
    @serialized(key=lambda self, seg_id, *a, **k: seg_id)
    async def finalize(self, seg_id: str) -> bytes:
        return b""


async def check() -> None:
    queue = KeyedSerialQueue()
    coroutine = save("a", 1)
    _ = assert_type(coroutine, Coroutine[Any, Any, float])
    coroutine.close()
    assert_type(await save("a", 1, final=True), float)
    assert_type(await no_key(3), list[int])
    assert_type(await Service().finalize("s"), bytes)
    assert_type(await queue.run("k", save, "a", 2), float)
    assert_type(queue.submit("k", no_key, 1), asyncio.Task[list[int]])
    assert_type(queue.pending("k"), int)
    async with queue.lock("k", timeout=1.0):
        pass
    assert_type(queue.lock("k"), KeyLock)
    assert_type(queue.lock_all(["a", "b"]), KeyLock)
    assert_type(await queue.run_all(["a", "b"], save, "a", 2), float)
    # Wrong calls must still be type errors (strict mode also fails on unused ignores).
    if TYPE_CHECKING:
        _ = save("a")  # type: ignore[call-arg]
        _ = save("a", "not an int")  # type: ignore[arg-type]
        _ = Service().finalize(1)  # type: ignore[arg-type]
        # The queue's own entry points check the function's arguments too.
        _ = queue.run("k", save, "a")  # type: ignore[call-arg]
        _ = queue.run("k", save, "a", "not an int")  # type: ignore[arg-type]
        _ = queue.submit("k", no_key)  # type: ignore[call-arg]
        _ = queue.run_all(["k"], no_key, "x")  # type: ignore[arg-type]
