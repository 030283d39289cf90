"""Property test: interleaved calls with failures, cancellations and timeouts, drawn by hypothesis.

The schedule itself is drawn, so a failing one shrinks to a minimal list of calls.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any, NamedTuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keyserial import KeyedSerialQueue, Superseded

from .conftest import without_quick_waits
from .loops import LoopFactory, run_on


class Boom(Exception):
    """The failure a call raises on purpose; carries the call id."""


class Call(NamedTuple):
    """One call of a schedule, and what happens around it."""

    kind: str  # "run", "submit", "call" (timeout and coalescing) or "multi" (run_all)
    keys: tuple[int, ...]  # one key, or several for "multi"
    steps: int  # times the body yields
    fails: bool
    timeout: float | None
    group: str | None
    cancel: int | None  # then cancel the call at this index (modulo the calls so far)
    pause: float | None  # then let the loop run: one step (0) or a short sleep


@st.composite
def schedules(draw: st.DrawFn, multi_key: bool = False) -> tuple[int, list[Call]]:
    """A key count and a list of calls; hypothesis shrinks a failing one to a minimal one."""
    keys = draw(st.sampled_from([2, 3, 8, 50] if multi_key else [1, 3, 20, 200]))
    key = st.integers(0, keys - 1)
    kinds = ["run", "run", "submit", "call"] + (["multi"] if multi_key else [])
    call = st.builds(
        Call,
        kind=st.sampled_from(kinds),
        keys=st.lists(key, min_size=1, max_size=3, unique=True).map(tuple),
        steps=st.sampled_from([0, 0, 1, 2, 5]),
        fails=st.sampled_from([False, False, False, True]),
        timeout=st.sampled_from([None, None, 0.0, 0.0005, 10.0]),
        group=st.sampled_from([None, None, "coalesced"]),
        cancel=st.none() | st.none() | st.none() | st.integers(0, 10_000),
        pause=st.sampled_from([None, None, None, 0, 0, 0.0002]),
    )
    return keys, draw(st.lists(call, min_size=1, max_size=400))


async def run_schedule(keys: int, schedule: list[Call], quick_waits: bool) -> None:
    queue = KeyedSerialQueue()
    if not quick_waits:
        without_quick_waits(queue)
    # With eager tasks a task registers inside create_task(), like submit(); otherwise at its
    # first step, after the submits of the same loop iteration.
    eager = asyncio.get_running_loop().get_task_factory() is not None
    active: dict[int, int] = defaultdict(int)
    starts: dict[int, list[int]] = defaultdict(list)
    registrations: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    overlaps: list[tuple[int, int]] = []

    async def body(call_id: int, held: tuple[int, ...], steps: int, fail: bool) -> int:
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
    for call_id, call in enumerate(schedule):
        kind = call.kind
        held = call.keys if kind == "multi" else call.keys[:1]
        args = (call_id, held, call.steps, call.fails)
        order = 0 if eager else 1  # a task registers at its first step
        if kind == "multi":
            tasks.append(asyncio.create_task(queue.run_all(held, body, *args)))
        elif kind == "submit":
            tasks.append(queue.submit(held[0], body, *args))
            order = 0  # registers now
        elif kind == "call":
            coroutine = queue.with_options(timeout=call.timeout, group=call.group).run(
                held[0], body, *args
            )
            tasks.append(asyncio.create_task(coroutine))
        else:
            tasks.append(asyncio.create_task(queue.run(held[0], body, *args)))
        for k in held:
            registrations[k].append((epoch, order, call_id))
        if call.cancel is not None:
            tasks[call.cancel % len(tasks)].cancel()
        if call.pause is not None:
            epoch += 1
            await asyncio.sleep(call.pause)

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
    # A submitted task cancelled before its first step is withdrawn by its done callback,
    # which asyncio may run after gather() has returned: one loop iteration later.
    await asyncio.sleep(0)
    assert len(queue) == 0


def check(loop_factory: LoopFactory, keys: int, schedule: list[Call], quick_waits: bool) -> None:
    async def guarded() -> None:
        # A deadlock must fail this example (so that hypothesis can shrink it), not hang.
        await asyncio.wait_for(run_schedule(keys, schedule, quick_waits), timeout=30)

    run_on(loop_factory, guarded())


# The loop factory is a plain function chosen per test, the same for every example.
_SETTINGS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


#: run() and call() with their written-out registration, and with it switched off, so that
#: the same schedules cover both copies of it (see LoopShare.quick_waits).
_BOTH_COPIES = pytest.mark.parametrize("quick_waits", [True, False], ids=["quick", "register"])


@_BOTH_COPIES
@_SETTINGS
@given(drawn=schedules())
def test_random_schedules_keep_the_contract(
    loop_factory: LoopFactory, quick_waits: bool, drawn: tuple[int, list[Call]]
) -> None:
    check(loop_factory, *drawn, quick_waits)


@_BOTH_COPIES
@_SETTINGS
@given(drawn=schedules(multi_key=True))
def test_random_multi_key_schedules_keep_the_contract(
    loop_factory: LoopFactory, quick_waits: bool, drawn: tuple[int, list[Call]]
) -> None:
    check(loop_factory, *drawn, quick_waits)
