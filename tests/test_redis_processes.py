"""Four processes share one RedisKeyedQueue through a real redis-server."""

from __future__ import annotations

import subprocess
import sys
from itertools import pairwise
from pathlib import Path

from .redis_server import RedisServer

ROOT = Path(__file__).resolve().parent.parent


def test_four_processes_twenty_keys_no_overlap_fifo_exactly_once(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    log = tmp_path / "calls.log"
    processes, calls, keys = 4, 150, 20
    command = [sys.executable, "-m", "tests.redis_worker", redis_server.url, "log", str(log)]
    workers = [
        subprocess.Popen(
            [*command, str(seed), str(calls), str(keys)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        for seed in range(processes)
    ]
    try:
        for worker in workers:
            out, _ = worker.communicate(timeout=120)
            assert worker.returncode == 0 and out.strip() == "done"
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    records = [line.split() for line in log.read_text().splitlines()]
    # Every call ran exactly once.
    assert len(records) == processes * calls
    assert len({(pid, call) for _, pid, call, *_ in records}) == processes * calls
    assert len({pid for _, pid, *_ in records}) == processes
    by_key: dict[str, list[tuple[int, int, int, int]]] = {}
    for key, _, _, ticket_text, fence_text, started, ended in records:
        arrival = int(ticket_text.partition("@")[0])  # "<n>@<listener>": n is the arrival order
        by_key.setdefault(key, []).append((int(started), int(ended), arrival, int(fence_text)))
    for key, turns in by_key.items():
        turns.sort()
        for (_, end, ticket, fence), (start, _, later_ticket, later_fence) in pairwise(turns):
            assert end <= start, f"{key}: two calls overlapped"
            assert ticket < later_ticket, f"{key}: tickets were not granted in FIFO order"
            assert fence < later_fence, f"{key}: fences did not increase"
