"""Property test: thousands of interleaved calls with failures, cancellations and timeouts."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from keyserial import KeyedSerialQueue, Superseded


class Boom(Exception):
    """The failure a call raises on purpose; carries the call id."""


async def run_schedule(seed: int, calls: int, keys: int, multi_key: bool = False) -> None:
    rng = random.Random(seed)
    queue = KeyedSerialQueue()
    active: dict[int, int] = defaultdict(int)
    starts: dict[int, list[int]] = defaultdict(list)
    registrations: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    overlaps: list[tuple[int, int]] = []

    async def body(call_id: int, key: int | tuple[int, ...], steps: int, fail: bool) -> int:
        held = key if isinstance(key, tuple) else (key,)
        for k in held:
            active[k] += 1
            if active[k] != 1:
                overlaps.append((k, call_id))
            starts[k].append(call_id)
        try:
            for _ in range(steps):
                await asyncio.sleep(0)
        finally:
            for k in held:
                active[k] -= 1
        if fail:
            raise Boom(call_id)
        return call_id

    tasks: list[asyncio.Task[Any]] = []
    epoch = 0
    for call_id in range(calls):
        key: int | tuple[int, ...] = rng.randrange(keys)
        kind = rng.random()
        if multi_key and kind > 0.75:
            key = tuple(rng.sample(range(keys), min(keys, rng.choice([2, 3]))))
        args = (call_id, key, rng.choice([0, 0, 1, 2, 5]), rng.random() < 0.2)
        if isinstance(key, tuple):
            tasks.append(asyncio.create_task(queue.run_all(key, body, *args)))
            for k in key:
                registrations[k].append((epoch, 1, call_id))
        elif kind < 0.3:
            tasks.append(queue.submit(key, body, *args))
            order = 0  # registers now
        elif kind < 0.45:
            timeout = rng.choice([0.0, 0.0005, 10.0])
            group = rng.choice([None, None, "coalesced"])
            tasks.append(asyncio.create_task(queue.call(key, body, args, {}, timeout, group)))
            order = 1  # registers at the task's first step, after this epoch's submits
        else:
            tasks.append(asyncio.create_task(queue.run(key, body, *args)))
            order = 1
        if not isinstance(key, tuple):
            registrations[key].append((epoch, order, call_id))
        if rng.random() < 0.08:
            rng.choice(tasks).cancel()
        if rng.random() < 0.3:
            epoch += 1
            await asyncio.sleep(rng.choice([0, 0, 0, 0.0002]))

    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    started = {call_id for ids in starts.values() for call_id in ids}
    for call_id, outcome in enumerate(outcomes):
        if isinstance(outcome, Boom):
            assert outcome.args == (call_id,)
            assert call_id in started
        elif isinstance(outcome, asyncio.CancelledError):
            pass  # cancelled while waiting (never started) or while running
        elif isinstance(outcome, (TimeoutError, Superseded)):
            assert call_id not in started
        else:
            assert outcome == call_id
            assert call_id in started
    assert overlaps == []
    for key, registered in registrations.items():
        expected = [call_id for _, _, call_id in sorted(registered) if call_id in started]
        assert starts[key] == expected, f"key {key}: start order differs from registration order"
    assert len(queue) == 0


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), keys=st.sampled_from([1, 3, 20, 200]))
def test_random_schedules_keep_the_contract(seed: int, keys: int) -> None:
    async def guarded() -> None:
        # A deadlock must fail this example (so that hypothesis can shrink it), not hang.
        await asyncio.wait_for(run_schedule(seed, calls=1500, keys=keys), timeout=30)

    asyncio.run(guarded())


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), keys=st.sampled_from([2, 3, 8, 50]))
def test_random_multi_key_schedules_keep_the_contract(seed: int, keys: int) -> None:
    async def guarded() -> None:
        await asyncio.wait_for(
            run_schedule(seed, calls=1500, keys=keys, multi_key=True), timeout=30
        )

    asyncio.run(guarded())
