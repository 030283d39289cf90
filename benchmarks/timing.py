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
    """Median seconds per run of each variant, measured in alternating order."""
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
    return {name: statistics.median(samples) for name, samples in times.items()}
