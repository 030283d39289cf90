"""Helpers of the Redis tests: clients of the test's server, a one-node cluster, and waiting
for a condition."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable

import redis.asyncio as redis

from keyserial.redis import encode_key
from keyserial.redis._names import base_name, encoded_namespace

from .redis_server import RedisServer, redis_server_binary

#: Makes a Redis client for the test's private server (one per simulated process).
Clients = Callable[..., redis.Redis]


@contextlib.asynccontextmanager
async def one_node_cluster() -> AsyncGenerator[redis.RedisCluster]:
    """A client of a private Redis Cluster of one node, holding every slot.

    One node is enough to test cluster support: a cluster refuses a script or command
    whose keys lie in different slots whatever the number of nodes.
    """
    server = RedisServer(redis_server_binary(), cluster=True)
    server.start()
    client = redis.RedisCluster(host="127.0.0.1", port=server.port)
    try:
        yield client
    finally:
        await client.aclose()
        server.close()


async def until(condition: Callable[[], bool], what: str, seconds: float = 10.0) -> None:
    """Let the loop (and Redis) work until ``condition()`` holds; fail after ``seconds``."""
    for _ in range(int(seconds / 0.005)):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never happened: {what}")


async def until_tickets_waiting(client: redis.Redis, namespace: str, key: str, count: int) -> None:
    """Wait until ``count`` tickets wait in Redis's queue for ``key`` (the holder's is not among
    them); fail after ten seconds."""
    queued = f"{base_name(encoded_namespace(namespace), encode_key(key))}:queue"
    for _ in range(2000):
        if await client.llen(queued) == count:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never {count} tickets waiting in Redis for {key!r}")
