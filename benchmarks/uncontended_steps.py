"""What each step of an uncontended ``run`` costs: keyed runs built up to keyserial's, step by step.

    python -m benchmarks.uncontended_steps            # 200,000 calls, 11 rounds
    python -m benchmarks.uncontended_steps --quick    # tiny sizes, for CI smoke runs

The uncontended target compares ``run`` with an ``async with`` on one ``asyncio.Lock``
around the same call. This scenario times, in the same rounds and paired by round, keyed
runs that each do one step more than the one before, with the signature of ``run``:

* the key alone: find the loop and the task, insert the key, call, pop the key;
* the loop's share: the same, with the key table found through keyserial's own per-loop
  routing (``LoopShares``), as ``run`` finds it (before Python 3.12, by the loop's thread
  rather than by ``get_running_loop()``, so this step can cost less than the one before);
* the checks: the same, with the checks ``run`` makes on the way (a closed share, tested
  where the share is found, and a call outside a task) and at the turn's end (a turn
  that needs attention or was contended);
* a record of the turn: the same, also recording each running turn by its task (outer
  turn, share, key, function), as ``run`` records it (``keyserial._turns``);
* keyserial's ``run`` itself.

The three built-up runs never queue: a busy key raises. They exist to be timed here. Each
writes its whole body out, as ``run`` does: a helper shared between them would add a frame
to every call, and that frame would be timed too.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable, Hashable
from threading import get_ident
from typing import Any, ParamSpec, TypeVar

from keyserial import KeyedSerialQueue
from keyserial._asyncio_internals import loop_thread_id
from keyserial._loops import LoopShares, get_running_loop, task_of

from .adapters import SharedLock, Step
from .report import step_table
from .scenarios import sequential_variant
from .timing import interleave

T = TypeVar("T")
P = ParamSpec("P")


class KeyAlone:
    """A keyed run that finds the loop and the task, and inserts and pops the key."""

    __slots__ = ("holders",)

    def __init__(self) -> None:
        self.holders: dict[Hashable, asyncio.Task[Any] | None] = {}

    def __len__(self) -> int:
        return len(self.holders)

    async def run(
        self, key: Hashable, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs
    ) -> T:
        loop = get_running_loop()
        task = task_of(loop)
        holders = self.holders
        if key in holders:
            raise RuntimeError(f"key {key!r} is busy: this run does not queue")
        holders[key] = task
        try:
            if kwargs:
                return await fn(*args, **kwargs)
            if args:
                return await fn(*args)  # type: ignore[call-arg]
            return await fn()  # type: ignore[call-arg]
        finally:
            holders.pop(key)


class ThroughLoopShare:
    """``KeyAlone`` with the key table found through the loop's share, as ``run`` finds it."""

    __slots__ = ("_shares",)

    def __init__(self) -> None:
        self._shares = LoopShares(detect_deadlocks=True, count_calls=False)

    def __len__(self) -> int:
        return len(self._shares.cached.holders)

    async def run(
        self, key: Hashable, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs
    ) -> T:
        share = self._shares.cached
        loop = share.quick_loop  # as run() finds it (see LoopShare.quick_loop)
        if loop is None or loop_thread_id(loop) != get_ident():
            loop = get_running_loop()
            if share.open_loop is not loop:
                share = self._shares.of(loop)
        task = task_of(loop)
        holders = share.holders
        if key in holders:
            raise RuntimeError(f"key {key!r} is busy: this run does not queue")
        holders[key] = task  # type: ignore[assignment]
        try:
            if kwargs:
                return await fn(*args, **kwargs)
            if args:
                return await fn(*args)  # type: ignore[call-arg]
            return await fn()  # type: ignore[call-arg]
        finally:
            holders.pop(key)


