"""The race keyserial fixes, in a transcript pipeline.

Every segment of a transcript receives three updates in quick succession:
a partial result, a revision and the final text. Each update is saved with a
random latency. Run concurrently, a slow early update can finish after a fast
later one and overwrite it: the segment ends in a stale state. With
``@serialized(key="seg_id")`` the updates of one segment are saved in order,
while different segments still save concurrently.

Latencies are counted in event-loop steps rather than seconds, so a given
seed always gives the same table.

Run it:  python examples/transcript_pipeline.py [--segments N] [--seed S]
"""

from __future__ import annotations

import argparse
import asyncio
import random
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from keyserial import KeyedSerialQueue, serialized

STAGES = ("partial", "revision", "final")


@dataclass
class Store:
    """The database the pipeline writes to: the last saved stage of each segment."""

    saved: dict[str, str] = field(default_factory=dict[str, str])
    max_concurrent: int = 0
    _in_flight: int = 0

    async def write(self, seg_id: str, stage: str, latency: int) -> None:
        self._in_flight += 1
        self.max_concurrent = max(self.max_concurrent, self._in_flight)
        for _ in range(latency):  # the write takes `latency` event-loop steps
            await asyncio.sleep(0)
        self.saved[seg_id] = stage
        self._in_flight -= 1


Handler = Callable[[str, str, int], Coroutine[Any, Any, None]]


@dataclass(frozen=True)
class Event:
    at_step: int
    seg_id: str
    stage: str
    latency: int


def make_events(segments: int, seed: int) -> list[Event]:
    """Three updates per segment, a few steps apart, each with a random save latency."""
    rng = random.Random(seed)
    events: list[Event] = []
    for n in range(segments):
        start = rng.randrange(50)
        for order, stage in enumerate(STAGES):
            events.append(Event(start + 2 * order, f"seg-{n:03d}", stage, rng.randrange(1, 12)))
    return sorted(events, key=lambda e: (e.at_step, e.seg_id))


async def replay(events: list[Event], handler: Handler) -> None:
    """Deliver each event at its step, without waiting for earlier ones to be saved."""
    tasks: list[asyncio.Task[None]] = []
    step = 0
    for event in events:
        while step < event.at_step:
            await asyncio.sleep(0)
            step += 1
        tasks.append(asyncio.create_task(handler(event.seg_id, event.stage, event.latency)))
    await asyncio.gather(*tasks)


async def run_unserialized(events: list[Event]) -> Store:
    store = Store()

    async def save(seg_id: str, stage: str, latency: int) -> None:
        await store.write(seg_id, stage, latency)

    await replay(events, save)
    return store


async def run_serialized(events: list[Event]) -> Store:
    store = Store()

    @serialized(key="seg_id", queue=KeyedSerialQueue())
    async def save(seg_id: str, stage: str, latency: int) -> None:
        await store.write(seg_id, stage, latency)

    await replay(events, save)
    return store


def stale_segments(store: Store) -> list[str]:
    return sorted(seg for seg, stage in store.saved.items() if stage != "final")


def report(segments: int, seed: int, results: dict[str, Store]) -> str:
    lines = [
        f"{segments} segments, 3 updates each (partial -> revision -> final), seed {seed}",
        "",
        f"{'mode':<14}{'stale at end':>14}{'max concurrent saves':>22}  example",
    ]
    for mode, store in results.items():
        stale = stale_segments(store)
        example = f"{stale[0]} ended as {store.saved[stale[0]]!r}" if stale else "-"
        lines.append(f"{mode:<14}{len(stale):>14}{store.max_concurrent:>22}  {example}")
    return "\n".join(lines)


async def main(segments: int, seed: int) -> dict[str, Store]:
    events = make_events(segments, seed)
    return {
        "unserialized": await run_unserialized(events),
        "@serialized": await run_serialized(events),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--segments", type=int, default=200)
    parser.add_argument("--seed", type=int, default=7)
    options = parser.parse_args()
    results = asyncio.run(main(options.segments, options.seed))
    print(report(options.segments, options.seed, results))
