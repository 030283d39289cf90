"""A reference copy of ``KeyedSerialQueue.run`` as it was before stats() counted anything.

The benchmark runs it beside the real ``run`` to price, in the same process, what
stats() counting costs the uncontended path of a queue that does not count calls: the
``except`` clause that counts failures. It is the real method's body with that clause
removed, and nothing else; keep it so.
"""

# mypy: ignore-errors

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable
from typing import Any, TypeVar

from keyserial import KeyedSerialQueue
from keyserial._loops import get_running_loop, task_of
from keyserial._queue import _outside_task, _unhashable
from keyserial._state import closed_error

T = TypeVar("T")


class UncountedQueue(KeyedSerialQueue):
    __slots__ = ()

    async def run(
        self, key: Hashable, fn: Callable[..., Awaitable[T]], /, *args: Any, **kwargs: Any
    ) -> T:
        timeout = None
        loop = get_running_loop()
        part = self._cached
        if part.loop is not loop:
            part = self._partition(loop)
        task = task_of(loop)
        if task is None:
            raise _outside_task()
        try:
            holder = part.get(key)
        except TypeError:
            raise _unhashable(key) from None
        if holder is None:
            if part.closed:
                raise closed_error(key)
            part[key] = task  # the uncontended path: one dict entry, nothing else
        else:
            waiter = part.register(key, holder, task, timeout, self._max_pending)
            if waiter is None:  # re-entry: run inside the turn this task holds
                return await fn(*args, **kwargs)
            try:
                await waiter
            except BaseException:
                part.give_up(key, waiter)
                raise
            part.take_turn(key, waiter, task)
        try:
            if kwargs:
                return await fn(*args, **kwargs)
            return await fn(*args)  # unpacking an empty **kwargs costs measurably here
        finally:
            held = part.pop(key)
            if held is not task or part.attention:
                part.end_turn(key, held, task)
