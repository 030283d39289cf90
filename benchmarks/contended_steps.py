"""What a contended ``run`` costs beyond a minimal keyed queue, step by step up to keyserial's.

    python -m benchmarks.contended_steps            # 20,000 calls over 100 keys, 15 rounds
    python -m benchmarks.contended_steps --quick    # tiny sizes, for CI smoke runs

The contended target compares a gather of calls over 100 keys, each of which yields once,
with a bare gather of the same calls. This scenario times that gather, in the same rounds
and paired by round, through keyed queues that each do one step more than the one before:

* a minimal keyed FIFO: a dict of deques of exact futures, and nothing else;
* + run's signature: the same, called as ``run(key, fn, /, *args, **kwargs)``;
* + the holding task: the key's entry is the task holding its turn (what a re-entry and the
  deadlock check are recognised by), a per-key record once a call waits, and the turn
  handed on by a method, as keyserial's share keeps them;
* + the clock: the registration time, taken by the waiting call, and the turn's start, in
  the per-key record: what ``stats()`` reports ``longest_wait`` and ``longest_running`` from;
* keyserial's ``run`` itself.

The bare gather and the floor (a bare gather whose calls are each woken once more, as a
call that waits for its turn must be) run in the same rounds. The built-up queues keep
calls of a key in order and one at a time, and nothing else: they handle neither
cancellation nor re-entry, and exist to be timed here. Each writes its whole body out, as
``run`` does: a helper shared between them would add a frame to every call, and that frame
would be timed too.
"""

from __future__ import annotations

import argparse
import asyncio
from asyncio import Future
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from time import monotonic
from typing import Any, ParamSpec, TypeVar

from keyserial import KeyedSerialQueue
from keyserial._loops import get_running_loop, task_of

from .adapters import Bare, Fn, Step
from .report import step_table
from .scenarios import FLOOR, floor_variant, gathered_variant, yield_once
from .timing import interleave

T = TypeVar("T")
P = ParamSpec("P")


class MinimalFifo:
    """A keyed FIFO and nothing else: each busy key has a deque of the futures waiting on it."""

    __slots__ = ("queues",)

    def __init__(self) -> None:
        self.queues: dict[Hashable, deque[Future[None]]] = {}

    def __len__(self) -> int:
        return len(self.queues)

    async def run(self, key: Hashable, fn: Fn) -> Any:
        queues = self.queues
        waiting = queues.get(key)
        if waiting is None:
            queues[key] = deque()
        else:
            waiter: Future[None] = Future()
            waiting.append(waiter)
            await waiter
        try:
            return await fn()
        finally:
            waiting = queues[key]
            if waiting:
                waiting.popleft().set_result(None)
            else:
                del queues[key]


class WithRunSignature(MinimalFifo):
    """``MinimalFifo`` called as ``run`` is: ``(key, fn, /, *args, **kwargs)``."""

    __slots__ = ()

    async def run(
        self, key: Hashable, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs
    ) -> T:
        queues = self.queues
        waiting = queues.get(key)
        if waiting is None:
            queues[key] = deque()
        else:
            waiter: Future[None] = Future()
            waiting.append(waiter)
            await waiter
        try:
            if kwargs:
                return await fn(*args, **kwargs)
            if args:
                return await fn(*args)  # type: ignore[call-arg]
            return await fn()  # type: ignore[call-arg]
        finally:
            waiting = queues[key]
            if waiting:
                waiting.popleft().set_result(None)
            else:
                del queues[key]


class KeyRecord:
    """A contended key: the task holding its turn, the calls registered, the waiting futures."""

    __slots__ = ("holder", "pending", "since", "waiters")

    def __init__(self, holder: asyncio.Task[Any] | None) -> None:
        self.holder = holder
        self.pending = 1
        self.since = 0.0
        self.waiters: deque[Future[bool]] = deque()


