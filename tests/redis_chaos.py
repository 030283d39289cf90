"""Chaos run of the Redis backend: worker processes, faults injected, every turn checked.

Worker processes make calls on a few keys through one ``RedisKeyedQueue``; in each turn they
write to a separate *store* (its own redis-server, never faulted) with the turn's fence, and
the store refuses a write whose fence is not above the highest it has seen. Meanwhile the
parent injects faults at random: SIGKILL of a worker (a new one takes its place), SIGSTOP of
a worker for up to twice the lease, restarts of the coordinating Redis with and without
persistence, and stalls of it (``DEBUG SLEEP``, ``CLIENT PAUSE``). Afterwards it checks:

* no two turns of a key overlapped, unless one of them ended in ``LeaseLost`` (its holder was
  paused or Redis forgot it: the lease, not the turn, ended);
* no fenced write was lost: every call that returned normally had its write accepted (a
  refused write would mean its fence was stale while it believed it held the turn);
* no call hung: each ended within its bound (timeout + lease + slack) once the time its
  process spent stopped is taken out, and every worker drained and exited when asked.

The test suite runs a small size (``test_redis_chaos.py``); a larger run::

    python -m tests.redis_chaos --workers 8 --seconds 300 --seed 1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from .chaos_stacks import answer_stack_requests, stacks_of

ROOT = Path(__file__).resolve().parent.parent

# Writes ARGV[2] to KEYS[1] only if fence ARGV[1] is above the highest fence seen so far.
FENCED_WRITE = """
local last = tonumber(redis.call('HGET', KEYS[1], 'fence') or '0')
if tonumber(ARGV[1]) > last then
  redis.call('HSET', KEYS[1], 'fence', ARGV[1], 'value', ARGV[2])
  return 1
