"""Four processes share one RedisKeyedQueue through a real redis-server."""

from __future__ import annotations

import sys
import threading
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import redis

from keyserial.redis import _scripts as _redis_scripts
from keyserial.redis._transport import LuaScript

from . import fair_order
from .processes import run_until_done
from .redis_server import RedisServer


@pytest.mark.usefixtures("redis_mode")
def test_four_processes_twenty_keys_no_overlap_fifo_exactly_once(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    log = tmp_path / "calls.log"
    processes, calls, keys = 4, 150, 20
    arrivals = Arrivals(redis_server.url)
    command = [sys.executable, "-m", "tests.redis_worker", redis_server.url, "log", str(log)]
    try:
        run_until_done([*command, str(seed), str(calls), str(keys)] for seed in range(processes))
    finally:
        arrivals.stop()
    records = [line.split() for line in log.read_text().splitlines()]
    # Every call ran exactly once.
    assert len(records) == processes * calls
    assert len({(pid, call) for _, pid, call, *_ in records}) == processes * calls
    assert len({pid for _, pid, *_ in records}) == processes
    by_key: dict[str, list[tuple[int, int, str, int]]] = {}
    for key, _, _, ticket, fence_text, started, ended in records:
        by_key.setdefault(key, []).append((int(started), int(ended), ticket, int(fence_text)))
    for key, turns in by_key.items():
        turns.sort()
        for (_, end, _, fence), (start, _, _, later_fence) in pairwise(turns):
            assert end <= start, f"{key}: two calls overlapped"
            assert fence < later_fence, f"{key}: fences did not increase"
        # Turns were granted in the order the requests reached Redis, whatever the process.
        granted = [ticket for _, _, ticket, _ in turns]
        arrived = [ticket for ticket in arrivals.tickets_of(key) if ticket in set(granted)]
        assert granted == arrived, f"{key}: turns were not granted in arrival order"


class Arrivals:
    """The tickets of ACQUIRE requests in the order Redis executed them, read with MONITOR."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.sha = LuaScript(_redis_scripts.ACQUIRE).sha
        self.client.script_load(_redis_scripts.ACQUIRE)  # so that every request is an EVALSHA
        self.commands: list[str] = []
        # Any: some redis-py releases type the monitor's connection as Optional.
        self.monitor: Any = self.client.monitor()  # type: ignore[no-untyped-call]
        self.monitor.connection.send_command("MONITOR")
        self.monitor.connection.read_response()  # "OK": watching from here on
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            while True:
                entry: Any = self.monitor.next_command()
                command = str(entry["command"])
                if command.startswith("EVALSHA"):
                    self.commands.append(command)
        except Exception:  # the connection closed: stop()
            return

    def stop(self) -> None:
        self.monitor.connection.disconnect()
        self.thread.join(timeout=10)
        self.client.close()

    def tickets_of(self, key: str) -> list[str]:
        """The ACQUIRE tickets of ``key``, in execution order."""
        from keyserial.redis import encode_key

        marker = f":{encode_key(key)}}}"
        tickets: list[str] = []
        for command in self.commands:
            parts = command.split()
            if parts[0] == "EVALSHA" and parts[1] == self.sha and parts[3].endswith(marker):
                tickets.append(parts[5])
        return tickets


@pytest.mark.parametrize("mode", ["fair", "default"])
def test_across_processes_fair_mode_runs_calls_in_the_order_they_were_made(
    redis_server: RedisServer, tmp_path: Path, mode: str
) -> None:
    worker = [sys.executable, "-m", "tests.redis_worker", redis_server.url, "order", mode]
    records = fair_order.run_workers(worker, tmp_path / "calls.log", seed=7)
    overtakes = fair_order.check_turns(records)
    if mode == "fair":
        assert overtakes == 0
    else:
        fair_order.report("Redis, default mode", overtakes)
