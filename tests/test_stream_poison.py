"""A message that kills its consumer process: dead-lettered after ``max_deliveries``, not
redelivered to one consumer after another for ever (each consumer a real process)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from typing import Any

import redis
import redis.asyncio as redis_asyncio

from keyserial.streams import DeadLetter, KeyedStream

from .redis_server import RedisServer

LEASE = 0.5
MAX_DELIVERIES = 2

#: A consumer whose handler kills its own process on a message of kind "pill", and records
#: every other message it handles (key, kind, deliveries) in the list "handled".
CONSUMER = f"""
import asyncio, os, signal, sys
import redis.asyncio as redis
from keyserial.streams import KeyedStream, StreamMessage

async def main(url: str) -> None:
    client = redis.Redis.from_url(url)
    stream = KeyedStream(client, "poison", partitions=1, lease={LEASE})

    @stream.consumer(max_deliveries={MAX_DELIVERIES}, drain_timeout=5)
    async def handle(message: StreamMessage) -> None:
        if message.fields["kind"] == "pill":
            os.kill(os.getpid(), signal.SIGKILL)
        await client.rpush(
            "handled", f"{{message.key}}:{{message.fields['kind']}}:{{message.deliveries}}"
        )

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stream.stop)
    await stream.run()
    await stream.aclose()
    await client.aclose()

asyncio.run(main(sys.argv[1]))
"""


async def _publish(url: str) -> None:
    client = redis_asyncio.Redis.from_url(url)
    stream = KeyedStream(client, "poison", partitions=1, lease=LEASE)
    await stream.publish("seg", {"kind": "pill"})
    await stream.publish("seg", {"kind": "final"})  # behind the pill: must still run
    await stream.publish("other", {"kind": "partial"})
    await stream.aclose()
    await client.aclose()


async def _dead_letters(url: str) -> list[DeadLetter]:
    client = redis_asyncio.Redis.from_url(url)
    stream = KeyedStream(client, "poison", partitions=1, lease=LEASE)
    try:
        return list(await stream.dead_letters())
    finally:
        await stream.aclose()
        await client.aclose()


def test_a_message_that_kills_its_consumer_is_dead_lettered_and_its_key_moves_on(
    redis_server: RedisServer,
) -> None:
    url = redis_server.url
    asyncio.run(_publish(url))
    records = redis.Redis.from_url(url)

    def handled() -> list[str]:
        rows: Any = records.lrange("handled", 0, -1)
        return [row.decode() for row in rows]

    killed = 0
    consumer: subprocess.Popen[bytes] | None = None
    try:
        # Bounded: without the bound the pill kills every consumer that takes it over.
        for _ in range(MAX_DELIVERIES + 3):
            consumer = subprocess.Popen([sys.executable, "-c", CONSUMER, url])
            deadline = time.monotonic() + 30
            while consumer.poll() is None and time.monotonic() < deadline:
                if "seg:final:1" in handled():
                    break
                time.sleep(0.05)
            if consumer.poll() is None:
                break  # still alive: it got past the pill
            assert consumer.returncode == -signal.SIGKILL
            killed += 1
            consumer = None
        assert consumer is not None, f"the pill killed all {killed} consumers"
        assert killed == MAX_DELIVERIES  # run once per delivery up to the bound, then not
        seg = [entry for entry in handled() if entry.startswith("seg")]
        assert seg == ["seg:final:1"]  # it waited behind the pill, and never counted as run
        [dead] = asyncio.run(_dead_letters(url))
        assert (dead.key, dead.fields, dead.deliveries) == ("seg", {"kind": "pill"}, 3)
        assert "more than max_deliveries=2" in dead.error
    finally:
        if consumer is not None:
            consumer.send_signal(signal.SIGTERM)
            try:
                consumer.wait(timeout=20)
            except subprocess.TimeoutExpired:
                consumer.kill()
                consumer.wait()
        records.close()
