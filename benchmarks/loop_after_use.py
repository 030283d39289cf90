"""Whether a loop that keyserial has served runs everything else as fast as a fresh loop.

keyserial keeps a share per event loop and looks at the loop once, when the share is made.
How it looks matters beyond its own calls: on CPython 3.11 and 3.12, reading an object's
``__dict__`` moves its attributes out of their inline storage for good, and from then on
every attribute lookup on the loop takes the slow path — asyncio's own ``call_soon`` on every
wake-up of every task, keyserial's or not. This scenario times the same bare gather on two
loops, one that keyserial has served and one it never touched, paired round by round.
"""

from __future__ import annotations

import asyncio
import gc
import time

from keyserial import KeyedSerialQueue

from .timing import paired_medians

FRESH = "fresh loop"
SERVED = "loop keyserial has served"


async def _yield_once() -> None:
    await asyncio.sleep(0)


async def _use_every_kind_of_call(queue: KeyedSerialQueue) -> None:
    await asyncio.gather(*(queue.run(i % 10, _yield_once) for i in range(100)))
    await asyncio.gather(
        *(queue.with_options(timeout=5).run(i % 10, _yield_once) for i in range(100))
    )
    async with queue.lock("k", timeout=5):
        await queue.submit("other", _yield_once)


#: Calls per gather: small gathers, one after another, keep the timing about the loop
#: rather than about allocating a large batch of tasks at once.
GATHER_SIZE = 500


def seconds_per_bare_gather(calls: int, repeats: int, warmup: int = 1) -> dict[str, float]:
    """Seconds for ``calls`` bare calls that yield once, gathered in batches, on each loop.

    Runs the loops in the calling thread, which must not be running one already. The rounds
    are not timed through ``timing.interleave``: that times on a running loop, and reaching
    these loops from it through a worker thread made the same code's ratio spread over
    0.97 to 1.08 in three runs, against 1.00 to 1.01 timed here.
    """

    async def bare_gather() -> None:
        for _ in range(max(1, calls // GATHER_SIZE)):
            await asyncio.gather(*(_yield_once() for _ in range(GATHER_SIZE)))

    fresh, served = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        served.run_until_complete(_use_every_kind_of_call(KeyedSerialQueue()))
        loops = {FRESH: fresh, SERVED: served}
        times: dict[str, list[float]] = {name: [] for name in loops}
        for round_number in range(warmup + repeats):
            order = list(loops) if round_number % 2 == 0 else list(reversed(loops))
            for name in order:
                gc.collect()
                gc.disable()
                try:
                    start = time.perf_counter()
                    loops[name].run_until_complete(bare_gather())
                    elapsed = time.perf_counter() - start
                finally:
                    gc.enable()
                if round_number >= warmup:
                    times[name].append(elapsed)
        return paired_medians(times)
    finally:
        fresh.close()
        served.close()
