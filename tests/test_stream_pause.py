"""A stream consumer paused past its lease starts nothing once it resumes (real processes).

Each consumer is a process of its own on a real ``redis-server``. Its handler appends
``pid|fence|key|attempt`` to the Redis list ``starts`` as its first, synchronous step, so the
list is the order in which handlers started. A consumer is stopped with SIGSTOP for several
leases while another takes its partition over and runs the same key's messages; once it
continues, it must start nothing with its old fence.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import redis

from keyserial.streams import KeyedStream

from .redis_server import RedisServer

LEASE = 0.5  # the stream's lease: a stopped owner's partition is taken over within it
PAUSE = 6 * LEASE

CONSUMER = f"""
import asyncio, os, signal, sys
import redis, redis.asyncio as redis_asyncio
from keyserial.streams import KeyedStream, StreamMessage

async def main(url: str, pause_self: bool, retry_delay: float) -> None:
    client = redis_asyncio.Redis.from_url(url)
    log = redis.Redis.from_url(url)  # synchronous: the record is made before anything else
    stream = KeyedStream(client, "pause", partitions=1, lease={LEASE})

    @stream.consumer(max_attempts=3, retry_delay=retry_delay, drain_timeout=1)
    async def handle(message: StreamMessage) -> None:
        started = f"{{os.getpid()}}|{{message.fence}}|{{message.key}}|{{message.attempt}}"
        log.rpush("starts", started)
        kind = message.fields["kind"]
        if kind == "stop-self" and pause_self:
            os.kill(os.getpid(), signal.SIGSTOP)  # the rest of the batch has not started
        if kind == "fail-once" and message.attempt == 1:
            raise RuntimeError("fails once")

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stream.stop)
    print("ready", flush=True)
    await stream.run()
    await stream.aclose()
    await client.aclose()

asyncio.run(main(sys.argv[1], sys.argv[2] == "pause-self", float(sys.argv[3])))
"""


def _publish(url: str, messages: list[tuple[str, str]]) -> None:
    import asyncio

    import redis.asyncio as redis_asyncio

    async def publish() -> None:
        client = redis_asyncio.Redis.from_url(url)
        stream = KeyedStream(client, "pause", partitions=1, lease=LEASE)
        for key, kind in messages:
            await stream.publish(key, {"kind": kind})
        await stream.aclose()
        await client.aclose()

    asyncio.run(publish())


@contextmanager
def consumers(url: str) -> Generator[Callable[..., subprocess.Popen[bytes]], None, None]:
    started: list[subprocess.Popen[bytes]] = []

    def start(*, pause_self: bool = False, retry_delay: float = 0.0) -> subprocess.Popen[bytes]:
        process = subprocess.Popen(
            [sys.executable, "-c", CONSUMER, url, "pause-self" if pause_self else "-",
             str(retry_delay)],
            stdout=subprocess.PIPE,
        )  # fmt: skip
        started.append(process)
        assert process.stdout is not None and process.stdout.readline().strip() == b"ready"
        return process

    try:
        yield start
    finally:
        for process in started:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.send_signal(signal.SIGTERM)
        for process in started:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            assert process.stdout is not None
            process.stdout.close()


def starts(records: redis.Redis) -> list[tuple[int, int, str, int]]:
    rows: Any = records.lrange("starts", 0, -1)
    found: list[tuple[int, int, str, int]] = []
    for row in rows:
        pid, fence, key, attempt = row.decode().split("|")
        found.append((int(pid), int(fence), key, int(attempt)))
    return found


def wait_for(condition: Callable[[], bool], what: str, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)


def stale_starts(log: list[tuple[int, int, str, int]]) -> list[tuple[int, int, str, int]]:
    """Starts whose fence is older than one that had already started (one partition)."""
    newest, stale = 0, list[tuple[int, int, str, int]]()
    for entry in log:
        if entry[1] < newest:
            stale.append(entry)
        newest = max(newest, entry[1])
    return stale


def test_a_consumer_paused_past_its_lease_never_starts_the_rest_of_its_batch(
    redis_server: RedisServer,
) -> None:
    url = redis_server.url
    records = redis.Redis.from_url(url)
    try:
        # One read batch: "a" stops its own process before any other message started.
        _publish(url, [("a", "stop-self"), ("b", "ok"), ("c", "ok"), ("a", "ok")])
        with consumers(url) as start:
            first = start(pause_self=True)
            _, status = os.waitpid(first.pid, os.WUNTRACED)  # returns once it is stopped
            assert os.WIFSTOPPED(status)
            assert [(key, pid) for pid, _, key, _ in starts(records)] == [("a", first.pid)]
            second = start()
            wait_for(lambda: len([s for s in starts(records) if s[0] == second.pid]) == 4,
                     "the second consumer took over and ran all four messages")  # fmt: skip
            first.send_signal(signal.SIGCONT)
            time.sleep(PAUSE)  # what the first consumer does on resuming, it has done by now
            log = starts(records)
        assert stale_starts(log) == []
        assert [s for s in log if s[0] == first.pid] == log[:1]  # it started nothing more
    finally:
        records.close()


def test_a_consumer_paused_in_its_retry_delay_never_retries_with_its_old_fence(
    redis_server: RedisServer,
) -> None:
    url = redis_server.url
    records = redis.Redis.from_url(url)
    try:
        _publish(url, [("r", "fail-once")])
        with consumers(url) as start:
            first = start(retry_delay=2 * LEASE)
            wait_for(lambda: len(starts(records)) == 1, "the first attempt starts and fails")
            first.send_signal(signal.SIGSTOP)  # within its retry delay
            second = start(retry_delay=2 * LEASE)
            wait_for(lambda: any(s[0] == second.pid and s[3] == 2 for s in starts(records)),
                     "the second consumer took over and retried")  # fmt: skip
            first.send_signal(signal.SIGCONT)  # its retry delay ended while it was stopped
            time.sleep(PAUSE)
            log = starts(records)
        assert stale_starts(log) == []
        assert [s for s in log if s[0] == first.pid] == log[:1]
    finally:
        records.close()
