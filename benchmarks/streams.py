"""Keyed stream consumers on one private redis-server: a 2 ms handler, 400 keys.

    python -m benchmarks.streams            # full sizes
    python -m benchmarks.streams --quick    # tiny sizes, for CI smoke runs

Side by side in one run, each consuming the same kind of backlog through a Redis consumer
group and acknowledging every message (all keep per-key order):

* a sequential consumer: one message at a time;
* hash partitions, each consumed sequentially: 16 streams by key hash, one task per stream;
* keyserial's ``KeyedStream`` (16 partitions), in one process and in four.

Throughput is messages per second from the first publish of a backlog until every message
is acknowledged. Latency is end to end (publish to handler end) at a steady offered load
below the sequential consumer's capacity.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
from typing import Any

import redis.asyncio as redis_asyncio

from keyserial._keycodec import serialize_key
from keyserial.streams import KeyedStream, RedisStreamSource, StreamMessage
from keyserial.streams._redis_source import key_field_of

from .redis_backend import start_server
from .report import environment

KEYS = 400
HANDLER_SECONDS = 0.002
PARTITIONS = 16
LEASE = 2.0
GROUP = "bench"
#: Handlers each consumer runs at once in the scaling measurement that CPUs do not limit.
BOUNDED_IN_FLIGHT = 4
ROOT = Path(__file__).resolve().parent.parent

#: Handles one message (its key and fields); records its end-to-end latency.
Handle = Callable[[str, dict[str, str]], Awaitable[None]]


async def handler_work() -> None:
    await asyncio.sleep(HANDLER_SECONDS)


def partition_of(key: str, partitions: int) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") % partitions


# -- the hand-written consumers ---------------------------------------------------------------


async def sequential_consumer(
    client: Any, stream: str, done: Callable[[dict[str, str]], None]
) -> None:
    """One message at a time: read, handle, XACK."""
    await _ensure_group(client, stream)
    while True:
        reply = await client.xreadgroup(GROUP, "one", {stream: ">"}, count=100, block=100)
        for _, entries in reply if reply else ():
            for message_id, raw in entries:
                fields = {k.decode(): v.decode() for k, v in raw.items()}
                await handler_work()
                await client.xack(stream, GROUP, message_id)
                done(fields)


async def _ensure_group(client: Any, stream: str) -> None:
    with contextlib.suppress(redis_asyncio.ResponseError):  # it exists
        await client.xgroup_create(stream, GROUP, id="0", mkstream=True)


async def partitioned_consumer(
    client: Any, streams: list[str], done: Callable[[dict[str, str]], None]
) -> None:
    """One sequential consumer per hash partition, all in this process."""
    await asyncio.gather(*(sequential_consumer(client, stream, done) for stream in streams))


# -- one run ----------------------------------------------------------------------------------


class Tally:
    """Handled messages and their end-to-end latencies."""

    def __init__(self) -> None:
        self.count = 0
        self.latencies: list[float] = []

    def done(self, fields: dict[str, str]) -> None:
        self.count += 1
        self.latencies.append(time.time() - float(fields["t"]))


async def publish(
    client: Any, target: Callable[[str], str], messages: int, rate: float | None
) -> None:
    """Publish ``messages`` over ``KEYS`` keys: pipelined, or ``rate`` per second."""
    start = time.monotonic()
    batch = 200 if rate is None else 1
    for first in range(0, messages, batch):
        pipe = client.pipeline(transaction=False)
        for n in range(first, min(first + batch, messages)):
            key = f"key-{n % KEYS}"
            pipe.xadd(target(key), {"keyserial.key": _key_field(key), "t": repr(time.time())})
        await pipe.execute()
        if rate is not None:
            await asyncio.sleep(max(0.0, start + (first + 1) / rate - time.monotonic()))


def _key_field(key: str) -> str:
    return key_field_of(serialize_key(key, "KeyedStream"))


async def until_count(tally: Tally, messages: int, limit: float) -> None:
    deadline = time.monotonic() + limit
    while tally.count < messages and time.monotonic() < deadline:  # noqa: ASYNC110  # polled
        await asyncio.sleep(0.002)
    if tally.count < messages:
        raise SystemExit(f"only {tally.count} of {messages} messages handled in {limit} s")


async def run_hand_written(
    port: int, variant: str, messages: int, rate: float | None
) -> tuple[float, list[float]]:
    client: Any = redis_asyncio.Redis(port=port)
    await client.flushall()
    tally = Tally()
    if variant == "sequential":
        streams = ["seq"]
        consumer = sequential_consumer(client, "seq", tally.done)
    else:
        streams = [f"part:{p}" for p in range(PARTITIONS)]
        consumer = partitioned_consumer(client, streams, tally.done)
    for stream in streams:
        await _ensure_group(client, stream)
    task = asyncio.create_task(consumer)

    def target(key: str) -> str:
        return streams[partition_of(key, len(streams))]

    start = time.monotonic()
    await publish(client, target, messages, rate)
    await until_count(tally, messages, 600)
    elapsed = time.monotonic() - start
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await client.aclose()
    return elapsed, tally.latencies


# -- keyserial, in this process or in several -------------------------------------------------


def keyed_stream(client: Any) -> KeyedStream:
    return KeyedStream(client, "bench", PARTITIONS, lease=LEASE)


async def consume_in_child(port: int, max_in_flight: int) -> None:
    """A consumer process: run until SIGTERM, then print how many it handled and latencies."""
    client: Any = redis_asyncio.Redis(port=port)
    stream = keyed_stream(client)
    tally = Tally()

    @stream.consumer(max_in_flight=max_in_flight)
    async def handle(message: StreamMessage) -> None:
        await handler_work()
        tally.done(dict(message.fields))

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stream.stop)
    print("ready", flush=True)
    await stream.run()
    print(" ".join(f"{latency:.6f}" for latency in tally.latencies), flush=True)
    await stream.aclose()
    await client.aclose()


@contextlib.asynccontextmanager
async def consumers(
    port: int, count: int, max_in_flight: int
) -> AsyncGenerator[tuple[Any, RedisStreamSource, list[subprocess.Popen[str]]]]:
    """An emptied server, ``count`` consumer processes holding its partitions evenly, and
    a client and the stream's source to watch them; the processes are killed at the end."""
    client: Any = redis_asyncio.Redis(port=port)
    await client.flushall()
    source = keyed_stream(client).source
    assert isinstance(source, RedisStreamSource)
    consume = ["--consume", str(port), "--max-in-flight", str(max_in_flight)]
    children = [
        subprocess.Popen(  # noqa: ASYNC220  # started before the timed part
            [sys.executable, "-m", "benchmarks.streams", *consume],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(count)
    ]
    try:
        for child in children:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        await until_spread(client, source, count)
        yield client, source, children
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
            child.wait()  # killed: returns at once
            if child.stdout is not None:
                child.stdout.close()
        await client.aclose()


async def all_acknowledged(client: Any, source: RedisStreamSource, messages: int) -> bool:
    total = 0
    for partition in range(PARTITIONS):
        name = source.stream_name(partition)
        try:
            groups = await client.xinfo_groups(name)
        except redis_asyncio.ResponseError:
            return False
        for group in groups:
            if group["pending"] or group.get("lag"):
                return False
            total += group.get("entries-read") or 0
    return total >= messages


async def run_keyserial(
    port: int, processes: int, messages: int, rate: float | None, max_in_flight: int = 1000
) -> tuple[float, list[float]]:
    async with consumers(port, processes, max_in_flight) as (client, source, children):

        def target(key: str) -> str:
            return source.stream_name(source.partition_of(key))

        start = time.monotonic()
        await publish(client, target, messages, rate)
        deadline = start + 600
        while not await all_acknowledged(client, source, messages):
            if time.monotonic() > deadline:
                raise SystemExit("keyserial consumers did not finish in 600 s")
            await asyncio.sleep(0.002)
        elapsed = time.monotonic() - start
        latencies: list[float] = []
        for child in children:
            child.send_signal(signal.SIGTERM)
        for child in children:
            out, _ = child.communicate(timeout=60)
            latencies += [float(value) for value in out.split()]
    return elapsed, latencies


async def holders(client: Any, source: RedisStreamSource) -> dict[str, int]:
    """How many partitions each owner (named by its grant listener) holds now."""
    found: dict[str, int] = {}
    for partition in range(PARTITIONS):
        base = source.stream_name(partition).removesuffix(":stream")
        holder = await client.get(base + ":holder")
        if holder is not None:
            ticket = holder.decode().rsplit(":", 1)[0]
            owner = ticket.split("@", 1)[1]
            found[owner] = found.get(owner, 0) + 1
    return found


async def until_spread(client: Any, source: RedisStreamSource, processes: int) -> None:
    """Wait until the consumers hold every partition, spread evenly (no rebalance in the run)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        holders_now = await holders(client, source)
        counts = holders_now.values()
        spread = bool(holders_now) and max(counts) - min(counts) <= 1
        if sum(counts) == PARTITIONS and len(holders_now) == processes and spread:
            return
        await asyncio.sleep(0.05)
    raise SystemExit("the consumers did not spread over the partitions in 60 s")


async def takeover_seconds(port: int) -> float:
    """Two consumers share the partitions; one is killed: seconds until the other holds all."""
    async with consumers(port, 2, 1000) as (client, source, children):
        children[0].kill()
        killed = time.monotonic()
        while True:
            now = await holders(client, source)
            if len(now) == 1 and sum(now.values()) == PARTITIONS:
                return time.monotonic() - killed
            if time.monotonic() - killed > 10 * LEASE:
                raise SystemExit("the partitions of a killed consumer were not taken over")
            await asyncio.sleep(0.01)


# -- the report -------------------------------------------------------------------------------


VARIANTS = (
    "sequential consumer",
    f"{PARTITIONS} hash partitions, sequential each",
    "keyserial KeyedStream, 1 process",
    "keyserial KeyedStream, 2 processes",
    "keyserial KeyedStream, 4 processes",
)


def measure(
    port: int, variant: str, messages: int, rate: float | None
) -> tuple[float, list[float]]:
    if variant == VARIANTS[0]:
        return asyncio.run(run_hand_written(port, "sequential", messages, rate))
    if variant == VARIANTS[1]:
        return asyncio.run(run_hand_written(port, "partitioned", messages, rate))
    processes = int(variant.split(", ")[1].split()[0])
    return asyncio.run(run_keyserial(port, processes, messages, rate))


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.streams")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for CI smoke runs")
    parser.add_argument("--consume", type=int, help=argparse.SUPPRESS)  # a consumer process
    parser.add_argument("--max-in-flight", type=int, default=1000, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.consume:
        asyncio.run(consume_in_child(options.consume, options.max_in_flight))
        return 0
    # Backlogs sized so that each variant runs for a few seconds.
    backlog = {VARIANTS[0]: 2_000, VARIANTS[1]: 10_000}
    default_backlog, latency_messages, rate = 40_000, 1_000, 250.0
    if options.quick:
        backlog = {VARIANTS[0]: 100, VARIANTS[1]: 200}
        default_backlog, latency_messages = 400, 100
    server, port, directory = start_server()
    throughput: dict[str, float] = {}
    latency: dict[str, tuple[float, float]] = {}
    try:
        for variant in VARIANTS:
            messages = backlog.get(variant, default_backlog)
            elapsed, _ = measure(port, variant, messages, None)
            throughput[variant] = messages / elapsed
            _, latencies = measure(port, variant, latency_messages, rate)
            latency[variant] = (statistics.median(latencies), percentile(latencies, 0.99))
        # Scaling where the CPUs are not the limit: each consumer runs at most BOUNDED_IN_FLIGHT
        # handlers at once, so one process is bound by its handlers' time, not by computing.
        bounded_backlog = 200 if options.quick else 4_000
        bounded: dict[int, float] = {}
        for processes in (1, 2, 4):
            elapsed, _ = asyncio.run(
                run_keyserial(port, processes, bounded_backlog, None, BOUNDED_IN_FLIGHT)
            )
            bounded[processes] = bounded_backlog / elapsed
        takeovers = [asyncio.run(takeover_seconds(port)) for _ in range(1 if options.quick else 3)]
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=10)
        shutil.rmtree(directory, ignore_errors=True)

    sequential = throughput[VARIANTS[0]]
    lines = [
        f"Environment: {environment()}, redis-server on loopback",
        "",
        f"Command: `python -m benchmarks.streams{' --quick' if options.quick else ''}`",
        "",
        f"### Keyed stream consumers: {KEYS} keys, {HANDLER_SECONDS * 1000:.0f} ms handler, "
        f"latency at {rate:.0f} messages/s",
        "",
        "| consumer | messages/s | ÷ sequential | p50 latency ms | p99 latency ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for variant in VARIANTS:
        p50, p99 = latency[variant]
        lines.append(
            f"| {variant} | {throughput[variant]:,.0f} | {throughput[variant] / sequential:.1f} "
            f"| {p50 * 1000:.1f} | {p99 * 1000:.1f} |"
        )
    one, four = throughput[VARIANTS[2]], throughput[VARIANTS[4]]
    lines += [
        "",
        "### Targets",
        "",
        f"- keyserial, one process ÷ sequential consumer ≥ 10: {one / sequential:.1f} "
        f"({'met' if one / sequential >= 10 else 'missed'})",
        f"- keyserial, four processes ÷ one process: {four / one:.2f} on {os.cpu_count()} CPUs "
        "(linear would be 4; the processes share the CPUs with each other and Redis)",
        f"- keyserial with max_in_flight={BOUNDED_IN_FLIGHT} per process (bound by handler "
        f"time, not CPU): {bounded[1]:,.0f} / {bounded[2]:,.0f} / {bounded[4]:,.0f} messages/s "
        f"with 1 / 2 / 4 processes: {bounded[2] / bounded[1]:.2f} and "
        f"{bounded[4] / bounded[1]:.2f} times one process (linear: 2 and 4)",
        f"- a killed consumer's partitions taken over after {statistics.median(takeovers):.2f} s "
        f"(median of {len(takeovers)}; lease {LEASE:.0f} s): "
        f"{statistics.median(takeovers) / LEASE:.2f} leases",
    ]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
