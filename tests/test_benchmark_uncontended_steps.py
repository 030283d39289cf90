"""The step-by-step uncontended runs must do what run() does for an uncontended call."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from benchmarks.uncontended_steps import STEPS, WithTurnRecord, report, seconds_per_run


async def _pair(a: int, b: int = 0, *, c: int = 0) -> tuple[int, int, int]:
    await asyncio.sleep(0)
    return a, b, c


@pytest.mark.parametrize("name", list(STEPS))
def test_each_step_returns_what_fn_returns_and_frees_the_key(name: str) -> None:
    async def main() -> list[Any]:
        queue = STEPS[name]()
        results = [
            await queue.run("k", _pair, 1),
            await queue.run("k", _pair, 1, 2),
            await queue.run("k", _pair, 1, c=3),
        ]
        assert len(queue) == 0
        return results

    assert asyncio.run(main()) == [(1, 0, 0), (1, 2, 0), (1, 0, 3)]


@pytest.mark.parametrize("name", [name for name in STEPS if name != "keyserial's run"])
def test_a_built_up_step_refuses_a_busy_key_instead_of_queueing(name: str) -> None:
    async def main() -> None:
        queue = STEPS[name]()
        started = asyncio.Event()
        release = asyncio.Event()

        async def hold() -> None:
            started.set()
            await release.wait()

        holder = asyncio.ensure_future(queue.run("k", hold))
        await started.wait()
        with pytest.raises(RuntimeError, match="busy"):
            await queue.run("k", hold)
        release.set()
        await holder

    asyncio.run(main())


def test_the_report_has_a_row_per_variant_with_its_ratio_to_the_lock() -> None:
    seconds = asyncio.run(seconds_per_run(calls=50, repeats=1))
    table = report(seconds, 50, "python -m benchmarks.uncontended_steps --quick")
    rows = [line for line in table.splitlines() if line.startswith("| ") and "ns/call" not in line]
    assert [row.split(" | ")[0][2:] for row in rows] == ["one asyncio.Lock", *STEPS]
    assert rows[0].endswith("| 1.00 |")


def test_the_turn_record_holds_the_innermost_turn_and_nothing_once_it_ends() -> None:
    async def main() -> None:
        queue = WithTurnRecord()
        task = asyncio.current_task()
        assert task is not None
        seen: list[Any] = []

        async def inner() -> None:
            seen.append(queue.turns[task][2])

        async def outer() -> None:
            seen.append(queue.turns[task][2])
            await queue.run("inner", inner)
            seen.append(queue.turns[task][2])

        await queue.run("outer", outer)
        assert seen == ["outer", "inner", "outer"]
        assert queue.turns == {}

    asyncio.run(main())
