"""The step-by-step contended queues must keep each key's calls in order and one at a time."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from benchmarks.contended_steps import STEPS, report, seconds_per_gather

WITH_RUN_SIGNATURE = [name for name in STEPS if name != "a minimal keyed FIFO"]


@pytest.mark.parametrize("name", list(STEPS))
def test_a_step_runs_one_keys_calls_one_at_a_time_in_registration_order(name: str) -> None:
    async def main() -> tuple[list[int], list[str]]:
        queue = STEPS[name]()
        log: list[str] = []

        def call(n: int) -> Any:
            async def fn() -> int:
                log.append(f"start {n}")
                await asyncio.sleep(0)
                await asyncio.sleep(0)
                log.append(f"end {n}")
                return n

            return queue.run("k", fn)

        results = await asyncio.gather(*(call(n) for n in range(3)))
        assert len(queue) == 0
        return results, log

    results, log = asyncio.run(main())
    assert results == [0, 1, 2]
    assert log == ["start 0", "end 0", "start 1", "end 1", "start 2", "end 2"]


@pytest.mark.parametrize("name", list(STEPS))
def test_a_step_lets_another_key_run_while_one_key_is_held(name: str) -> None:
    async def main() -> list[str]:
        queue = STEPS[name]()
        log: list[str] = []
        release = asyncio.Event()

        async def hold() -> None:
            log.append("a holds")
            await release.wait()
            log.append("a ends")

        async def other() -> None:
            log.append("b runs")
            release.set()

        await asyncio.gather(queue.run("a", hold), queue.run("b", other))
        assert len(queue) == 0
        return log

    assert asyncio.run(main()) == ["a holds", "b runs", "a ends"]


async def _pair(a: int, b: int = 0, *, c: int = 0) -> tuple[int, int, int]:
    await asyncio.sleep(0)
    return a, b, c


@pytest.mark.parametrize("name", WITH_RUN_SIGNATURE)
def test_a_step_with_runs_signature_passes_arguments_through(name: str) -> None:
    async def main() -> list[Any]:
        queue = STEPS[name]()
        return list(
            await asyncio.gather(
                queue.run("k", _pair, 1), queue.run("k", _pair, 1, 2), queue.run("k", _pair, 1, c=3)
            )
        )

    assert asyncio.run(main()) == [(1, 0, 0), (1, 2, 0), (1, 0, 3)]


def test_the_report_has_a_row_per_variant_with_its_ratio_to_the_bare_gather() -> None:
    seconds = asyncio.run(seconds_per_gather(calls=60, keys=3, repeats=1))
    table = report(seconds, 60, 3, "python -m benchmarks.contended_steps --quick")
    rows = [line for line in table.splitlines() if line.startswith("| ") and "ns/call" not in line]
    names = [row.split(" | ")[0][2:] for row in rows]
    assert names == ["bare await", "bare await + one extra wake-up (floor)", *STEPS]
    assert rows[0].endswith("| 1.00 |")
