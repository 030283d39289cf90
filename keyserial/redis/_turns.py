"""The Redis side of a turn: acquire, wait for the grant, renew, release — each bounded.

``RedisTurns`` holds what a queue needs to talk to Redis for its turns: the client and its
script runner, the scripts, the lease, one grant listener per event loop, the turns held
now (for re-entry), and the releases still going on in the background. The queue and its
lock blocks both use it; neither reaches into the other.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import redis.asyncio as redis_asyncio
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .._background import Background
from .._cancels import cancel_count, withdraw_cancel
from .._loops import drop_closed_loops
from . import _scripts as scripts
from ._grants import GrantListener, finished_within, time_up
from ._lease import LeaseKeeper, Turn
from ._names import base_name
from ._transport import LuaScript, RedisUnavailable, ScriptRunner, text

Task = asyncio.Task[Any]

logger = logging.getLogger("keyserial")


class RedisTurns:
    """Turns of one queue's keys in Redis (see the module docstring)."""

    def __init__(
        self,
        client: redis_asyncio.Redis | redis_asyncio.RedisCluster,
        namespace: str,
        lease: float,
    ) -> None:
        self.client = client
        self.namespace = namespace  # encoded
        self.lease = lease
        self.lease_ms = max(1, int(lease * 1000))
        self.poll = lease / 3
        # How long a caller waits for its release before it goes on in the background.
        self.release_wait = min(lease / 3, max(0.1, lease / 10))
        self.runner = ScriptRunner(client)
        self.acquire_script = LuaScript(scripts.ACQUIRE)
        self.poll_script = LuaScript(scripts.POLL)
        self.release_script = LuaScript(scripts.RELEASE)
        self.renew_script = LuaScript(scripts.RENEW)
        self.listeners: dict[asyncio.AbstractEventLoop, GrantListener] = {}
        #: (task, encoded key) -> the turn that task holds: a call of it for that key re-enters.
        self.held: dict[tuple[Task, str], Turn] = {}
        self.background = Background("background request")
        self.policy_checked = False

    def base(self, encoded: str) -> str:
        """The name the scripts derive the key's Redis keys from; its braces are a hash tag."""
        return base_name(self.namespace, encoded)

    async def script(
        self, script: LuaScript, base: str, *args: str | int, deadline: float | None = None
    ) -> Any:
        """Run ``script``; bounded by ``deadline`` (TimeoutError) and by a lease.

        A Redis that does not answer within a lease (stalled, paused, cut off) raises
        RedisUnavailable: no call waits on it for ever, whether or not it has a timeout.
        """
        loop = asyncio.get_running_loop()
        limit = loop.time() + self.lease
        times_out = deadline is not None and deadline <= limit
        task: Task = asyncio.current_task()  # type: ignore[assignment]
        before = cancel_count(task)
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            task.cancel()

        timer = loop.call_at(deadline if times_out else limit, expire)  # type: ignore[arg-type]
        try:
            return await self.runner.call(script, base, *args)
        except asyncio.CancelledError:
            if not expired or not withdraw_cancel(task, before):
                raise
            if times_out:
                raise TimeoutError(f"timed out waiting for the turn of {base!r}") from None
            raise RedisUnavailable(
                f"Redis did not answer within the lease ({self.lease} s)"
            ) from None
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise RedisUnavailable(f"Redis is unreachable: {exc}") from exc
        except RedisError as exc:
            raise RedisUnavailable(f"Redis refused the request: {exc}") from exc
        finally:
            timer.cancel()

    async def listener(self) -> GrantListener:
        loop = asyncio.get_running_loop()
        listener = self.listeners.get(loop)
        if listener is None or listener.task.done():
            drop_closed_loops(self.listeners)
            listener = self.listeners[loop] = GrantListener(self.client)
        if not listener.ready.done():
            # Bounded like any Redis request: a listener that cannot subscribe gives way to
            # polling, and the request itself then reports what is wrong.
            timer = loop.call_later(self.lease, time_up, listener.ready)
            try:
                await asyncio.shield(listener.ready)
            finally:
                timer.cancel()
            if not self.policy_checked:
                self.policy_checked = True
                await self._check_eviction_policy()
        return listener

    async def _check_eviction_policy(self) -> None:
        """Warn once if Redis may evict keys: an evicted holder lets two callers in at once."""
        try:
            client: Any = self.client  # redis-py's reply types are partly unknown
            reply: Any = await asyncio.wait_for(
                client.config_get("maxmemory-policy"), timeout=self.lease
            )
        except Exception:  # CONFIG not allowed (ACL, managed Redis) or not answered: unknown
            logger.debug("keyserial: could not read maxmemory-policy", exc_info=True)
            return
        values: list[Any] = []
        if isinstance(reply, dict):
            policies: dict[Any, Any] = reply  # pyright: ignore[reportUnknownVariableType]
            values = list(policies.values())
        policy = text(values[0]) if values else "noeviction"
        if policy != "noeviction":
            logger.warning(
                "keyserial: Redis's maxmemory-policy is %r; it must be 'noeviction': an evicted "
                "turn lets two callers hold one key at once",
                policy,
            )

    async def acquire(self, encoded: str, deadline: float | None, first: bool = False) -> Turn:
        """The turn of ``encoded``, once Redis grants it; ``first``: queue ahead of the others.

        Its ``asked`` is when the last request that found the ticket still waiting was
        sent: Redis granted the turn, and started its lease, no earlier.
        """
        listener = await self.listener()
        base = self.base(encoded)
        flag = "1" if first else "0"
        while True:  # once more each time Redis lost the ticket (a restart)
            ticket = listener.new_ticket()
            asked = asyncio.get_running_loop().time()  # the lease starts no earlier than this
            try:
                reply = text(
                    await self.script(
                        self.acquire_script, base, self.lease_ms, ticket, flag, deadline=deadline
                    )
                )
                if reply and reply != "-":
                    return Turn(base, ticket, int(reply), asked)
                granted = await self.wait_for_grant(listener, base, ticket, asked, deadline)
            except BaseException:
                # Leave the queue, passing the turn on if it came meanwhile: in the
                # background, so that a stalled Redis does not hold this caller too. If it
                # cannot be sent, the ticket's heartbeat stops and Redis skips it in time.
                self.background.spawn(self.leave(base, ticket))
                raise
            finally:
                listener.forget(ticket)
            if granted is not None:
                fence, asked = granted
                return Turn(base, ticket, fence, asked)

    async def wait_for_grant(
        self,
        listener: GrantListener,
        base: str,
        ticket: str,
        asked: float,
        deadline: float | None,
        lost: Callable[[], object] | None = None,
    ) -> tuple[int, float] | None:
        """The fence once ``ticket`` is granted, and the send time of the last request that
        found it waiting (``asked`` at first); None if Redis forgot the ticket, unless
        ``lost`` is given: that is called then (to register it again) and the wait goes on,
        until Redis is found to have forgotten it twice in a row."""
        loop = asyncio.get_running_loop()
        lost_again = False
        while True:
            wait = self.poll
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - loop.time()))
            granted = listener.expect(ticket)
            # A timer rather than asyncio.wait(): every contended turn waits here once, and
            # the timer is the cheaper of the two.
            timer = loop.call_later(wait, time_up, granted)
            try:
                fence = await granted
            finally:
                timer.cancel()
            if fence is not None:
                return fence, asked
            if deadline is not None and loop.time() >= deadline:
                raise TimeoutError(f"timed out waiting for the turn of {base!r}")
            polled = loop.time()
            status, fence = await self.script(
                self.poll_script, base, ticket, self.lease_ms, deadline=deadline
            )
            status = text(status)
            if status == "granted":
                return int(fence), asked
            if status == "lost":
                if lost is None or lost_again:
                    return None  # not registered again in time either: register anew
                lost()
                lost_again = True
                continue
            lost_again = False
            asked = polled  # still waiting then: a later grant's lease starts after it

    async def confirmed(
        self, turn: Turn, encoded: str, deadline: float | None, task: Task
    ) -> tuple[Turn, LeaseKeeper]:
        """``turn``, once its lease is known to hold, with the keeper that renews it.

        A grant may reach a process that was paused (or its loop blocked) after Redis made
        it: its lease, measured from ``turn.asked``, may be over, and the next caller may
        hold the key. So a turn with less than a third of its lease left by the local
        measure is renewed first; one whose lease ran out is given up, and the call waits
        again at the head of Redis's queue, without an error. Its function never starts on
        a lease that may have run out.
        """
        loop = asyncio.get_running_loop()
        while turn.asked + self.lease - loop.time() < self.lease / 3:
            asked = loop.time()
            try:
                if await self.renew(turn, asked + self.lease):
                    turn.asked = asked
                    break
            except BaseException as exc:
                # Not answered, or the caller gave up meanwhile: Redis may still have it as
                # the holder; pass the turn on once it answers. (Refused: the turn is
                # another's or no one's already.)
                self.background.spawn(self.leave(turn.base, turn.ticket))
                if not isinstance(exc, (RedisUnavailable, TimeoutError)):
                    raise
            turn = await self.acquire(encoded, deadline, first=True)
        self.held[(task, encoded)] = turn
        return turn, LeaseKeeper(turn, task, self.lease, self.renew)

    async def leave(self, base: str, ticket: str) -> bool:
        """Take ``ticket`` out of the key's queue, passing the turn on; True if it held it."""
        return bool(await self.script(self.release_script, base, ticket, self.lease_ms))

    async def renew(self, turn: Turn, until: float) -> bool:
        """Extend ``turn``'s lease, bounded by when it expires; False if it was lost."""
        holder = f"{turn.ticket}:{turn.fence}"
        renewed = await self.script(
            self.renew_script, turn.base, holder, self.lease_ms, deadline=until
        )
        return bool(renewed)

    async def take(
        self, encoded: str, deadline: float | None, task: Task
    ) -> tuple[Turn, LeaseKeeper]:
        """Acquire ``encoded``'s turn for ``task`` and keep its lease renewed."""
        turn = await self.acquire(encoded, deadline)
        return await self.confirmed(turn, encoded, deadline, task)

    async def give_back(self, encoded: str, turn: Turn, keeper: LeaseKeeper, task: Task) -> bool:
        """End ``task``'s turn of ``encoded``; True if its lease was lost while it ran.

        The caller waits for the release only briefly: against a Redis that does not
        answer, the release goes on in the background (bounded by a lease, after which the
        turn has expired anyway) and the lease keeper's own account decides whether the
        lease held.
        """
        keeper.stop()
        del self.held[(task, encoded)]
        lost = turn.lost or keeper.expired()
        release = self.background.spawn(self.leave(turn.base, turn.ticket))
        if await finished_within(release, self.release_wait):
            if release.cancelled() or release.exception() is not None:
                logger.warning(
                    "keyserial: could not release key %r; its lease will expire", encoded
                )
            elif not release.result():
                lost = True  # Redis no longer had it as the holder: the lease ran out
            else:
                # Redis still had it as the holder, so the lease never ran out, whatever
                # the keeper's cautious measure says (a turn granted after a long wait).
                lost = turn.lost
        return lost

    async def close(self) -> None:
        """Let background releases of this loop finish (up to a lease), stop listening."""
        await self.background.wait(self.lease)
        listener = self.listeners.pop(asyncio.get_running_loop(), None)
        if listener is not None:
            await listener.close(within=self.lease)
        await self.runner.close()
