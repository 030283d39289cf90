"""Helpers of the Redis tests: clients of the test's server, and waiting for a condition."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import redis.asyncio as redis

#: Makes a Redis client for the test's private server (one per simulated process).
Clients = Callable[..., redis.Redis]


async def until(condition: Callable[[], bool], what: str, seconds: float = 10.0) -> None:
    """Let the loop (and Redis) work until ``condition()`` holds; fail after ``seconds``."""
    for _ in range(int(seconds / 0.005)):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never happened: {what}")
