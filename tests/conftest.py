"""Fixtures: the loop setups every async test runs on, and a private redis-server."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import pytest

from .loops import LOOP_FACTORIES, LoopFactory
from .redis_server import RedisServer, redis_server_binary


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, LoopFactory]:
    return LOOP_FACTORIES


@pytest.fixture(params=list(LOOP_FACTORIES), ids=list(LOOP_FACTORIES))
def loop_factory(request: pytest.FixtureRequest) -> LoopFactory:
    """For tests that start their own loops: each loop setup in turn."""
    return LOOP_FACTORIES[request.param]


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer(redis_server_binary())
    server.start()
    try:
        yield server
    finally:
        server.close()
