"""The fault suite's load, shared by its Redis and PostgreSQL tests: processes making calls on a
few keys on a fixed schedule while a fault hits, each logging what its calls did.

Call ``i`` is made ``i * SPACING`` after a common start by process ``i % PROCESSES``, on key
``k<i % KEYS>``; its turn lasts ``TURN``. With bursts of ``n`` calls, the calls go in groups
of ``n``: group ``g`` is made at once, ``g * n * SPACING`` after the start, by process
``g % PROCESSES``, on key ``k<g % KEYS>`` (in PostgreSQL's fair mode, a process's calls
registered together on one key follow each other: a commit can begin the next one's turn). A
worker appends to the log, on the system-wide monotonic clock: ``S call key pid made started
fence`` when a function starts, ``E call ended`` when it ends, and ``O call outcome`` when the
call returns (``ok``, ``lease-lost``), retrying a call that failed with the backend's
"unavailable" error (it did not run).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

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
#: The two schedules of the suites: calls one at a time, or in bursts of three on one key (see
#: the docstring).
LOADS = pytest.mark.parametrize("burst", [1, 3], ids=["one at a time", "in bursts of 3"])


def process_of(call: int, burst: int) -> int:
    """The index of the process that makes ``call`` in bursts of ``burst`` calls."""
    return call // burst % PROCESSES


async def make_calls(
    run: Callable[..., Coroutine[Any, Any, Any]],
    unavailable: type[BaseException],
    log_path: str,
    index: int,
    start_ns: int,
    lost: tuple[type[BaseException], ...] = (LeaseLost,),
    in_doubt: tuple[type[BaseException], ...] = (),
    burst: int = 1,
) -> None:
    """A worker's part of the schedule, through ``run`` (a queue's ``run``): ``lost`` are the
    backend's errors for a turn whose lease ran out while it ran, ``unavailable`` its error
    for a call that did not run, ``in_doubt`` its errors for a commit whose outcome is unknown
    (the call is not made again); its calls in bursts of ``burst``."""
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(line: str) -> None:
        os.write(log, f"{line}\n".encode())

    async def work(call: int, attempt: int, key: str, made: int) -> None:
        pid, started, fence = os.getpid(), time.monotonic_ns(), current_fence()
        write(f"S {call} {attempt} {key} {pid} {made} {started} {fence}")
        await asyncio.sleep(TURN)
        write(f"E {call} {attempt} {time.monotonic_ns()}")

    async def one(call: int, key: str) -> None:
        for attempt in itertools.count():
            made = time.monotonic_ns()  # a call made again is a new call
            try:
                await run(key, work, call, attempt, key, made)
                outcome = "ok"
            except lost:
                outcome = "lease-lost"
            except in_doubt:
                outcome = "in-doubt"
            except unavailable:
                # Nothing of it was kept (it may have started: a turn whose session the server
                # ended): make it again.
                write(f"O {call} {attempt} unavailable")
                await asyncio.sleep(0.05)
                continue
            write(f"O {call} {attempt} {outcome}")
            return

    while True:  # warmed up as a long-running service would be: connected, scripts loaded
        try:
            await run("warm-up", asyncio.sleep, 0)
            break
        except unavailable:
            await asyncio.sleep(0.05)
    calls: list[asyncio.Task[None]] = []
    for group in range(index, -(-CALLS // burst), PROCESSES):
        first = group * burst
        at = start_ns + first * SPACING * 1e9
        await asyncio.sleep(max(0.0, (at - time.monotonic_ns()) / 1e9))
        for call in range(first, min(first + burst, CALLS)):  # at once: registered together
            calls.append(asyncio.create_task(one(call, f"k{group % KEYS}")))
    await asyncio.gather(*calls)
    os.close(log)


def until_holding(log: Path, process: subprocess.Popen[str]) -> None:
    """Wait until a function of ``process`` has started and not ended: it holds a turn (its
    call may still end before the caller acts; the check allows for that)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if log.exists():
            turns, _ = read(log)
            if any(t.pid == process.pid and t.ended is None for t in turns):
                return
        time.sleep(0.002)
    raise AssertionError(f"process {process.pid} never held a turn")


