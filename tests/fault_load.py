"""The fault suite's load, shared by its Redis and PostgreSQL tests: processes making calls on a
few keys on a fixed schedule while a fault hits, each logging what its calls did.

Call ``i`` is made ``i * SPACING`` after a common start by process ``i % PROCESSES``, on key
``k<i % KEYS>``; its turn lasts ``TURN``. A worker appends to the log, on the system-wide
monotonic clock: ``S call key pid made started fence`` when a function starts, ``E call
ended`` when it ends, and ``O call outcome`` when the call returns (``ok``, ``lease-lost``),
retrying a call that failed with the backend's "unavailable" error (it did not run).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from keyserial import LeaseLost, current_fence

ROOT = Path(__file__).resolve().parent.parent

PROCESSES = 3
KEYS = 2
CALLS = 120
SPACING = 0.02
TURN = 0.03
LEASE = 0.5
#: Calls made this far apart in fair mode start in the order they were made.
MARGIN_NS = 20_000_000


async def make_calls(
    run: Callable[..., Coroutine[Any, Any, Any]],
    unavailable: type[BaseException],
    log_path: str,
    index: int,
    start_ns: int,
    lost: tuple[type[BaseException], ...] = (LeaseLost,),
) -> None:
    """A worker's part of the schedule, through ``run`` (a queue's ``run``): ``lost`` are the
    backend's errors for a turn whose lease ran out while it ran, ``unavailable`` its error
    for a call that did not run."""
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(line: str) -> None:
        os.write(log, f"{line}\n".encode())

    async def work(call: int, key: str, made: int) -> None:
        write(f"S {call} {key} {os.getpid()} {made} {time.monotonic_ns()} {current_fence()}")
        await asyncio.sleep(TURN)
        write(f"E {call} {time.monotonic_ns()}")

    async def one(call: int, key: str) -> None:
        while True:
            made = time.monotonic_ns()  # a call made again is a new call
            try:
                await run(key, work, call, key, made)
                outcome = "ok"
            except lost:
                outcome = "lease-lost"
            except unavailable:
                await asyncio.sleep(0.05)  # it did not run: make it again
                continue
            write(f"O {call} {outcome}")
            return

    while True:  # warmed up as a long-running service would be: connected, scripts loaded
        try:
            await run("warm-up", asyncio.sleep, 0)
            break
        except unavailable:
            await asyncio.sleep(0.05)
    calls: list[asyncio.Task[None]] = []
    for call in range(index, CALLS, PROCESSES):
        await asyncio.sleep(max(0.0, (start_ns + call * SPACING * 1e9 - time.monotonic_ns()) / 1e9))
        calls.append(asyncio.create_task(one(call, f"k{call % KEYS}")))
    await asyncio.gather(*calls)
    os.close(log)


def until_holding(log: Path, index: int) -> None:
    """Wait until a function of process ``index`` has started and not ended: it holds a turn
    (its call may still end before the caller acts; the check allows for that)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if log.exists():
            calls = read(log).items()
            if any(n % PROCESSES == index and c.starts and c.ended is None for n, c in calls):
                return
        time.sleep(0.002)
    raise AssertionError(f"process {index} never held a turn")


def start_workers(worker: list[str], log: Path) -> tuple[list[subprocess.Popen[str]], int]:
    """Start the processes (``worker``: the command before the log, index and start)."""
    start = time.monotonic_ns() + 1_500_000_000  # after every process has started
    workers = [
        subprocess.Popen([*worker, str(log), str(index), str(start)], cwd=ROOT, text=True)
        for index in range(PROCESSES)
    ]
    return workers, start


def wait_for(
    workers: list[subprocess.Popen[str]], seconds: float, killed: int | None = None
) -> None:
    """Every worker but the ``killed`` one ends within ``seconds``: no call is left waiting."""
    deadline = time.monotonic() + seconds
    try:
        for index, process in enumerate(workers):
            if index == killed:
                continue
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
            assert process.returncode == 0, f"a worker failed ({process.returncode})"
    except subprocess.TimeoutExpired:
        raise AssertionError(f"calls still waiting {seconds:g} s after the fault") from None
    finally:
        for process in workers:
            if process.poll() is None:
                process.kill()
                process.wait()


