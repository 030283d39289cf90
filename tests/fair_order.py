"""The cross-process order test shared by the Redis and PostgreSQL backends.

Four processes make calls on one key on a shuffled schedule: call ``i`` is made
``i * SPACING`` after a common start, by a process picked at random, and each turn lasts
``TURN`` (longer than the spacing), so every process queues several calls of its own. Each
worker writes one line per call: ``call made_ns started_ns ended_ns``, on the system-wide
monotonic clock. An *overtake* is a pair of calls where the one made at least ``MARGIN``
earlier started later.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from itertools import pairwise
from pathlib import Path
from typing import Any

from .processes import run_until_done

PROCESSES = 4
CALLS = 40
SPACING = 0.05
TURN = 0.075
MARGIN_NS = 20_000_000


def schedule(seed: int) -> list[int]:
    """The process making each call, shuffled so that every process makes CALLS / 4."""
    owners = [call % PROCESSES for call in range(CALLS)]
    random.Random(seed).shuffle(owners)
    return owners


async def make_calls(
    run: Callable[..., Coroutine[Any, Any, Any]],
    arguments: list[str],
    hold: Callable[[float], Awaitable[object]],
) -> None:
    """A worker's part: warm its queue up, make its calls of the schedule at their times on
    one key through ``run`` (a queue's ``run``), each turn ``hold``-ing for the turn's length
    and logging its line. ``arguments``: those `run_workers` passes after the mode."""
    log_path, owners, index, start, spacing, turn = arguments
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    async def work(call: int, made: int) -> None:
        started = time.monotonic_ns()
        await hold(float(turn))
        os.write(log, f"{call} {made} {started} {time.monotonic_ns()}\n".encode())

    async def warm_up() -> None:
        pass

    # As a long-running service would be: connected, its scripts or sequence in place.
    await run("warm-up", warm_up)
    calls: list[asyncio.Task[Any]] = []
    for call, owner in enumerate(owners.split(",")):
        if int(owner) != int(index):
            continue
        made_at = int(start) + call * float(spacing) * 1e9
        await asyncio.sleep(max(0.0, (made_at - time.monotonic_ns()) / 1e9))
        calls.append(asyncio.create_task(run("key", work, call, time.monotonic_ns())))
    await asyncio.gather(*calls)
    os.close(log)


def run_workers(worker: list[str], log: Path, seed: int) -> list[tuple[int, int, int, int]]:
    """Start the processes (``worker`` is the command before the common arguments), wait for
    them, and return ``(call, made, started, ended)`` for every call, in call order."""
    owners = ",".join(map(str, schedule(seed)))
    start = time.monotonic_ns() + 3_000_000_000  # after every process has started
    run_until_done(
        [*worker, str(log), owners, str(index), str(start), str(SPACING), str(TURN)]
        for index in range(PROCESSES)
    )
    records = [tuple(map(int, line.split())) for line in log.read_text().splitlines()]
    return sorted((r[0], r[1], r[2], r[3]) for r in records)


def check_turns(records: list[tuple[int, int, int, int]]) -> int:
    """Assert every call ran once and no two turns overlapped; return the overtakes."""
    assert [call for call, *_ in records] == list(range(CALLS)), "a call ran twice or never"
    by_start = sorted(records, key=lambda record: record[2])
    for (_, _, _, ended), (_, _, started, _) in pairwise(by_start):
        assert ended <= started, "two turns overlapped"
    return sum(
        1
        for _, made, started, _ in records
        for _, later_made, later_started, _ in records
        if later_made - made >= MARGIN_NS and started > later_started
    )


def report(name: str, overtakes: int) -> None:
    """Say the default mode's figure in the test log (it is measured, not asserted)."""
    sys.stdout.write(f"\n{name}: {overtakes} overtaking pairs\n")
