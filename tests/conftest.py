"""Fixtures: the loop setups every async test runs on, and a private redis-server."""

from __future__ import annotations

import asyncio
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Hashable,
    Iterator,
    Mapping,
)
from typing import TYPE_CHECKING, Any

import pytest
import pytest_asyncio
import redis.asyncio as redis

from keyserial import KeyedSerialQueue

if TYPE_CHECKING:
    from psycopg_pool import AsyncConnectionPool

from .clock import FakeClockLoop
from .loops import LOOP_FACTORIES, LoopFactory
from .postgres_server import cannot_connect, connection_errors, private_database, unavailable
from .redis_helpers import Clients
from .redis_server import RedisServer, redis_server_binary


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, LoopFactory]:
    if item.get_closest_marker("fake_clock") is not None:
        return {"fake clock": FakeClockLoop}
    return LOOP_FACTORIES


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A backend test in fair mode runs on the default loop only: the loop setups are
    tested in the default mode, and fair mode changes nothing in how the loop is used."""
    first_loop = next(iter(LOOP_FACTORIES))
    kept, dropped = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        fair = "fair" in (params.get("redis_mode"), params.get("postgres_mode"))
        loop = getattr(getattr(item, "callspec", None), "id", "").split("-")[0]
        if fair and loop in LOOP_FACTORIES and loop != first_loop:
            dropped.append(item)
        else:
            kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


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


def _fair_by_default(monkeypatch: pytest.MonkeyPatch, queue_class: Any, variable: str) -> None:
    """Make ``queue_class`` fair unless told otherwise, here and in the worker processes a
    test starts (they read ``variable``)."""
    defaults = queue_class.__init__.__kwdefaults__
    assert defaults is not None and "fair" in defaults, f"{queue_class.__name__} lost fair="
    monkeypatch.setitem(defaults, "fair", True)
    monkeypatch.setenv(variable, "1")


@pytest.fixture(params=["default", "fair"])
def redis_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a Redis test twice: with the default mode, and with every ``RedisKeyedQueue`` it
    makes (in the test, and in the worker processes it starts) in fair mode."""
    if request.param == "fair":
        from keyserial.redis import RedisKeyedQueue

        _fair_by_default(monkeypatch, RedisKeyedQueue, "KEYSERIAL_TEST_REDIS_FAIR")
    return str(request.param)


@pytest.fixture(params=["default", "fair"])
def postgres_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a PostgreSQL test twice: with the default mode, and with every
    ``PostgresKeyedQueue`` it makes (in the test, and in its worker processes) in fair mode."""
    if request.param == "fair":
        from keyserial.postgres import PostgresKeyedQueue

        _fair_by_default(monkeypatch, PostgresKeyedQueue, "KEYSERIAL_TEST_POSTGRES_FAIR")
    return str(request.param)


@pytest_asyncio.fixture
async def clients(redis_server: RedisServer) -> AsyncIterator[Clients]:
    """Makes Redis clients for the test's server (one per simulated process), closed after."""
    made: list[redis.Redis] = []

    def make(**options: Any) -> redis.Redis:
        made.append(redis.Redis.from_url(redis_server.url, **options))
        return made[-1]

    yield make
    for client in made:
        await client.aclose()


#: Runs ``fn(*args, **kwargs)`` in ``key``'s turn of ``queue``: through ``run``, or through the
#: ``run`` of a ``with_options`` view (the path every call with options takes).
RunInTurn = Callable[..., Coroutine[Any, Any, Any]]


def _through_run(
    queue: KeyedSerialQueue,
    key: Hashable,
    fn: Callable[..., Awaitable[Any]],
    *args: Any,
    **kwargs: Any,
) -> Coroutine[Any, Any, Any]:
    return queue.run(key, fn, *args, **kwargs)


def _through_a_watch(
    queue: KeyedSerialQueue,
    key: Hashable,
    fn: Callable[..., Awaitable[Any]],
    *args: Any,
    **kwargs: Any,
) -> Coroutine[Any, Any, Any]:
    """``queue.run`` as an observed queue runs it: watched by an observer, through ``run``."""
    from keyserial import QueueObserver
    from keyserial._observation import Watching

    return Watching(QueueObserver(), None).watched_run(queue.run, key, fn, args, kwargs)


def _through_options(
    queue: KeyedSerialQueue,
    key: Hashable,
    fn: Callable[..., Awaitable[Any]],
    *args: Any,
    **kwargs: Any,
) -> Coroutine[Any, Any, Any]:
    return queue.with_options().run(key, fn, *args, **kwargs)


def without_quick_waits(queue: KeyedSerialQueue) -> None:
    """Send every registration of ``queue`` on the running loop through ``LoopShare.register``
    (no-op without a running loop: a test of the error that no loop runs)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    queue._shares.of(loop).quick_waits = False


def _through_run_without_quick_waits(
    queue: KeyedSerialQueue,
    key: Hashable,
    fn: Callable[..., Awaitable[Any]],
    *args: Any,
    **kwargs: Any,
) -> Coroutine[Any, Any, Any]:
    """``queue.run`` with every registration going through ``LoopShare.register``."""
    without_quick_waits(queue)
    return queue.run(key, fn, *args, **kwargs)


@pytest.fixture(params=["run", "observed", "with_options", "run without quick waits"])
def run_in_turn(request: pytest.FixtureRequest) -> RunInTurn:
    """``queue.run`` (the hot path), ``run`` as an observed queue calls it (watched), and
    ``queue.with_options().run`` (the path of every call with options) in turn; and ``run``
    with its written-out registration switched off, so that the same suites also cover
    ``LoopShare.register``, the code ``run`` repeats for the commonest case."""
    return {
        "run": _through_run,
        "observed": _through_a_watch,
        "with_options": _through_options,
        "run without quick waits": _through_run_without_quick_waits,
    }[request.param]


@pytest.fixture
def postgres_dsn() -> Iterator[str]:
    """A database of the test's own on the test PostgreSQL server, dropped afterwards."""
    with private_database() as dsn:
        yield dsn


#: Makes an open connection pool on the test's database (one per simulated process).
Pools = Callable[..., Awaitable["AsyncConnectionPool[Any]"]]


@pytest_asyncio.fixture
async def pools(postgres_dsn: str) -> AsyncIterator[Pools]:
    from psycopg_pool import AsyncConnectionPool, PoolTimeout

    made: list[AsyncConnectionPool[Any]] = []

    async def make(**options: Any) -> AsyncConnectionPool[Any]:
        options.setdefault("min_size", 1)
        options.setdefault("max_size", 10)
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(postgres_dsn, open=False, **options)
        # Wait for min_size connections: a request that finds none ready makes the pool grow
        # in the background, and a connection still being opened then would read as one
        # the code under test did not give back.
        with connection_errors(pool.name) as errors:
            try:
                await pool.open(wait=True)
            except PoolTimeout as exc:
                await pool.close()
                if errors:  # the pool's own word for why it could not connect
                    unavailable(cannot_connect(postgres_dsn, errors[-1]))
                raise AssertionError(f"the test pool did not open: {exc}") from exc

        made.append(pool)
        return pool

    yield make
    for pool in made:
        await pool.close()