Workers = list[subprocess.Popen[str]]
#: A fault: it hits the workers or their server, and returns when it began if it first waited
#: for its moment (None: when it was called).
Fault = Callable[[Workers], "int | None"]


def run_case(
    worker: list[str],
    log: Path,
    fair: bool,
    fault: Fault,
    killed: int | None = None,
    unkept: bool = False,
    burst: int = 1,
) -> None:
    """One fault case: start the workers (``worker``: the command before the log, index and
    start; they make their calls in bursts of ``burst``), let ``fault`` hit a quarter into
    the schedule, with calls queued on both keys, wait for the workers, and `check` what they
    logged."""
    workers, start = start_workers(worker, log)
    at = start + CALLS * SPACING * 1e9 / 4
    time.sleep(max(0.0, (at - time.monotonic_ns()) / 1e9))
    began = time.monotonic_ns()
    began = fault(workers) or began
    ended = time.monotonic_ns()
    wait_for(workers, 20 * LEASE + 10, killed)
    check(log, (began, ended), fair, killed, unkept, burst)


def kill_holder(log: Path, index: int) -> Fault:
    """The fault: kill process ``index`` while it holds a turn."""

    def kill(workers: Workers) -> int:
        until_holding(log, workers[index])
        workers[index].kill()
        return time.monotonic_ns()

    return kill


def stop_holder(log: Path, index: int) -> Fault:
    """The fault: stop process ``index`` for three leases while it holds a turn."""

    def stop(workers: Workers) -> int:
        until_holding(log, workers[index])
        return stop_for(workers[index], 3 * LEASE)

    return stop


def stop_process(index: int) -> Fault:
    """The fault: stop process ``index`` for three leases, whatever it does (it has calls
    waiting: past two leases, their tickets' heartbeats stop)."""
    return lambda workers: stop_for(workers[index], 3 * LEASE)


def stop_for(process: subprocess.Popen[str], seconds: float) -> int:
    """SIGSTOP ``process``, SIGCONT it ``seconds`` later; when it was stopped."""
    process.send_signal(signal.SIGSTOP)
    began = time.monotonic_ns()
    time.sleep(seconds)
    process.send_signal(signal.SIGCONT)
    return began


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
class Turn:
    """One attempt of a call whose function started."""

    call: int
    attempt: int
    key: str
    pid: int
    made: int
    started: int
    ended: int | None = None
    outcome: str | None = None  # None: its process was killed first


def read(log: Path) -> tuple[list[Turn], dict[int, list[str]]]:
    """The turns (started attempts), and each call's outcomes, attempt by attempt."""
    turns: dict[tuple[int, int], Turn] = {}
    outcomes: dict[int, list[str]] = defaultdict(list)
    ends: dict[tuple[int, int], int] = {}
    ended_as: dict[tuple[int, int], str] = {}
    for line in log.read_text().splitlines():
        kind, call, attempt, *rest = line.split()
        at = (int(call), int(attempt))
        if kind == "S":
            key, pid, made, started = rest[0], int(rest[1]), int(rest[2]), int(rest[3])
            turns[at] = Turn(at[0], at[1], key, pid, made, started)
        elif kind == "E":
            ends[at] = int(rest[0])
        else:
            outcomes[at[0]].append(rest[0])
            ended_as[at] = rest[0]
    for at, turn in turns.items():
        turn.ended, turn.outcome = ends.get(at), ended_as.get(at)
    return sorted(turns.values(), key=lambda turn: turn.started), dict(outcomes)


