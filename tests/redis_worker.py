"""A separate process using a RedisKeyedQueue, driven by the Redis tests.

python -m tests.redis_worker URL log LOGFILE SEED CALLS KEYS
    make CALLS calls over KEYS keys, appending one line per call to LOGFILE:
    key pid call ticket fence start_ns end_ns
python -m tests.redis_worker URL hold KEY LEASE
    take KEY's turn, print "holding <fence>", block until a line arrives on stdin,
    then write to the fenced resource "resource" with that fence and print "wrote"
    or "refused"; print "lease lost" if the turn's lease was lost, else "finished"
python -m tests.redis_worker URL wait KEY LEASE
    print "waiting", then wait for KEY's turn and print "got <fence>"
python -m tests.redis_worker URL order MODE LOG OWNERS INDEX START SPACING TURN
    the cross-process order test's worker (see tests/fair_order.py), MODE fair or default
python -m tests.redis_worker URL fault-load MODE POOL BURST LOG INDEX START
    the fault suite's worker (see tests/fault_load.py), MODE fair or default, POOL its
    client's max_connections (0: redis-py's default), BURST the calls it makes at once on one
    key (1: one at a time)
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time

import redis
import redis.asyncio

from keyserial import LeaseLost, current_fence
from keyserial.redis import RedisKeyedQueue, RedisUnavailable, encode_key

from . import fair_order, fault_load

# Writes VALUE to KEYS[1] only if FENCE is above the highest fence seen so far.
FENCED_WRITE = """
local last = tonumber(redis.call('HGET', KEYS[1], 'fence') or '0')
if tonumber(ARGV[1]) > last then
  redis.call('HSET', KEYS[1], 'fence', ARGV[1], 'value', ARGV[2])
  return 1
end
return 0
"""


#: Set by the tests' redis_mode fixture: the queues of the fault modes run in fair mode.
FAIR = os.environ.get("KEYSERIAL_TEST_REDIS_FAIR") == "1"


def say(line: str) -> None:
    print(line, flush=True)


async def log_calls(url: str, log_path: str, seed: int, calls: int, keys: int) -> None:
    client = redis.asyncio.Redis.from_url(url)
    queue = RedisKeyedQueue(client, namespace="multi", lease=5.0, fair=FAIR)
    rng = random.Random(seed)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    async def work(key: str, call: int, delay: float) -> None:
        task = asyncio.current_task()
        ticket = queue._turns.held[(task, encode_key(key))].ticket  # type: ignore[index]
        start = time.monotonic_ns()
        await asyncio.sleep(delay)
        end = time.monotonic_ns()
        line = f"{key} {os.getpid()} {call} {ticket} {current_fence()} {start} {end}\n"
        os.write(log, line.encode())

    plan = [(f"key-{rng.randrange(keys)}", call, rng.uniform(0, 0.002)) for call in range(calls)]
    await asyncio.gather(*(queue.run(key, work, key, call, delay) for key, call, delay in plan))
    await queue.aclose()
    await client.aclose()
    os.close(log)
    say("done")


async def order(url: str, fair: bool, arguments: list[str]) -> None:
    client = redis.asyncio.Redis.from_url(url)
    queue = RedisKeyedQueue(client, namespace="order", lease=5.0, fair=fair)
    await fair_order.make_calls(queue.run, arguments, asyncio.sleep)
    await queue.aclose()
    await client.aclose()
    say("done")


async def fault_calls(
    url: str, fair: bool, pool: int, burst: int, log: str, index: int, start: int
) -> None:
    client = redis.asyncio.Redis.from_url(url, max_connections=pool or None)
    queue = RedisKeyedQueue(client, namespace="load", lease=fault_load.LEASE, fair=fair)
    await fault_load.make_calls(queue.run, RedisUnavailable, log, index, start, burst=burst)
    await queue.aclose()
    await client.aclose()


async def hold(url: str, key: str, lease: float) -> None:
    client = redis.asyncio.Redis.from_url(url)
    queue = RedisKeyedQueue(client, namespace="faults", lease=lease, fair=FAIR)
    # The late write is sent at once on resuming, before the event loop runs again: a stale
    # holder whose own process has not yet noticed the loss, which only the fence can stop.
    writer = redis.Redis.from_url(url)
    write = writer.register_script(FENCED_WRITE)

    async def holding() -> None:
        fence = current_fence()
        say(f"holding {fence}")
        # Blocks the whole process, event loop included, until the test says "write":
        # meanwhile the test can stop (SIGSTOP) or kill this process.
        sys.stdin.readline()
        written = write(keys=["resource"], args=[fence, f"from {os.getpid()}"])
        say("wrote" if written else "refused")
        await asyncio.sleep(lease * 3)  # the lease keeper notices the loss meanwhile

    try:
        await queue.run(key, holding)
        say("finished")
    except LeaseLost:
        say("lease lost")
    await queue.aclose()
    await client.aclose()
    writer.close()


async def wait(url: str, key: str, lease: float) -> None:
    client = redis.asyncio.Redis.from_url(url)
    queue = RedisKeyedQueue(client, namespace="faults", lease=lease, fair=FAIR)

    async def got() -> None:
        say(f"got {current_fence()}")

    say("waiting")
    await queue.run(key, got)
    await client.aclose()


if __name__ == "__main__":
    url, mode, *rest = sys.argv[1:]
    if mode == "log":
        asyncio.run(log_calls(url, rest[0], int(rest[1]), int(rest[2]), int(rest[3])))
    elif mode == "hold":
        asyncio.run(hold(url, rest[0], float(rest[1])))
    elif mode == "order":
        asyncio.run(order(url, rest[0] == "fair", rest[1:]))
    elif mode == "fault-load":
        fair, pool, burst = rest[0] == "fair", int(rest[1]), int(rest[2])
        asyncio.run(fault_calls(url, fair, pool, burst, rest[3], int(rest[4]), int(rest[5])))
    elif mode == "wait":
        asyncio.run(wait(url, rest[0], float(rest[1])))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
