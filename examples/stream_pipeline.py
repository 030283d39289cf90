"""The transcript pipeline fed through a Redis stream, two consumer processes, one killed.

Each segment gets three updates — partial, revision, final — published a few milliseconds
apart to one stream. Two consumer processes handle them; a partial takes longest. Halfway
through, one consumer is killed (SIGKILL). Two ways to consume:

* ``consumer group``: a plain Redis consumer group, each message handled as it arrives.
  Updates of one segment run concurrently, on either process: a slow partial lands after
  the final, and the killed consumer's messages are lost until someone reclaims them;
* ``KeyedStream``: each partition has one owner; updates of a segment run one at a time in
  stream order, different segments concurrently. The survivor takes over the killed
  consumer's partitions within a lease and first reruns its unacknowledged messages.

Every write goes through a store that keeps, per segment, the highest fence it has seen
and refuses a write with a lower one: a consumer that lost its partition (here, none
survives to try; with SIGSTOP it would) cannot overwrite its successor's work.

Needs a Redis server (``--url``, by default the local one; the example's keys are removed
afterwards) and the ``redis`` extra: pip install ".[redis]".

Run it:  python examples/stream_pipeline.py [--segments 100] [--url redis://127.0.0.1:6379/0]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import secrets
import signal
import time
from typing import Any
from urllib.parse import urlsplit

import redis.asyncio as redis

from keyserial.streams import KeyedStream, StreamMessage

STAGES = ("partial", "revision", "final")
CONSUMERS = 2
LEASE = 1.0

# KEYS: the segment's hash. ARGV: stage, fence. Refuses a write from an older owner.
FENCED_SAVE = """
local seen = tonumber(redis.call('HGET', KEYS[1], 'fence') or '0')
if tonumber(ARGV[2]) < seen then
  return 0
end
redis.call('HSET', KEYS[1], 'stage', ARGV[1], 'fence', ARGV[2])
return 1
"""


def connect(url: str) -> redis.Redis:
    """A client for ``redis://[:password@]host[:port][/db]``."""
    parts = urlsplit(url)
    database = int(parts.path.strip("/") or 0)
    host, port = parts.hostname or "127.0.0.1", parts.port or 6379
    return redis.Redis(host=host, port=port, db=database, password=parts.password)


def work_seconds(stage: str, rng: random.Random) -> float:
    return rng.uniform(0.03, 0.06) if stage == "partial" else rng.uniform(0, 0.005)


# -- the consumers ----------------------------------------------------------------------------


async def keyed_consumer(url: str, name: str, seed: int) -> None:
    client = connect(url)
    stream = KeyedStream(client, name, partitions=8, lease=LEASE)
    save = client.register_script(FENCED_SAVE)
    rng = random.Random(seed)

    @stream.consumer(max_in_flight=500)
    async def handle(message: StreamMessage) -> None:
        stage = message.fields["stage"]
        await asyncio.sleep(work_seconds(stage, rng))
        await save(keys=[f"{name}:segment:{message.key}"], args=[stage, message.fence])
        await client.incr(f"{name}:runs")

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stream.stop)
    await stream.run()
    await stream.aclose()
    await client.aclose()


async def group_consumer(url: str, name: str, seed: int) -> None:
    client: Any = connect(url)
    rng = random.Random(seed)
    stopping = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping.set)
    running: set[asyncio.Task[None]] = set()

    async def handle(message_id: bytes, fields: dict[bytes, bytes]) -> None:
        stage = fields[b"stage"].decode()
        await asyncio.sleep(work_seconds(stage, rng))
        await client.hset(f"{name}:segment:{fields[b'segment'].decode()}", "stage", stage)
        await client.incr(f"{name}:runs")
        await client.xack(f"{name}:group", "workers", message_id)

    consumer = f"consumer-{os.getpid()}"
    while not stopping.is_set():
        reply = await client.xreadgroup("workers", consumer, {f"{name}:group": ">"}, 100, 100)
        for _, entries in reply if reply else ():
            for message_id, fields in entries:
                task = asyncio.create_task(handle(message_id, fields))
                running.add(task)
                task.add_done_callback(running.discard)
    await asyncio.gather(*running)
    await client.aclose()


def consumer_process(mode: str, url: str, name: str, seed: int) -> None:
    consumer = keyed_consumer if mode == "KeyedStream" else group_consumer
    asyncio.run(consumer(url, name, seed))


# -- the producer and the run -----------------------------------------------------------------


async def publish(url: str, name: str, mode: str, segments: int, rng: random.Random) -> None:
    client: Any = connect(url)
    stream = KeyedStream(client, name, partitions=8, lease=LEASE)
    for n in range(segments):
        segment = f"seg-{n:03d}"
        for stage in STAGES:
            if mode == "KeyedStream":
                await stream.publish(segment, {"stage": stage})
            else:
                await client.xadd(f"{name}:group", {"segment": segment, "stage": stage})
            await asyncio.sleep(rng.uniform(0, 0.004))
    await client.aclose()


async def run(url: str, mode: str, segments: int, seed: int) -> dict[str, int]:
    """One run: publish, kill a consumer halfway, wait; what the segments ended as."""
    rng = random.Random(seed)
    name = f"stream-pipeline-{secrets.token_hex(4)}"
    client: Any = connect(url)
    if mode == "consumer group":
        await client.xgroup_create(f"{name}:group", "workers", id="0", mkstream=True)
    spawn = multiprocessing.get_context("spawn")
    consumers = [
        spawn.Process(target=consumer_process, args=(mode, url, name, seed + i))
        for i in range(CONSUMERS)
    ]
    for process in consumers:
        process.start()
    try:
        await asyncio.sleep(2 * LEASE)  # the consumers start and share the partitions
        half = asyncio.create_task(publish(url, name, mode, segments, rng))
        await asyncio.sleep(0.0045 * segments * len(STAGES) / 2)
        os.kill(consumers[0].pid or 0, signal.SIGKILL)  # halfway through
        await half
        final = 0
        deadline = time.monotonic() + 3 * LEASE + 5
        while time.monotonic() < deadline:
            stages = [
                await client.hget(f"{name}:segment:seg-{n:03d}", "stage") for n in range(segments)
            ]
            final = sum(stage == b"final" for stage in stages)
            if final == segments:
                break
            await asyncio.sleep(0.1)
        runs = int(await client.get(f"{name}:runs") or 0)
        return {"segments": segments, "final": final, "runs": runs}
    finally:
        for process in consumers:
            if process.is_alive():
                os.kill(process.pid or 0, signal.SIGTERM)
            process.join(30)
        keys = [key async for key in client.scan_iter(f"*{name}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


async def main(url: str, segments: int, seed: int) -> dict[str, dict[str, int]]:
    return {
        mode: await run(url, mode, segments, seed) for mode in ("consumer group", "KeyedStream")
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="The transcript pipeline through a Redis stream.")
    parser.add_argument("--segments", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    options = parser.parse_args()
    results = asyncio.run(main(options.url, options.segments, options.seed))
    print(f"{'consumer':<16}{'segments':>10}{'final':>8}{'not final':>11}{'handler runs':>14}")
    for mode, result in results.items():
        stale = result["segments"] - result["final"]
        print(
            f"{mode:<16}{result['segments']:>10}{result['final']:>8}{stale:>11}{result['runs']:>14}"
        )
