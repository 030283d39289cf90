"""The benchmarks' timing: a variant's figure is paired with the first variant's, round by round."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from benchmarks import timing
from benchmarks.timing import Variant, interleave, paired_medians


def test_a_slow_moment_of_one_variant_does_not_move_the_paired_ratio() -> None:
    # The machine's speed changes from round to round (1, 3, 2); b takes 1.5x a in every
    # round but the first, where it ran at a slow moment.
    times = {"a": [1.0, 3.0, 2.0], "b": [4.0, 4.5, 3.0]}
    figures = paired_medians(times)
    assert figures == {"a": 2.0, "b": 3.0}  # ratio 1.5; separate medians would say 2.0


def test_interleave_reports_paired_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    def variant(name: str, seconds: list[float]) -> Variant:
        remaining = iter(seconds)

        async def run() -> None:
            now[0] += next(remaining)

        return Variant(name, run)

    figures = asyncio.run(
        interleave([variant("a", [1.0, 3.0, 2.0]), variant("b", [4.0, 4.5, 3.0])], 3, warmup=0)
    )
    assert figures == {"a": 2.0, "b": 3.0}


def test_runs_of_different_targets_are_refused_rather_than_paired_by_position() -> None:
    from benchmarks.report import Target, median_targets

    first = [Target("a", 1.0, 2.0), Target("b", 1.0, 2.0)]
    same = [Target("a", 3.0, 2.0), Target("b", 5.0, 2.0)]
    assert [t.measured for t in median_targets([first, same, same])] == [3.0, 5.0]
    another = [Target("a", 1.0, 2.0), Target("new", 9.0, 2.0), Target("b", 1.0, 2.0)]
    with pytest.raises(ValueError, match="different targets"):
        median_targets([first, another])
