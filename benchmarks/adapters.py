"""Each way of serializing calls per key, behind one tiny adapter.

An adapter runs a sequence of calls inline (``sequential``), so that the timed
loop holds nothing but the pattern itself, and wraps one call as a coroutine
(``call``) for the scenarios that gather or queue many calls at once.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Sequence
from typing import Any

from keyserial import KeyedSerialQueue

Fn = Callable[[], Awaitable[Any]]


class Adapter:
    name = "adapter"

    def reset(self) -> None:
        """Start from an empty state (called before every timed run)."""

    async def sequential(self, keys: Sequence[Hashable], fn: Fn) -> None:
        raise NotImplementedError

    def call(self, key: Hashable, fn: Fn) -> Coroutine[Any, Any, Any]:
        raise NotImplementedError

    def entries(self) -> int:
        """Entries the adapter keeps for keys (after all work has finished)."""
        return 0


class Bare(Adapter):
    name = "bare await"

    async def sequential(self, keys: Sequence[Hashable], fn: Fn) -> None:
        for _ in keys:
            await fn()

    def call(self, key: Hashable, fn: Fn) -> Coroutine[Any, Any, Any]:
        return fn()  # type: ignore[return-value]


class SharedLock(Adapter):
    name = "one asyncio.Lock"

    def reset(self) -> None:
        self.lock = asyncio.Lock()

    async def sequential(self, keys: Sequence[Hashable], fn: Fn) -> None:
        lock = self.lock
        for _ in keys:
            async with lock:
                await fn()

    async def call(self, key: Hashable, fn: Fn) -> Any:
        async with self.lock:
            return await fn()


class DefaultDictLocks(Adapter):
    name = "defaultdict(Lock)"

    def reset(self) -> None:
        self.locks: defaultdict[Hashable, asyncio.Lock] = defaultdict(asyncio.Lock)

    async def sequential(self, keys: Sequence[Hashable], fn: Fn) -> None:
        locks = self.locks
        for key in keys:
            async with locks[key]:
                await fn()

    async def call(self, key: Hashable, fn: Fn) -> Any:
        async with self.locks[key]:
            return await fn()

    def entries(self) -> int:
        return len(self.locks)


class AsyncioKeyedLock(Adapter):
    name = "asyncio-keyed-lock"

    def reset(self) -> None:
        from asyncio_keyed_lock import AsyncioKeyedLock as KeyedLock

        self.lock = KeyedLock()

    async def sequential(self, keys: Sequence[Hashable], fn: Fn) -> None:
        lock = self.lock
        for key in keys:
            async with lock(key):  # type: ignore[arg-type]
                await fn()

    async def call(self, key: Hashable, fn: Fn) -> Any:
        async with self.lock(key):  # type: ignore[arg-type]
            return await fn()

    def entries(self) -> int:
        return self.lock.active_keys_count


class PromiseChain(Adapter):
    """A direct port of the TypeScript design: each key keeps the tail of its last call.

    Every call chains on the previous tail and leaves a tail of its own that
    never fails; the map entry is dropped when the last tail settles. Like its
    model it creates a task (a promise) per call, and like its model it has no
    answer to cancellation: a cancelled waiter settles its tail early and lets
    the next call overlap the running one.
    """

    name = "promise chain"

    def reset(self) -> None:
        self.tails: dict[Hashable, asyncio.Future[None]] = {}

    def call(self, key: Hashable, fn: Fn) -> Coroutine[Any, Any, Any]:
        previous = self.tails.get(key)

        async def chained() -> Any:
            if previous is not None:
                await previous
            return await fn()

        task = asyncio.ensure_future(chained())
        tail: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def settle_tail(_: object) -> None:
            # A waiter cancelled while awaiting its predecessor's tail cancels that tail too.
            if not tail.done():
                tail.set_result(None)

        task.add_done_callback(settle_tail)
        tails = self.tails
        tails[key] = tail
        tail.add_done_callback(lambda _: tails.pop(key) if tails.get(key) is tail else None)
        return _await(task)

    async def sequential(self, keys: Sequence[Hashable], fn: Fn) -> None:
        for key in keys:
            await self.call(key, fn)

    def entries(self) -> int:
        return len(self.tails)


async def _await(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


class Keyserial(Adapter):
    name = "keyserial"

    def reset(self) -> None:
        self.queue = KeyedSerialQueue()

    async def sequential(self, keys: Sequence[Hashable], fn: Fn) -> None:
        queue = self.queue
        for key in keys:
            await queue.run(key, fn)

    def call(self, key: Hashable, fn: Fn) -> Coroutine[Any, Any, Any]:
        return self.queue.run(key, fn)

    def entries(self) -> int:
        return len(self.queue)


class Step(Adapter):
    """A keyed run of the step-by-step benchmarks (``queue.run(key, fn)``), made anew by ``make``
    before every timed run."""

    def __init__(self, name: str, make: Callable[[], Any]) -> None:
        self.name = name
        self.make = make
        self.reset()

    def reset(self) -> None:
        self.queue = self.make()

    async def sequential(self, keys: Sequence[Hashable], fn: Fn) -> None:
        enqueue = self.queue.run
        for key in keys:
            await enqueue(key, fn)

    def call(self, key: Hashable, fn: Fn) -> Coroutine[Any, Any, Any]:
        return self.queue.run(key, fn)  # type: ignore[no-any-return]

    def entries(self) -> int:
        return len(self.queue)


def all_adapters() -> list[Adapter]:
    return [
        Keyserial(),
        Bare(),
        SharedLock(),
        DefaultDictLocks(),
        AsyncioKeyedLock(),
        PromiseChain(),
    ]