class WithHoldingTask:
    """``WithRunSignature`` keeping the holding task, and a ``KeyRecord`` once a call waits."""

    __slots__ = ("holders",)

    def __init__(self) -> None:
        self.holders: dict[Hashable, asyncio.Task[Any] | KeyRecord | None] = {}

    def __len__(self) -> int:
        return len(self.holders)

    async def run(
        self, key: Hashable, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs
    ) -> T:
        task = task_of(get_running_loop())
        holders = self.holders
        holder = holders[key] if key in holders else None  # noqa: SIM401  # as run() reads it
        if holder is None:
            holders[key] = task
        else:
            if type(holder) is not KeyRecord:
                holder = holders[key] = KeyRecord(holder)  # type: ignore[arg-type]
            waiter: Future[bool] = Future()
            holder.pending += 1
            holder.waiters.append(waiter)
            await waiter
            holder.holder = task
        try:
            if kwargs:
                return await fn(*args, **kwargs)
            if args:
                return await fn(*args)  # type: ignore[call-arg]
            return await fn()  # type: ignore[call-arg]
        finally:
            held = holders.pop(key)
            if held is not task:
                self.release(key, held)  # type: ignore[arg-type]

    def release(self, key: Hashable, record: KeyRecord) -> None:
        """End a contended turn: hand it to the next waiting call, or drop the key."""
        self.holders[key] = record
        record.pending -= 1
        if record.waiters:
            record.holder = None
            record.waiters.popleft().set_result(True)
        elif record.pending == 0:
            del self.holders[key]


class WithClock(WithHoldingTask):
    """``WithHoldingTask`` reading the clock when a call registers and when its turn starts."""

    __slots__ = ()

    async def run(
        self, key: Hashable, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs
    ) -> T:
        task = task_of(get_running_loop())
        holders = self.holders
        holder = holders[key] if key in holders else None  # noqa: SIM401  # as run() reads it
        if holder is None:
            holders[key] = task
        else:
            if type(holder) is not KeyRecord:
                holder = holders[key] = KeyRecord(holder)  # type: ignore[arg-type]
            waiter: Future[bool] = Future()
            holder.pending += 1
            holder.waiters.append(waiter)
            since = monotonic()  # noqa: F841  # pyright: ignore[reportUnusedVariable]  # as run()
            await waiter
            holder.holder, holder.since = task, monotonic()
        try:
            if kwargs:
                return await fn(*args, **kwargs)
            if args:
                return await fn(*args)  # type: ignore[call-arg]
            return await fn()  # type: ignore[call-arg]
        finally:
            held = holders.pop(key)
            if held is not task:
                self.release(key, held)  # type: ignore[arg-type]


#: The keyed queues, in the order of their steps; the last is keyserial's.
STEPS: dict[str, Callable[[], Any]] = {
    "a minimal keyed FIFO": MinimalFifo,
    "+ run's signature": WithRunSignature,
    "+ the holding task": WithHoldingTask,
    "+ the clock": WithClock,
    "keyserial's run": KeyedSerialQueue,
}


async def seconds_per_gather(calls: int, keys: int, repeats: int) -> dict[str, float]:
    """Seconds for ``calls`` gathered calls over ``keys`` keys, each yielding once, per variant."""
    spread = [i % keys for i in range(calls)]
    variants = [
        gathered_variant(Bare(), spread, yield_once),
        floor_variant(spread, yield_once),
        *(gathered_variant(Step(name, make), spread, yield_once) for name, make in STEPS.items()),
    ]
    return await interleave(variants, repeats)


def report(seconds: dict[str, float], calls: int, keys: int, command: str) -> str:
    """The table of ns per call and each variant's ratio to the bare gather."""
    title = f"Contended, step by step: {calls:,} calls over {keys:,} keys, each yields once"
    lines = step_table(title, seconds, calls, Bare.name, command)
    lines += [
        "",
        f"{FLOOR}: a bare gather whose calls are each woken once more, as any call that",
        "waits for its turn must be.",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.contended_steps")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for CI smoke runs")
    parser.add_argument("--repeats", type=int, default=15, help="interleaved rounds")
    options = parser.parse_args()
    calls, keys = (500, 10) if options.quick else (20_000, 100)
    repeats = 1 if options.quick else options.repeats
    seconds = asyncio.run(seconds_per_gather(calls, keys, repeats))
    command = "python -m benchmarks.contended_steps" + (" --quick" if options.quick else "")
    print(report(seconds, calls, keys, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
