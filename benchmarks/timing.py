"""Interleaved timing: every variant of a scenario runs in the same process, A, B, A, B..."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Variant:
    """One way of running a scenario: ``setup`` is untimed, ``run`` is timed."""

    name: str
    run: Callable[[], Awaitable[object]]
    setup: Callable[[], object] = lambda: None


async def interleave(
    variants: Sequence[Variant], repeats: int, warmup: int = 1
) -> dict[str, float]:
    """Seconds per run of each variant, measured in alternating order, paired by round.

    Each round runs every variant once. A variant's figure is the first variant's median
    times the median of the variant's per-round ratio to the first: a machine that speeds
    up or slows down between rounds moves both sides of each ratio alike, where the ratio
    of two separate medians can pair a fast round of one variant with a slow one of the
    other. The first variant's own figure is its plain median.
    """
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for _ in range(warmup):
        for variant in variants:
            variant.setup()
            await variant.run()
    for repeat in range(repeats):
        # Alternate direction so that a slow drift of the machine hits every variant alike.
        order = variants if repeat % 2 == 0 else list(reversed(variants))
        for variant in order:
            variant.setup()
            gc.collect()
            gc.disable()
            try:
                start = time.perf_counter()
                await variant.run()
                times[variant.name].append(time.perf_counter() - start)
            finally:
                gc.enable()
    return paired_medians(times)


def paired_medians(times: dict[str, list[float]]) -> dict[str, float]:
    """Each variant's per-round ratio to the first variant, as a median, times its median."""
    reference = next(iter(times.values()))
    base = statistics.median(reference)
    return {
        name: base * statistics.median(a / b for a, b in zip(samples, reference, strict=True))
        for name, samples in times.items()
    }
