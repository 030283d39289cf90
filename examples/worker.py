"""A worker that dispatches a stream of events with ``queue.submit``.

Events for many segments arrive on an ``asyncio.Queue``. The consumer does not
wait for one event to be handled before taking the next: it submits each to a
keyed queue, which runs the events of one segment in arrival order and those of
different segments concurrently. On Ctrl-C (or when the stream ends) it stops
taking events, and ``aclose()`` refuses new work and waits for what was taken.

Run it:  python examples/worker.py [--events N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import signal
from dataclasses import dataclass, field

from keyserial import KeyedSerialQueue

STOP = None


@dataclass
class Stats:
    handled: dict[str, list[int]] = field(default_factory=dict[str, list[int]])
    running: int = 0
    max_running: int = 0


async def handle(stats: Stats, seg_id: str, seq: int, latency: float) -> None:
    stats.running += 1
    stats.max_running = max(stats.max_running, stats.running)
    await asyncio.sleep(latency)
    stats.handled.setdefault(seg_id, []).append(seq)
    stats.running -= 1


async def produce(events: asyncio.Queue[tuple[str, int, float] | None], count: int) -> None:
    rng = random.Random(1)
    seq_per_segment: dict[str, int] = {}
    for _ in range(count):
        seg_id = f"seg-{rng.randrange(8)}"
        seq = seq_per_segment[seg_id] = seq_per_segment.get(seg_id, 0) + 1
        await events.put((seg_id, seq, rng.uniform(0, 0.003)))
    await events.put(STOP)


async def consume(events: asyncio.Queue[tuple[str, int, float] | None], stats: Stats) -> None:
    queue = KeyedSerialQueue()
    try:
        while (event := await events.get()) is not None:  # None is STOP
            seg_id, seq, latency = event
            queue.submit(seg_id, handle, stats, seg_id, seq, latency)
    finally:
        # Also on Ctrl-C: no new work, and every submitted event is finished.
        await asyncio.shield(queue.aclose())


async def main(count: int) -> Stats:
    events: asyncio.Queue[tuple[str, int, float] | None] = asyncio.Queue(maxsize=50)
    stats = Stats()
    consumer = asyncio.create_task(consume(events, stats))
    with contextlib.suppress(NotImplementedError):  # not on every platform
        asyncio.get_running_loop().add_signal_handler(signal.SIGINT, consumer.cancel)
    await produce(events, count)
    with contextlib.suppress(asyncio.CancelledError):
        await consumer
    return stats


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--events", type=int, default=400)
    stats = asyncio.run(main(parser.parse_args().events))
    in_order = all(seqs == sorted(seqs) for seqs in stats.handled.values())
    total = sum(len(seqs) for seqs in stats.handled.values())
    print(f"handled {total} events for {len(stats.handled)} segments")
    print(f"per-segment order kept: {in_order}")
    print(f"most events running at once: {stats.max_running}")