@dataclass
class Call:
    key: str = ""
    pid: int = 0
    made: int = 0
    starts: list[int] = field(default_factory=list[int])
    ended: int | None = None
    outcomes: list[str] = field(default_factory=list[str])


def read(log: Path) -> dict[int, Call]:
    calls: dict[int, Call] = defaultdict(Call)
    for line in log.read_text().splitlines():
        kind, call, *rest = line.split()
        record = calls[int(call)]
        if kind == "S":
            record.key, record.pid, record.made = rest[0], int(rest[1]), int(rest[2])
            record.starts.append(int(rest[3]))
        elif kind == "E":
            record.ended = int(rest[0])
        else:
            record.outcomes.append(rest[0])
    return dict(calls)


def check(log: Path, fault: tuple[int, int], fair: bool, killed: int | None = None) -> None:
    """What every fault case promises (``fault``: when it began and ended, monotonic ns):
    every call's function ran once and its call returned once; no function started on a
    lease that had run out (no two turns of a key overlap, but for a turn that was running
    when the fault began and was told so with LeaseLost); the key passed on within 1.5
    leases but across the fault; in fair mode, calls made apart a lease or more after the
    fault started in call order, and each process's calls of a key always in call order. ``killed``:
    the index of a process killed by the fault, whose calls are not expected to end."""
    calls = read(log)
    expected = [call for call in range(CALLS) if call % PROCESSES != killed]
    assert [call for call in sorted(calls) if call % PROCESSES != killed] == expected, (
        "a call never ran"
    )
    began, ended = fault
    lease_ns = int(LEASE * 1e9)
    for number, call in calls.items():
        if number % PROCESSES == killed:
            assert len(call.starts) <= 1, f"call {number}'s function ran twice"
            continue
        assert len(call.starts) == 1, f"call {number}'s function ran {len(call.starts)} times"
        assert len(call.outcomes) == 1, f"call {number} returned {len(call.outcomes)} times"
        if call.outcomes == ["lease-lost"]:
            assert call.starts[0] < began, f"call {number} got LeaseLost, started after the fault"
    by_key: dict[str, list[Call]] = defaultdict(list)
    for call in calls.values():
        by_key[call.key].append(call)
    for key, turns in by_key.items():
        turns.sort(key=lambda call: call.starts[0])
        for before, after in pairwise(turns):
            if before.outcomes != ["lease-lost"] and before.ended is not None:
                assert before.ended is not None and before.ended <= after.starts[0], (
                    f"two turns of {key} overlapped: a function started on a lease that ran out"
                )
            if before.ended is not None or before.starts[0] < began:
                idle_from = max(before.ended or began, after.made)
                if idle_from < ended and after.starts[0] > began:
                    idle_from = max(idle_from, ended)  # idle across the fault: from its end
                gap = after.starts[0] - idle_from
                assert gap <= 1.5 * lease_ns, f"{key} stood idle {gap / 1e9:.2f} s"
        mine: dict[int, list[Call]] = defaultdict(list)
        for call in turns:
            mine[call.pid].append(call)
        for own in mine.values():
            assert [c.made for c in own] == sorted(c.made for c in own), "a process's order"
        if fair:
            # A process's registrations delayed by the fault (sent one at a time, in order)
            # reach the server within a lease of its end.
            after_fault = [call for call in turns if call.made > ended + lease_ns]
            for call in after_fault:
                for later in after_fault:
                    if later.made - call.made >= MARGIN_NS:
                        assert call.starts[0] < later.starts[0], (
                            f"{key}: a call overtook: made {(later.made - ended) / 1e6:.0f} ms "
                            f"after the fault by {later.pid}, it started "
                            f"{(call.starts[0] - later.starts[0]) / 1e6:.0f} ms before one made "
                            f"{(later.made - call.made) / 1e6:.0f} ms earlier by {call.pid}"
                        )
