"""The benchmark scenarios. Each returns rows of (variant, value) for one table."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
from collections.abc import Callable, Coroutine, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import wrapt

from keyserial import KeyedSerialQueue, serialized

from . import loop_after_use
from .adapters import Adapter, Fn, Keyserial
from .timing import Variant, interleave


@dataclass
class Table:
    """One result table: a value per variant, with ratios of keyserial to each."""

    id: str
    title: str
    unit: str
    values: dict[str, float] = field(default_factory=dict[str, float])
    reference: str = "keyserial"
    notes: list[str] = field(default_factory=list[str])
    ratios: bool = True
    #: For the many-waiters tables: total time of the largest run over the middle one.
    growth: dict[str, float] = field(default_factory=dict[str, float])


async def noop() -> None:
    return None


async def yield_once() -> None:
    await asyncio.sleep(0)


def _ns_per_call(seconds: dict[str, float], calls: int) -> dict[str, float]:
    return {name: value / calls * 1e9 for name, value in seconds.items()}


def sequential_variant(adapter: Adapter, keys: Sequence[Hashable]) -> Variant:
    """``adapter``'s sequential calls of ``noop`` on ``keys``, reset before each timed run."""
    return Variant(adapter.name, lambda: adapter.sequential(keys, noop), adapter.reset)


async def uncontended(
    adapters: Sequence[Adapter], calls: int, repeats: int, one_key: bool = True
) -> list[Table]:
    """Sequential calls on distinct keys, and (``one_key``) the same on a single key."""
    tables: list[Table] = []
    shapes = [("distinct keys", list(range(calls)))]
    if one_key:
        shapes.append(("one key", [0] * calls))
    for label, keys in shapes:
        variants = [sequential_variant(a, keys) for a in adapters]
        seconds = await interleave(variants, repeats)
        tables.append(
            Table(
                f"uncontended-{label.replace(' ', '-')}",
                f"Uncontended: {calls:,} sequential calls, {label}",
                "ns/call",
                _ns_per_call(seconds, calls),
            )
        )
    leaked: dict[str, int] = {}
    for adapter in adapters:
        adapter.reset()
        await adapter.sequential(list(range(calls)), noop)
        leaked[adapter.name] = adapter.entries()
    tables[0].notes.append(
        "entries kept after the run: "
        + ", ".join(f"{name} {count:,}" for name, count in leaked.items())
    )
    return tables


