"""Runs the Redis backend's Lua scripts on connections it keeps.

Every contended turn sends two scripts, and a hand-off is bound by the client's CPU: redis-py's
command layers (the pool's lock and bookkeeping, retries, argument encoding, the script
helper) cost more than the socket round trip itself. So the backend takes connections from
the client's pool once (same host, credentials, TLS, database, timeouts; they count against
its ``max_connections``, and closing the client closes them), keeps them per event loop, and
writes each script call on one of them as a single packed ``EVALSHA``.

A client without a connection pool of its own (``redis.asyncio.RedisCluster``) goes through
redis-py's script helper instead, which routes each call to its key's node.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from typing import Any

from redis.asyncio import BlockingConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

from .._loops import drop_closed_loops


class RedisUnavailable(ConnectionError):
    """Redis could not be reached (or answered with an error); the call did not run.

    A call never runs without holding its turn: when Redis is unreachable,
    registering or waiting fails with this error. Once Redis is back, the queue
    works again without being recreated.

    Example:
        ```pycon
        >>> issubclass(RedisUnavailable, ConnectionError)
        True

        ```
    """


def text(value: object) -> str:
    """A reply as text, from a client with or without ``decode_responses``."""
    return value.decode() if isinstance(value, bytes) else str(value)


#: Idle connections kept per event loop, and at most a quarter of the pool's
#: ``max_connections``, so that the pool still serves its other users; more go back to the
#: pool when their call ends.
MAX_IDLE_CONNECTIONS = 32
#: Script calls in flight at once per event loop: at most this many, and at most half of the
#: pool's ``max_connections`` less the grant listener's one. More calls wait for a slot
#: instead of failing with the pool's "Too many connections".
MAX_CONNECTIONS_IN_USE = 32


def _bulk(part: bytes | str | int) -> bytes:
    if isinstance(part, int):
        part = b"%d" % part
    elif isinstance(part, str):
        part = part.encode()
    return b"$%d\r\n%s\r\n" % (len(part), part)


def pack(*parts: bytes | str | int) -> bytes:
    """One command in the Redis protocol (RESP): an array of bulk strings."""
    return b"*%d\r\n" % len(parts) + b"".join(_bulk(part) for part in parts)


class LuaScript:
    """A script's text and SHA-1, ready to be sent by `ScriptRunner`."""

    __slots__ = ("sha", "source")

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()


class _IdleConnections(list[Any]):
    """One loop's idle connections, most recently used last, and its slots for calls."""

    __slots__ = ("open", "slots")

    def __init__(self, budget: int) -> None:
        super().__init__()
        self.open = True
        self.slots = asyncio.Semaphore(budget)


class ScriptRunner:
    """Sends script calls for one client, each on an idle connection of the running loop.

    A connection goes back to its loop's stack only after its reply was read in full; one
    interrupted mid-call (cancelled, timed out, broken) is closed, since its reply could
    still arrive, and given back to the pool. A failure on a connection that had sat idle
    drops every idle connection of the loop (the server restarted or closed them) and tries
    once more on a new one.

    Raises (from `call`): redis-py's ``ConnectionError`` / ``TimeoutError`` when
    Redis cannot be reached, its ``ResponseError`` when Redis refused the script.
    """

    def __init__(self, client: Any, share: float = 0.5) -> None:
        self._client = client
        self._pool: Any = getattr(client, "connection_pool", None)
        bound = getattr(self._pool, "max_connections", None) or MAX_IDLE_CONNECTIONS * 4
        #: Script calls in flight at once per loop (see MAX_CONNECTIONS_IN_USE): at most
        #: ``share`` of the pool's connections less the grant listener's one.
        self.budget = max(1, min(MAX_CONNECTIONS_IN_USE, int((bound - 1) * share)))
        if isinstance(self._pool, BlockingConnectionPool):
            # A call waiting in such a pool for a free connection would not see one kept
            # here: every connection goes back to the pool after its call.
            self._max_idle = 0
        else:
            self._max_idle = min(MAX_IDLE_CONNECTIONS, bound // 4, self.budget)
        self._idle: dict[asyncio.AbstractEventLoop, _IdleConnections] = {}
        # redis-py's own script helpers, for a client whose connections are not ours to keep.
        self._helpers: dict[str, Any] = {}

    async def call(self, script: LuaScript, key: str, *args: str | int) -> Any:
        """The reply of ``script`` run with ``KEYS = [key]`` and ``ARGV = args``."""
        if self._pool is None:
            helper = self._helpers.get(script.sha)
            if helper is None:
                helper = self._helpers[script.sha] = self._client.register_script(script.source)
            return await helper(keys=[key], args=args)
        idle = self._idle_connections()
        command = pack("EVALSHA", script.sha, 1, key, *args)
        async with idle.slots:
            return await self._send(idle, command, script, key, args)

    async def _send(
        self,
        idle: _IdleConnections,
        command: bytes,
        script: LuaScript,
        key: str,
        args: tuple[str | int, ...],
    ) -> Any:
        while True:
            reused = bool(idle)
            connection = idle.pop() if reused else await self._pool.get_connection()
            try:
                await connection.send_packed_command(command, False)
                try:
                    reply = await connection.read_response()
                except NoScriptError:
                    # The server has not seen the script yet (or restarted): EVAL caches it.
                    await connection.send_packed_command(
                        pack("EVAL", script.source, 1, key, *args), False
                    )
                    reply = await connection.read_response()
            except (RedisConnectionError, OSError):
                await self._drop(connection)
                if not reused:
                    raise
                # A connection that sat idle fails when the server restarted or dropped it,
                # before the script ran. (Had it run and its reply been lost, its ticket is
                # skipped within a lease, as after redis-py's own retries.)
                while idle:
                    await self._drop(idle.pop())
                continue
            except ResponseError:
                await self._put_back(idle, connection)  # Redis answered: the connection is in step
                raise
            except BaseException:
                await self._drop(connection)  # cancelled or timed out: its reply may still arrive
                raise
            await self._put_back(idle, connection)
            return reply

    def _idle_connections(self) -> _IdleConnections:
        loop = asyncio.get_running_loop()
        idle = self._idle.get(loop)
        if idle is None:
            drop_closed_loops(self._idle)
            idle = self._idle[loop] = _IdleConnections(self.budget)
        return idle

    async def close(self) -> None:
        """Give the running loop's connections back to the pool; those in use follow."""
        idle = self._idle.pop(asyncio.get_running_loop(), None)
        if idle is None:
            return
        idle.open = False  # connections of calls still running go back when they end
        while idle:
            await self._pool.release(idle.pop())

    async def _put_back(self, idle: _IdleConnections, connection: Any) -> None:
        if idle.open and len(idle) < self._max_idle:
            idle.append(connection)
        else:
            await self._pool.release(connection)

    async def _drop(self, connection: Any) -> None:
        """Close ``connection`` (its state is unknown) and give it back to the pool."""
        with contextlib.suppress(Exception):
            await connection.disconnect(nowait=True)
        await self._pool.release(connection)