class ThroughLoopShareChecked(ThroughLoopShare):
    """``ThroughLoopShare`` with the checks ``run`` makes on an uncontended call."""

    __slots__ = ()

    async def run(
        self, key: Hashable, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs
    ) -> T:
        share = self._shares.cached
        loop = share.quick_loop  # as run() finds it (see LoopShare.quick_loop)
        if loop is None or loop_thread_id(loop) != get_ident():
            loop = get_running_loop()
            if share.open_loop is not loop:
                share = self._shares.of(loop)
                if share.closed:
                    raise RuntimeError("closed")
        task = task_of(loop)
        if task is None:
            raise RuntimeError("not in a task")
        holders = share.holders
        holder = holders[key] if key in holders else None  # noqa: SIM401  # as run() reads it
        if holder is not None:
            raise RuntimeError(f"key {key!r} is busy: this run does not queue")
        holders[key] = task
        try:
            if kwargs:
                return await fn(*args, **kwargs)
            if args:
                return await fn(*args)  # type: ignore[call-arg]
            return await fn()  # type: ignore[call-arg]
        finally:
            held = holders.pop(key)
            if share.attention:
                share.end_turn(key, held, task)
            elif held is not task:
                share.release(key, held)  # type: ignore[arg-type]


class WithTurnRecord(ThroughLoopShare):
    """``ThroughLoopShareChecked`` that also records each running turn by its task, as
    ``run`` does for ``current_fence()``, the deadlock check and their messages (a tuple
    per turn, chained to the task's outer turn, in a dict)."""

    __slots__ = ("turns",)

    def __init__(self) -> None:
        super().__init__()
        self.turns: dict[asyncio.Task[Any], tuple[Any, ...]] = {}

    async def run(
        self, key: Hashable, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs
    ) -> T:
        share = self._shares.cached
        loop = share.quick_loop  # as run() finds it (see LoopShare.quick_loop)
        if loop is None or loop_thread_id(loop) != get_ident():
            loop = get_running_loop()
            if share.open_loop is not loop:
                share = self._shares.of(loop)
                if share.closed:
                    raise RuntimeError("closed")
        task = task_of(loop)
        if task is None:
            raise RuntimeError("not in a task")
        holders = share.holders
        holder = holders[key] if key in holders else None  # noqa: SIM401  # as run() reads it
        if holder is not None:
            raise RuntimeError(f"key {key!r} is busy: this run does not queue")
        holders[key] = task
        turns = self.turns
        outer = turns[task] if task in turns else None  # noqa: SIM401  # as run() reads it
        turns[task] = (outer, share, key, fn)
        try:
            if kwargs:
                return await fn(*args, **kwargs)
            if args:
                return await fn(*args)  # type: ignore[call-arg]
            return await fn()  # type: ignore[call-arg]
        finally:
            if outer is None:
                del turns[task]
            else:
                turns[task] = outer
            held = holders.pop(key)
            if share.attention:
                share.end_turn(key, held, task)
            elif held is not task:
                share.release(key, held)  # type: ignore[arg-type]


#: The keyed runs, in the order of their steps; the last is keyserial's.
STEPS: dict[str, Callable[[], Any]] = {
    "the key alone": KeyAlone,
    "+ the loop's share": ThroughLoopShare,
    "+ the checks": ThroughLoopShareChecked,
    "+ a record of the turn": WithTurnRecord,
    "keyserial's run": KeyedSerialQueue,
}


async def seconds_per_run(calls: int, repeats: int) -> dict[str, float]:
    """Seconds for ``calls`` sequential calls on distinct keys, per variant, paired by round."""
    keys = list(range(calls))
    adapters = [SharedLock(), *(Step(name, make) for name, make in STEPS.items())]
    return await interleave([sequential_variant(a, keys) for a in adapters], repeats)


def report(seconds: dict[str, float], calls: int, command: str) -> str:
    """The table of ns per call and each variant's ratio to the lock."""
    title = f"Uncontended, step by step: {calls:,} sequential calls, distinct keys"
    return "\n".join(step_table(title, seconds, calls, SharedLock.name, command))


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.uncontended_steps")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for CI smoke runs")
    parser.add_argument("--repeats", type=int, default=11, help="interleaved rounds")
    options = parser.parse_args()
    calls = 2_000 if options.quick else 200_000
    repeats = 1 if options.quick else options.repeats
    seconds = asyncio.run(seconds_per_run(calls, repeats))
    command = "python -m benchmarks.uncontended_steps" + (" --quick" if options.quick else "")
    print(report(seconds, calls, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