end
return 0
"""

#: Seconds beyond a call's own bound before it counts as hung: generous, because a loaded
#: machine (CI runs tests in parallel) is slow, and what this catches is calls that never end.
SLACK = 5.0


# -- the worker -----------------------------------------------------------------------------


async def work(
    coordinator: str, store: str, log_path: str, seed: int, keys: int, lease: float
) -> None:
    import redis.asyncio as redis

    from keyserial import LeaseLost, current_fence
    from keyserial.redis import RedisKeyedQueue, RedisUnavailable

    rng = random.Random(seed)
    queue = RedisKeyedQueue(redis.Redis.from_url(coordinator), namespace="chaos", lease=lease)
    store_client = redis.Redis.from_url(store)
    write = store_client.register_script(FENCED_WRITE)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    pid = os.getpid()
    stopping = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping.set)
    answer_stack_requests()  # a worker that does not drain is asked where it is stuck

    def record(*fields: object) -> None:
        os.write(log, (" ".join(map(str, fields)) + "\n").encode())

    record("start", pid)  # from here on, SIGTERM asks it to drain

    async def turn(call: str, key: str) -> None:
        fence = current_fence()
        record("begin", pid, call, key, fence, time.monotonic_ns())
        await asyncio.sleep(rng.uniform(0, 0.02))
        accepted = await write(keys=[f"store:{key}"], args=[fence, call])
        await asyncio.sleep(rng.uniform(0, 0.01))
        record("end", pid, call, key, fence, time.monotonic_ns(), accepted)

    async def caller(lane: int) -> None:
        number = 0
        while not stopping.is_set():
            number += 1
            call, key = f"{pid}.{lane}.{number}", f"key-{rng.randrange(keys)}"
            registered = time.monotonic_ns()
            try:
                await queue.with_options(timeout=2 * lease).run(key, turn, call, key)
                outcome = "ok"
            except LeaseLost:
                outcome = "lost"
            except TimeoutError:
                outcome = "timeout"
            except RedisUnavailable:
                outcome = "unavailable"
                await asyncio.sleep(0.05)
            record("call", pid, call, key, registered, time.monotonic_ns(), outcome)

    await asyncio.gather(*(caller(lane) for lane in range(4)))
    await queue.aclose()
    record("exit", pid)


# -- the parent -----------------------------------------------------------------------------


@dataclass
class Report:
    calls: int = 0
    turns: int = 0
    outcomes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    faults: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    overlaps: list[str] = field(default_factory=list[str])
    lost_writes: list[str] = field(default_factory=list[str])
    hung: list[str] = field(default_factory=list[str])
    stacks: list[str] = field(default_factory=list[str])  # of workers that did not drain

    def problems(self) -> list[str]:
        return self.overlaps + self.lost_writes + self.hung

    def summary(self) -> str:
        return (
            f"{self.calls} calls, {self.turns} turns, outcomes {dict(self.outcomes)}, "
            f"faults {dict(self.faults)}: {len(self.overlaps)} overlapping turns outside a "
            f"lost lease, {len(self.lost_writes)} fenced writes lost, {len(self.hung)} calls "
            "hung past their bound" + "".join(f"\n{stack}" for stack in self.stacks)
        )


class Chaos:
    """Runs the workers and the faults, then reads the log."""

    def __init__(self, workers: int, seconds: float, seed: int, lease: float, keys: int) -> None:
        from .redis_server import RedisServer, redis_server_binary

        self.workers, self.seconds, self.lease, self.keys = workers, seconds, lease, keys
        self.rng = random.Random(seed)
        self.directory = Path(tempfile.mkdtemp(prefix="keyserial-chaos-"))
        self.log = self.directory / "log"
        self.errors = (self.directory / "stderr").open("ab")  # the workers' warnings
        self.coordinator = RedisServer(redis_server_binary(), persistent=True)
        self.store = RedisServer(redis_server_binary())
        self.processes: dict[int, subprocess.Popen[bytes]] = {}
        self.killed: dict[int, int] = {}  # pid -> when (monotonic ns)
        self.stopped: dict[int, list[tuple[int, int]]] = defaultdict(list)
        self.report = Report()

    def spawn(self) -> None:
        seed = self.rng.randrange(2**32)
        process = subprocess.Popen(
            [
                sys.executable, "-m", "tests.redis_chaos", "worker", self.coordinator.url,
                self.store.url, str(self.log), str(seed), str(self.keys), str(self.lease),
            ],
            cwd=ROOT,
            stderr=self.errors,
        )  # fmt: skip
        self.processes[process.pid] = process

    def run(self) -> Report:
        self.coordinator.start()
        self.store.start()
        try:
            for _ in range(self.workers):
                self.spawn()
            deadline = time.monotonic() + self.seconds
            while time.monotonic() < deadline:
                time.sleep(self.rng.uniform(0.2, 1.0))
                self.fault()
            self.drain()
            self.check()
        finally:
            for process in self.processes.values():
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGCONT)
                if process.poll() is None:
                    process.kill()
                process.wait()
            self.coordinator.close()
            self.store.close()
            self.errors.close()
        return self.report

    def fault(self) -> None:
        kind = self.rng.choice(["kill", "stop", "restart", "restart-persistent", "sleep", "pause"])
        self.report.faults[kind] += 1
        live = [pid for pid, p in self.processes.items() if p.poll() is None]
        if kind == "kill" and live:
            pid = self.rng.choice(live)
            self.processes[pid].kill()
            self.killed[pid] = time.monotonic_ns()
            self.spawn()
        elif kind == "stop" and live:
            pid = self.rng.choice(live)
            began = time.monotonic_ns()
            os.kill(pid, signal.SIGSTOP)
            time.sleep(self.rng.uniform(0.2, 2.0) * self.lease)
            os.kill(pid, signal.SIGCONT)
            self.stopped[pid].append((began, time.monotonic_ns()))
        elif kind.startswith("restart"):
            self.coordinator.restart(keep_data=kind == "restart-persistent")
        elif kind == "sleep":
            self.coordinator.command(f"DEBUG SLEEP {self.rng.uniform(0.1, 1.5) * self.lease:.2f}")
        elif kind == "pause":
            self.coordinator.command(f"CLIENT PAUSE {int(self.rng.uniform(0.1, 1.5) * 1000)}")

    def drain(self) -> None:
        """Ask every live worker to finish its calls and exit; one that does not, hung."""
        live = [p for pid, p in self.processes.items() if pid not in self.killed]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # a worker just started may not listen yet
            started = {line.split()[1] for line in self.log.read_text().splitlines()
                       if line.startswith("start ")}  # fmt: skip
            if all(str(process.pid) in started for process in live):
                break
            time.sleep(0.05)
        for process in live:
            process.send_signal(signal.SIGTERM)
        bound = 2 * self.lease + self.lease + SLACK + 10
        for process in live:
            try:
                process.wait(timeout=bound)
            except subprocess.TimeoutExpired:
                self.report.hung.append(f"worker {process.pid} did not drain")
                self.report.stacks.append(self.stacks_of(process))
            else:
                if process.returncode != 0:
                    self.report.hung.append(f"worker {process.pid} exited {process.returncode}")

    def stacks_of(self, process: subprocess.Popen[bytes]) -> str:
        """Where a worker that does not drain is stuck: its tasks, else its thread."""
        self.errors.flush()
        return stacks_of(process, self.directory / "stderr")

    def stopped_during(self, pid: int, start: int, end: int) -> int:
        return sum(max(0, min(end, b) - max(start, a)) for a, b in self.stopped.get(pid, []))

    def check(self) -> None:
        report = self.report
        begins: dict[str, tuple[int, str, int, int]] = {}
        ends: dict[str, tuple[int, int]] = {}
        outcomes: dict[str, str] = {}
        for line in self.log.read_text().splitlines():
            kind, *fields = line.split()
            if kind == "begin":
                begins[fields[1]] = (int(fields[0]), fields[2], int(fields[3]), int(fields[4]))
            elif kind == "end":
                ends[fields[1]] = (int(fields[4]), int(fields[5]))
            elif kind == "call":
                worker, name, registered, ended = int(fields[0]), fields[1], fields[3], fields[4]
                outcomes[name] = fields[5]
                report.calls += 1
                report.outcomes[fields[5]] += 1
                took = int(ended) - int(registered)
                took -= self.stopped_during(worker, int(registered), int(ended))
                if took > (2 * self.lease + self.lease + SLACK) * 1e9:
                    report.hung.append(f"call {name} took {took / 1e9:.2f} s")
        turns_by_key: dict[str, list[tuple[int, int, str]]] = defaultdict(list)
        for call, (pid, key, _fence, start) in begins.items():
            report.turns += 1
            if call in ends:
                end, accepted = ends[call]
                if outcomes.get(call) == "ok" and not accepted:
                    report.lost_writes.append(f"call {call} on {key}: its write was refused")
            elif pid in self.killed:
                end = self.killed[pid]  # killed inside its turn
                if self.stopped_during(pid, start, end):
                    # Stopped inside its turn, then killed: its lease ran out while it was
                    # stopped, which is a lost lease (it died before it could say so).
                    outcomes[call] = "lost"
            else:
                end = start  # cut short by LeaseLost before it wrote: it did nothing
            turns_by_key[key].append((start, end, call))
        for key, turns in turns_by_key.items():
            turns.sort()
            latest_end, latest_call = 0, ""
            for start, end, call in turns:
                excused = outcomes.get(call) == "lost" or outcomes.get(latest_call) == "lost"
                if start < latest_end and not excused:
                    report.overlaps.append(f"{key}: {call} started inside {latest_call}'s turn")
                if end > latest_end:
                    latest_end, latest_call = end, call


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.redis_chaos", description=__doc__)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--lease", type=float, default=0.5)
    parser.add_argument("--keys", type=int, default=5)
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        coordinator, store, log, seed, keys, lease = sys.argv[2:8]
        asyncio.run(work(coordinator, store, log, int(seed), int(keys), float(lease)))
        return 0
    options = parser.parse_args()
    report = Chaos(
        options.workers, options.seconds, options.seed, options.lease, options.keys
    ).run()
    print(report.summary())
    for problem in report.problems():
        print(problem)
    return 1 if report.problems() else 0


if __name__ == "__main__":
    raise SystemExit(main())