async def decorated(calls: int, repeats: int) -> Table:
    queue = KeyedSerialQueue()

    @serialized(key="key", queue=queue)
    async def handler(key: int) -> None:
        return None

    class Service:
        @serialized(key="key", queue=queue)
        async def handle(self, key: int) -> None:
            return None

    async def plain(key: int) -> None:
        return None

    def passthrough(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        return wrapped(*args, **kwargs)

    wrapt_only = wrapt.FunctionWrapper(plain, passthrough)
    service = Service()
    keys = range(calls)

    async def run_queue() -> None:
        for key in keys:
            await queue.run(key, plain, key)

    async def run_function() -> None:
        for key in keys:
            await handler(key)

    async def run_method() -> None:
        for key in keys:
            await service.handle(key)

    async def run_wrapt() -> None:
        for key in keys:
            await wrapt_only(key)

    async def run_bare() -> None:
        for key in keys:
            await plain(key)

    variants = [
        Variant("queue.run(key, fn, key)", run_queue),
        Variant("@serialized function", run_function),
        Variant("@serialized method", run_method),
        Variant("wrapt.FunctionWrapper pass-through, no queue", run_wrapt),
        Variant("bare await fn(key)", run_bare),
    ]
    seconds = await interleave(variants, repeats)
    table = Table(
        "decorated",
        f"Decorated: {calls:,} sequential calls on distinct keys, key by parameter name",
        "ns/call",
        _ns_per_call(seconds, calls),
        reference="@serialized function",
    )
    table.notes.append("ratio column: @serialized function / each row")
    return table


async def contended(
    adapters: Sequence[Adapter],
    calls: int,
    repeats: int,
    key_counts: Sequence[int] = (1, 100, 10_000),
) -> list[Table]:
    """Gather many calls over few or many keys; the fn either yields once or returns at once.

    When fn returns at once, every call finishes within its task's first step, so no
    call ever waits: this prices the bookkeeping. When fn yields once, calls of a key
    really wait for each other: a waiting call needs one more wake-up by the loop.
    """
    tables: list[Table] = []
    for fn, fn_label, fn_id in (
        (yield_once, "each yields once", ""),
        (noop, "each returns at once", "-noop"),
    ):
        for key_count in key_counts:
            keys = [i % key_count for i in range(calls)]
            variants = [gathered_variant(a, keys, fn) for a in adapters]
            if fn is yield_once:
                variants.append(floor_variant(keys, fn))
            seconds = await interleave(variants, repeats)
            tables.append(
                Table(
                    f"contended-{key_count}{fn_id}",
                    f"Contended: {calls:,} calls gathered over {key_count:,} keys, {fn_label}",
                    "ns/call",
                    _ns_per_call(seconds, calls),
                )
            )
    return tables


#: The contended floor: a bare gather whose calls are each woken once more, as a call that
#: waits for its turn must be.
FLOOR = "bare await + one extra wake-up (floor)"


def gathered_variant(adapter: Adapter, keys: Sequence[Hashable], fn: Fn) -> Variant:
    """One call of ``fn`` per key in ``keys`` through ``adapter``, all gathered at once."""

    async def run() -> None:
        await asyncio.gather(*(adapter.call(key, fn) for key in keys))

    return Variant(adapter.name, run, adapter.reset)


def floor_variant(keys: Sequence[Hashable], fn: Fn) -> Variant:
    """The contended floor: ``fn`` once per key, each call woken once more, all gathered."""

    async def woken_twice() -> None:
        await asyncio.sleep(0)  # the hand-off's wake-up, and nothing else
        await fn()

    async def run() -> None:
        await asyncio.gather(*(woken_twice() for _ in keys))

    return Variant(FLOOR, run)


async def loop_served(calls: int, repeats: int) -> Table:
    """A bare gather on a loop that keyserial has served against the same on a fresh loop.

    The loops run in a thread of their own: this one's loop is running already.
    """
    seconds = await asyncio.to_thread(loop_after_use.seconds_per_bare_gather, calls, repeats)
    table = Table(
        "loop-after-use",
        f"Bare gather of {calls:,} calls that yield once, on a loop keyserial has served "
        "and on a fresh one",
        "ns/call",
        _ns_per_call(seconds, calls),
        reference=loop_after_use.SERVED,
    )
    table.notes.append(f"ratio column: {loop_after_use.SERVED} / each row")
    return table


async def deadlock_chain(waiters: int, lengths: Sequence[int], repeats: int) -> Table:
    """What registering behind a chain of blocked holders costs, by the chain's length.

    Holder 1 holds key 1 and waits for key 2, held by holder 2, and so on; the last one
    waits on an event. ``waiters`` calls then queue for key 1, each checked for a cycle.
    The timed part is their registration (one step of each new task); building and
    releasing the chain is not timed.
    """
    import statistics
    import time

    samples: dict[int, list[float]] = {length: [] for length in lengths}
    for repeat in range(repeats + 1):  # the first round warms up
        order = lengths if repeat % 2 == 0 else list(reversed(lengths))
        for length in order:
            queue = KeyedSerialQueue()
            release = asyncio.Event()
            holders: list[asyncio.Future[Any]] = []
            holders.append(asyncio.ensure_future(queue.run(length, release.wait)))
            await asyncio.sleep(0)
            for key in range(length - 1, 0, -1):

                async def wait_for_next(key: int, queue: KeyedSerialQueue = queue) -> None:
                    await queue.run(key + 1, noop)

                holders.append(asyncio.ensure_future(queue.run(key, wait_for_next, key)))
                await asyncio.sleep(0)
            gc.collect()
            gc.disable()
            try:
                start = time.perf_counter()
                tasks = [asyncio.ensure_future(queue.run(1, noop)) for _ in range(waiters)]
                await asyncio.sleep(0)  # every task registers in its first step
                took = time.perf_counter() - start
            finally:
                gc.enable()
            assert queue.pending(1) == waiters + 1
            release.set()
            await asyncio.gather(*holders, *tasks)
            if repeat:
                samples[length].append(took)
    values = {
        f"chain of {length:,}": statistics.median(samples[length]) / waiters * 1e9
        for length in lengths
    }
    table = Table(
        "deadlock-chain",
        f"Deadlock check: {waiters:,} calls queued behind a chain of blocked holders",
        "ns/registration",
        values,
        reference=f"chain of {lengths[0]:,}",
    )
    table.notes.append("each registration includes creating and first stepping its task")
    return table


async def multi_key(calls: int, repeats: int) -> list[Table]:
    """Two-key calls against two nested single-key turns; the deadlock check's cost."""
    queue = KeyedSerialQueue()
    pairs = [(f"a{i}", f"b{i}") for i in range(calls)]

    async def run_all_pairs() -> None:
        for pair in pairs:
            await queue.run_all(pair, noop)

    async def nested_pairs() -> None:
        for first, second in pairs:
            await queue.run(first, queue.run, second, noop)

    async def single_keys() -> None:
        for first, _ in pairs:
            await queue.run(first, noop)

    seconds = await interleave(
        [
            Variant("run_all([a, b], fn)", run_all_pairs),
            Variant("run(a, run, b, fn): nested turns", nested_pairs),
            Variant("run(a, fn): one key", single_keys),
        ],
        repeats,
    )
    two_keys = Table(
        "multi-key",
        f"Several keys: {calls:,} sequential uncontended calls on distinct key pairs",
        "ns/call",
        _ns_per_call(seconds, calls),
        reference="run_all([a, b], fn)",
    )

    keys = [i % 100 for i in range(calls)]
    checked, unchecked = KeyedSerialQueue(), KeyedSerialQueue(detect_deadlocks=False)

    def gathered(queue: KeyedSerialQueue) -> Callable[[], Coroutine[Any, Any, None]]:
        async def run() -> None:
            await asyncio.gather(*(queue.run(key, yield_once) for key in keys))

        return run

    seconds = await interleave(
        [
            Variant("deadlock detection on (default)", gathered(checked)),
            Variant("detect_deadlocks=False", gathered(unchecked)),
        ],
        repeats,
    )
    check = Table(
        "deadlock-check",
        f"Deadlock check: {calls:,} calls gathered over 100 keys, each yields once",
        "ns/call",
        _ns_per_call(seconds, calls),
        reference="deadlock detection on (default)",
    )
    return [two_keys, check]


async def observability(calls: int, repeats: int) -> Table:
    """What stats() counting, an observer and a slow-turn threshold cost an uncontended call."""
    from keyserial import QueueObserver

    from .reference import UncountedQueue

    queues = {
        "queue.run, no observer": KeyedSerialQueue(),
        "run before stats() (reference)": UncountedQueue(),
        "queue.run, count_calls=True": KeyedSerialQueue(count_calls=True),
        "queue.run, no-op observer": KeyedSerialQueue(observer=QueueObserver()),
        "queue.run, slow_turn=60": KeyedSerialQueue(slow_turn=60.0),
    }
    keys = range(calls)

    def sequential(queue: KeyedSerialQueue) -> Callable[[], Coroutine[Any, Any, None]]:
        async def run() -> None:
            for key in keys:
                await queue.run(key, noop)

        return run

    seconds = await interleave([Variant(n, sequential(q)) for n, q in queues.items()], repeats)
    return Table(
        "observability",
        f"Observability: {calls:,} sequential uncontended calls on distinct keys",
        "ns/call",
        _ns_per_call(seconds, calls),
        reference="queue.run, no observer",
    )


async def coalescing(burst: int, repeats: int) -> Table:
    """A burst of calls for one slow key, with and without latest-wins coalescing."""
    peaks: dict[str, tuple[int, int]] = {}

    def burst_variant(name: str, group: str | None) -> Variant:
        async def run() -> None:
            queue = KeyedSerialQueue()
            gate = asyncio.Event()
            ran = 0

            async def hold() -> None:
                await gate.wait()

            async def save(i: int) -> None:
                nonlocal ran
                ran += 1

            holder = asyncio.ensure_future(queue.run("seg", hold))
            await asyncio.sleep(0)
            tasks = [
                asyncio.ensure_future(queue.with_options(group=group).run("seg", save, i))
                for i in range(burst)
            ]
            await asyncio.sleep(0)
            await asyncio.sleep(0)  # superseded calls resume and leave
            pending = queue.pending("seg")
            gate.set()
            await asyncio.gather(holder, *tasks, return_exceptions=True)
            peaks[name] = (pending, ran)

        return Variant(name, run)

    variants = [
        burst_variant("coalesce (group=...)", "partials"),
        burst_variant("no coalescing", None),
    ]
    seconds = await interleave(variants, repeats)
    table = Table(
        "coalescing",
        f"Coalescing: a burst of {burst:,} calls for one key behind a slow call",
        "ns/call",
        _ns_per_call(seconds, burst),
        reference="coalesce (group=...)",
    )
    table.notes.append(
        "pending calls on the key after the burst, and calls that ran: "
        + ", ".join(f"{name}: {p:,} pending, {r:,} ran" for name, (p, r) in peaks.items())
    )
    return table


async def hand_off(adapters: Sequence[Adapter], rounds: int, repeats: int) -> Table:
    def ping_pong(adapter: Adapter) -> Variant:
        async def player() -> None:
            for _ in range(rounds):
                await adapter.call("ball", yield_once)

        async def run() -> None:
            await asyncio.gather(player(), player())

        return Variant(adapter.name, run, adapter.reset)

    seconds = await interleave([ping_pong(a) for a in adapters], repeats)
    return Table(
        "hand-off",
        f"Hand-off: two tasks ping-ponging one key, {rounds:,} turns each",
        "ns/turn",
        _ns_per_call(seconds, 2 * rounds),
    )


async def _many_waiters_once(adapter: Adapter, waiters: int, cancel_half: bool) -> None:
    gate = asyncio.Event()

    async def hold() -> None:
        await gate.wait()

    holder = asyncio.ensure_future(adapter.call("k", hold))
    await asyncio.sleep(0)
    tasks = [asyncio.ensure_future(adapter.call("k", noop)) for _ in range(waiters)]
    await asyncio.sleep(0)  # every waiter registers
    if cancel_half:
        for task in tasks[::2]:
            task.cancel()
        await asyncio.sleep(0)
    gate.set()
    await asyncio.gather(holder, *tasks, return_exceptions=True)


async def many_waiters(
    adapters: Sequence[Adapter], sizes: Sequence[int], repeats: int
) -> tuple[list[Table], dict[str, dict[int, float]]]:
    """Per-call cost of queuing ``n`` waiters on one key, for each n; the curve must be flat."""
    tables: list[Table] = []
    curves: dict[str, dict[int, float]] = {}
    for cancel_half in (False, True):
        label = "half cancelled before their turn" if cancel_half else "none cancelled"
        per_size: dict[int, dict[str, float]] = {}
        for size in sizes:

            def waiting(adapter: Adapter, size: int = size, cancel: bool = cancel_half) -> Variant:
                return Variant(
                    adapter.name,
                    lambda: _many_waiters_once(adapter, size, cancel),
                    adapter.reset,
                )

            seconds = await interleave([waiting(a) for a in adapters], repeats)
            per_size[size] = _ns_per_call(seconds, size)
            for name, value in per_size[size].items():
                curves.setdefault(f"{name} ({label})", {})[size] = value
        largest, middle = sizes[-1], sizes[-2]
        table = Table(
            "waiters-cancel-half" if cancel_half else "waiters",
            f"Many waiters on one key, {largest:,} waiters, {label}",
            "ns/waiter",
            per_size[largest],
        )
        table.growth = {
            name: (per_size[largest][name] * largest) / (per_size[middle][name] * middle)
            for name in per_size[largest]
        }
        table.notes.append(
            f"total time {largest:,} / {middle:,} waiters (linear = {largest / middle:.1f}): "
            + ", ".join(f"{name} {ratio:.2f}" for name, ratio in table.growth.items())
        )
        tables.append(table)
    return tables, curves


async def _measure_allocated(
    action: Callable[[], Coroutine[Any, Any, object]],
) -> tuple[int, object]:
    """Bytes still allocated after ``action``, with what it returned (kept alive meanwhile)."""
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    kept = await action()
    gc.collect()
    return tracemalloc.get_traced_memory()[0] - before, kept


async def memory(adapters: Sequence[Adapter], idle_keys: int, waiters: int) -> list[Table]:
    tracemalloc.start()
    try:
        idle: dict[str, float] = {}
        small = idle_keys // 10
        for adapter in adapters:
            retained = {}
            for count in (small, idle_keys):
                adapter.reset()
                await adapter.sequential(["warm-up"], noop)  # what a first use allocates once
                keys = list(range(count))

                async def use_once(adapter: Adapter = adapter, keys: list[int] = keys) -> None:
                    await adapter.sequential(keys, noop)

                retained[count], _ = await _measure_allocated(use_once)
            # The slope between two sizes: a fixed allocation made once is not per key.
            idle[adapter.name] = (retained[idle_keys] - retained[small]) / (idle_keys - small)

        per_waiter = await _bytes_per_waiting_call(waiters)
    finally:
        tracemalloc.stop()
    idle_table = Table(
        "memory-idle",
        f"Memory retained per idle key (slope from {idle_keys // 10:,} to {idle_keys:,} "
        "distinct keys used once)",
        "bytes/key",
        idle,
    )
    idle_table.ratios = False
    waiter_table = Table(
        "memory-waiting",
        f"Memory per waiting call, {waiters:,} calls waiting on one key",
        "bytes/call",
        per_waiter,
        reference="keyserial queue.run",
    )
    return [idle_table, waiter_table]


async def _bytes_per_waiting_call(waiters: int) -> dict[str, float]:
    event = asyncio.Event()

    async def waiting_on_event() -> object:
        tasks = [asyncio.ensure_future(event.wait()) for _ in range(waiters)]
        await asyncio.sleep(0)
        return tasks

    adapter = Keyserial()
    adapter.reset()
    gate = asyncio.Event()

    async def hold() -> None:
        await gate.wait()

    async def waiting_on_queue() -> object:
        tasks = [asyncio.ensure_future(adapter.queue.run("k", noop)) for _ in range(waiters)]
        await asyncio.sleep(0)
        return tasks

    # The holder registers first, so that the measured calls all wait.
    holder = asyncio.ensure_future(adapter.queue.run("k", hold))
    await asyncio.sleep(0)
    event_bytes, event_tasks = await _measure_allocated(waiting_on_event)
    queue_bytes, queue_tasks = await _measure_allocated(waiting_on_queue)
    event.set()
    gate.set()
    await asyncio.gather(holder, *event_tasks, *queue_tasks)  # type: ignore[misc]
    return {
        "keyserial queue.run": queue_bytes / waiters,
        "task waiting on asyncio.Event": event_bytes / waiters,
        "difference": (queue_bytes - event_bytes) / waiters,
    }
