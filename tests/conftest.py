"""Fixtures: a private redis-server per test that needs one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .redis_server import RedisServer, redis_server_binary


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer(redis_server_binary())
    server.start()
    try:
        yield server
    finally:
        server.close()
