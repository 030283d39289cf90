"""The Redis backend against redis-py's Lock and python-redis-lock, on one private server.

    python -m benchmarks.redis_backend            # full sizes
    python -m benchmarks.redis_backend --quick    # tiny sizes, for CI smoke runs

Measures, in one run: uncontended latency (sequential calls on distinct keys),
Redis commands per uncontended call, and same-key hand-off throughput with four
processes taking turns on one key. redis-py's Lock polls for a held lock (here
every 1 ms); python-redis-lock blocks on a list; neither orders waiters or gives
fencing tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import multiprocessing
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as redis_asyncio
import redis_lock  # type: ignore[import-untyped]

from keyserial.redis import RedisKeyedQueue

from .report import environment

LIBRARIES = (
    "keyserial RedisKeyedQueue",
    "keyserial, fair=True",
    "redis-py Lock (sleep=1 ms)",
    "python-redis-lock",
)
KEYSERIAL = LIBRARIES[:2]
OTHERS = LIBRARIES[2:]
#: Calls each process keeps queued at once in the queued hand-off runs: a short queue and a
#: long one.
QUEUED = (2, 8)


def start_server() -> tuple[subprocess.Popen[bytes], int, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    directory = tempfile.mkdtemp(prefix="keyserial-bench-")
    server = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", directory],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    client: Any = redis.Redis(port=port)  # redis-py's sync types are partly unknown
    for _ in range(500):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.01)
    return server, port, directory


class RoundTrips:
    """Counts the commands clients send to the server (MONITOR), not those scripts run."""

    def __init__(self, port: int) -> None:
        self.count = 0
        self._monitor: Any = redis.Redis(port=port).monitor()  # type: ignore[no-untyped-call]
        self._connection: Any = self._monitor.__enter__()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        try:
            for command in self._connection.listen():
                if command.get("client_type") != "lua":
                    self.count += 1
        except (redis.RedisError, ValueError, OSError):
            return  # closed (a read cut short by the close times out, or fails)

    def close(self) -> None:
        time.sleep(0.2)  # let the last commands arrive
        with contextlib.suppress(Exception):
            self._monitor.__exit__(None, None, None)


async def _uncontended(library: str, port: int, calls: int) -> float:
    """Seconds for ``calls`` sequential uncontended turns on distinct keys."""
    async_client = redis_asyncio.Redis(port=port)
    sync_client = redis.Redis(port=port)
    queue = RedisKeyedQueue(
        async_client, namespace="bench", lease=10.0, fair=library == LIBRARIES[1]
    )

    async def nothing() -> None:
        return None

    async def one(i: int) -> None:
        if library in KEYSERIAL:
            await queue.run(f"u{i}", nothing)
        elif library == LIBRARIES[2]:
            lock: Any = async_client.lock(f"u{i}", timeout=10, sleep=0.001)
            await lock.acquire()
            await lock.release()
        else:
            lock = redis_lock.Lock(sync_client, f"u{i}", expire=10)
            lock.acquire()
            lock.release()

    await one(-1)  # scripts loaded, subscription made
    start = time.perf_counter()
    for i in range(calls):
        await one(i)
    elapsed = time.perf_counter() - start
    await queue.aclose()
    await async_client.aclose()
    return elapsed


def _hand_off_worker(
    library: str,
    port: int,
    turns: int,
    barrier: object,
    times: object,
    index: int,
    queued: int = 1,
) -> None:
    """Take ``turns`` turns on one key, ``queued`` calls at a time; write their start times
    and the end of the last.

    ``times`` is shared: worker i's turn starts go to ``[i * turns, (i + 1) * turns)``,
    and the workers' ends to the last slots.
    """

    async def main() -> None:
        async_client = redis_asyncio.Redis(port=port)
        sync_client = redis.Redis(port=port)
        queue = RedisKeyedQueue(
            async_client, namespace="bench", lease=10.0, fair=library == LIBRARIES[1]
        )
        slot = index * turns

        async def turn() -> None:
            nonlocal slot
            times[slot] = time.monotonic()  # type: ignore[index]
            slot += 1
            await asyncio.sleep(0)

        async def warm_up() -> None:
            await asyncio.sleep(0)

        await queue.run("warm-up", warm_up)
        barrier.wait()  # type: ignore[attr-defined]
        for done in range(0, turns, queued):
            if library in KEYSERIAL:
                batch = min(queued, turns - done)
                await asyncio.gather(*(queue.run("ball", turn) for _ in range(batch)))
            elif library == LIBRARIES[2]:
                lock: Any = async_client.lock("ball-lock", timeout=10, sleep=0.001)
                await lock.acquire()
                await turn()
                await lock.release()
            else:
                lock = redis_lock.Lock(sync_client, "ball-rl", expire=10)
                lock.acquire()
                await turn()
                lock.release()
        times[len(times) - 1 - index] = time.monotonic()  # type: ignore[arg-type, index]
        await queue.aclose()
        await async_client.aclose()

    asyncio.run(main())


def _hand_off(
    library: str, port: int, processes: int, turns: int, queued: int = 1
) -> tuple[float, float]:
    """Seconds from the first turn's start to the last turn's end, and the share of turns
    that went to another process than the turn before.

    The monotonic clock is system-wide, so the workers' readings compare; timing the turns
    themselves keeps process start-up and shut-down out of the measurement.
    """
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(processes)
    shared = context.Array("d", processes * turns + processes, lock=False)
    workers = [
        context.Process(
            target=_hand_off_worker,
            args=(library, port, turns, barrier, shared, index, queued),
        )
        for index in range(processes)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=600)
    if any(worker.exitcode != 0 for worker in workers):
        raise RuntimeError(f"a {library} hand-off worker failed")
    times: list[float] = list(shared)
    starts = sorted((times[i], i // turns) for i in range(processes * turns))
    switches = sum(1 for (_, a), (_, b) in itertools.pairwise(starts) if a != b)
    elapsed = max(times[processes * turns :]) - starts[0][0]
    return elapsed, switches / (len(starts) - 1)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.redis_backend")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for CI smoke runs")
    parser.add_argument("--markdown", type=Path, help="also write the report to this file")
    options = parser.parse_args()
    calls, turns, repeats = (50, 20, 1) if options.quick else (3000, 500, 5)
    processes = 4
    server, port, directory = start_server()
    try:
        latency: dict[str, float] = {}
        commands: dict[str, float] = {}
        for library in LIBRARIES:
            counter = RoundTrips(port)
            asyncio.run(_uncontended(library, port, calls))
            counter.close()
            # Round trips per call; the client's start-up (HELLO...) is spread over the calls.
            commands[library] = counter.count / (calls + 1)
        samples: dict[str, list[float]] = {library: [] for library in LIBRARIES}
        for _ in range(repeats):
            for library in LIBRARIES:
                samples[library].append(asyncio.run(_uncontended(library, port, calls)) / calls)
        latency = {library: statistics.median(values) for library, values in samples.items()}
        hand_off_commands: dict[str, float] = {}
        for library in LIBRARIES:  # counted, not timed: MONITOR slows the server down
            monitor = RoundTrips(port)
            _hand_off(library, port, processes, turns)
            monitor.close()
            hand_off_commands[library] = monitor.count / (processes * turns)
        rates: dict[str, list[float]] = {library: [] for library in LIBRARIES}
        switched: dict[str, list[float]] = {library: [] for library in LIBRARIES}
        for _ in range(repeats):
            for library in LIBRARIES:
                elapsed, share = _hand_off(library, port, processes, turns)
                rates[library].append(processes * turns / elapsed)
                switched[library].append(share)
        throughput = {library: statistics.median(values) for library, values in rates.items()}
        moved = {library: statistics.median(values) for library, values in switched.items()}
        # The same, with every process keeping QUEUED calls waiting: in the default mode one
        # of them waits in Redis per process, in fair mode every one holds a ticket there.
        queued_rates: dict[tuple[int, str], list[float]] = {
            (depth, library): [] for depth in QUEUED for library in KEYSERIAL
        }
        for _ in range(repeats):
            for depth in QUEUED:
                for library in KEYSERIAL:
                    elapsed, _ = _hand_off(library, port, processes, turns, depth)
                    queued_rates[depth, library].append(processes * turns / elapsed)
        queued_throughput = {place: statistics.median(v) for place, v in queued_rates.items()}
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=10)
        shutil.rmtree(directory, ignore_errors=True)

    best_other = max(throughput[name] for name in OTHERS)
    lines = [
        f"Environment: {environment()}, redis-server on loopback",
        "",  # separate paragraphs in Markdown
        f"Command: `python -m benchmarks.redis_backend{' --quick' if options.quick else ''}`",
        "",
        f"### Redis backend: {calls:,} uncontended calls; {processes} processes x {turns:,} "
        "turns on one key",
        "",
        "| | " + " | ".join(LIBRARIES) + " |",
        "|---|" + "---:|" * len(LIBRARIES),
    ]
    # One row per measure, one column per library: the table fits a page.
    rows = {
        "uncontended µs/call": {n: f"{latency[n] * 1e6:,.0f}" for n in LIBRARIES},
        "round trips/call": {n: f"{commands[n]:.1f}" for n in LIBRARIES},
        "hand-off turns/s": {n: f"{throughput[n]:,.0f}" for n in LIBRARIES},
        "turns to another process": {n: f"{moved[n]:.0%}" for n in LIBRARIES},
        "commands/hand-off": {n: f"{hand_off_commands[n]:.1f}" for n in LIBRARIES},
        **{
            f"hand-off turns/s, {depth} calls queued per process": {
                n: f"{queued_throughput[depth, n]:,.0f}" if n in KEYSERIAL else ""
                for n in LIBRARIES
            }
            for depth in QUEUED
        },
        "order across processes": {
            LIBRARIES[0]: "each process's next call",
            LIBRARIES[1]: "call order",
            LIBRARIES[2]: "none",
            LIBRARIES[3]: "none",
        },
        "fencing tokens": {n: "yes" if n in KEYSERIAL else "no" for n in LIBRARIES},
    }
    for measure, values in rows.items():
        lines.append(f"| {measure} | " + " | ".join(values[n] for n in LIBRARIES) + " |")
    ratio = throughput[LIBRARIES[0]] / best_other
    lines.append("")
    lines.append(
        "Round trips per uncontended call are counted with MONITOR (commands run by scripts "
        "excluded), including each client's connection set-up spread over the calls; commands per "
        "hand-off count every command the four processes sent during an extra, untimed hand-off "
        "run made while MONITOR runs, polling included."
    )
    fair_cost = throughput[LIBRARIES[1]] / throughput[LIBRARIES[0]]
    fair_queued = " and ".join(
        f"{queued_throughput[depth, LIBRARIES[1]] / queued_throughput[depth, LIBRARIES[0]]:.2f}"
        f" with {depth}"
        for depth in QUEUED
    )
    lines.append(
        f"Fair mode ÷ default, hand-off turns/s: {fair_cost:.2f} with one call per process at "
        f"a time, {fair_queued} queued per process (every one of them holds a ticket in "
        "Redis, and keeps it alive while it waits)."
    )
    lines.append(
        f"Hand-off throughput of keyserial ÷ the best other: {ratio:.2f} "
        f"(target ≥ 1: {'met' if ratio >= 1 else '**missed**'}); hand-off throughput is the "
        f"median of {repeats} interleaved runs, each timed from the first turn's start to the "
        "last turn's end. Turns to another process: the share of turns (in start order) taken "
        "by another process than the turn before, a hand-off; the rest were taken again by the "
        "process that had just released the key."
    )
    text = "\n".join(lines) + "\n"
    print(text)
    if options.markdown:
        options.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