def check(
    log: Path,
    fault: tuple[int, int],
    fair: bool,
    killed: int | None = None,
    unkept: bool = False,
    burst: int = 1,
) -> None:
    """What every fault case promises (``fault``: when it began and ended, monotonic ns):
    every call returned once and its function ran once, but for turns whose writes were not
    kept (``unkept``: the backend may say so with its "unavailable" error, for a turn running
    when the fault hit; the call is then made again); no function started on a lease that had
    run out (no two turns of a key overlap, but for a turn that was running when the fault
    began and was told so); the key passed on within 1.5 leases but across the fault; each
    process's calls of a key started in call order, and in fair mode, so did calls made
    apart a lease or more after the fault. ``killed``: the index of a process killed by the
    fault, whose calls are not expected to end."""
    turns, outcomes = read(log)
    began, ended = fault
    lease_ns = int(LEASE * 1e9)
    for call in range(CALLS):
        if process_of(call, burst) == killed:
            continue
        returned = [outcome for outcome in outcomes.get(call, []) if outcome != "unavailable"]
        assert len(returned) == 1, f"call {call} returned {len(returned)} times"
    started: dict[int, list[Turn]] = defaultdict(list)
    for turn in turns:
        started[turn.call].append(turn)
    for call, attempts in started.items():
        kept = [turn for turn in attempts if turn.outcome != "unavailable"]
        assert len(kept) <= 1, f"call {call}'s function ran {len(kept)} times"
        for turn in attempts:
            if turn.outcome == "unavailable":
                assert unkept, f"call {call}'s function ran, then its call failed as unavailable"
                assert turn.started < ended, f"call {call}: a turn lost after the fault"
            if turn.outcome == "lease-lost":
                assert turn.started < began, f"call {call} got LeaseLost, started after the fault"
            if turn.outcome == "in-doubt":
                assert turn.started < ended, f"call {call}: a commit in doubt after the fault"
    by_key: dict[str, list[Turn]] = defaultdict(list)
    for turn in turns:
        by_key[turn.key].append(turn)
    for key, ordered in by_key.items():
        for before, after in pairwise(ordered):
            if before.outcome == "ok":
                assert before.ended is not None and before.ended <= after.started, (
                    f"two turns of {key} overlapped: a function started on a lease that ran "
                    f"out\n{timeline(ordered, after.started, fault)}"
                )
            if before.ended is not None or before.started < began:
                idle_from = max(before.ended or began, after.made)
                if idle_from < ended and after.started > began:
                    idle_from = max(idle_from, ended)  # idle across the fault: from its end
                gap = after.started - idle_from
                assert gap <= 1.5 * lease_ns, (
                    f"{key} stood idle {gap / 1e9:.2f} s\n{timeline(ordered, after.started, fault)}"
                )
        mine: dict[int, list[Turn]] = defaultdict(list)
        for turn in ordered:
            if turn.outcome != "unavailable":
                mine[turn.pid].append(turn)
        for own in mine.values():
            assert [t.made for t in own] == sorted(t.made for t in own), "a process's order"
        if fair:
            # A process's registrations delayed by the fault (sent one at a time, in order)
            # reach the server within a lease of its end.
            after_fault = [turn for turn in ordered if turn.made > ended + lease_ns]
            for turn in after_fault:
                for later in after_fault:
                    if later.made - turn.made >= MARGIN_NS:
                        assert turn.started < later.started, (
                            f"{key}: a call overtook: made {(later.made - ended) / 1e6:.0f} ms "
                            f"after the fault by {later.pid}, it started "
                            f"{(turn.started - later.started) / 1e6:.0f} ms before one made "
                            f"{(later.made - turn.made) / 1e6:.0f} ms earlier by {turn.pid}\n"
                            f"{timeline(ordered, later.started, fault)}"
                        )


def timeline(turns: list[Turn], at: int, fault: tuple[int, int], span_ns: int = 10**9) -> str:
    """The turns of one key that started within ``span_ns`` of ``at``, one per line, in ms
    from the fault's beginning: what a failed timing check saw."""
    began, ended = fault

    def ms(ns: int | None) -> str:
        return "-" if ns is None else f"{(ns - began) / 1e6:.0f}"

    lines = [f"fault: 0 to {ms(ended)} ms; call/attempt pid made started ended outcome:"]
    lines += [
        f"  {t.call}/{t.attempt} {t.pid} {ms(t.made)} {ms(t.started)} {ms(t.ended)} {t.outcome}"
        for t in turns
        if abs(t.started - at) <= span_ns
    ]
    return "\n".join(lines)
