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
from ._tickets import EarlyTicket, Sender, keep_alive
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
        self.requeue_script = LuaScript(scripts.REQUEUE)
        self.listeners: dict[asyncio.AbstractEventLoop, GrantListener] = {}
        #: (task, encoded key) -> the turn that task holds: a call of it for that key re-enters.
        self.held: dict[tuple[Task, str], Turn] = {}
        self.background = Background("background request")
        self.policy_checked = False
        #: Fair mode: the senders of tickets still to be sent or waiting, by event loop and
        #: base name.
        self.senders: dict[tuple[asyncio.AbstractEventLoop, str], Sender] = {}
        #: Fair mode: the tickets sent and still waiting, by name (see `_grant_unawaited`).
        self.early_names: dict[str, EarlyTicket] = {}

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
            listener.unawaited = self._grant_unawaited
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
                granted = await self._wait(listener, base, ticket, asked, deadline)
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

    async def _wait(
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

    async def _confirmed(
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
            except (RedisUnavailable, TimeoutError):
                # Not answered: Redis may still have it as the holder; pass the turn on
                # once it answers. (Refused: the turn is another's or no one's already.)
                self.background.spawn(self.leave(turn.base, turn.ticket))
            turn = await self.acquire(encoded, deadline, first=True)
        self.held[(task, encoded)] = turn
        return turn, LeaseKeeper(turn, task, self.lease, self.renew)

    # -- fair mode: a ticket per call, sent when the call registers (see _tickets) ------------

    def register(self, encoded: str) -> EarlyTicket:
        """Send a ticket for ``encoded`` now, behind this event loop's earlier ones for it.

        The call that registers it takes it up with `take_early` when its turn in this
        process comes, or gives it up with `withdraw`; one of the two must follow.
        """
        loop = asyncio.get_running_loop()
        ticket = EarlyTicket(self.base(encoded))
        at = (loop, ticket.base)
        sender = self.senders.get(at)
        if sender is None:
            sender = self.senders[at] = Sender()
        if sender.add(ticket):
            self.background.spawn(self._send_all(at, sender))
        return ticket

    async def _send_all(self, at: tuple[asyncio.AbstractEventLoop, str], sender: Sender) -> None:
        try:
            await sender.send_all(self._send_early, self._requeue)
        finally:
            self._drop_if_idle(at, sender)

    def _drop_if_idle(self, at: tuple[asyncio.AbstractEventLoop, str], sender: Sender) -> None:
        idle = not (sender.queue or sender.waiting or sender.running)
        if idle and self.senders.get(at) is sender:
            del self.senders[at]

    def _done_waiting(self, ticket: EarlyTicket) -> None:
        """``ticket``'s call got its turn or gave up: it no longer waits in its process."""
        if self.early_names.get(ticket.name) is ticket:
            del self.early_names[ticket.name]
        at = (ticket.reply.get_loop(), ticket.base)
        sender = self.senders.get(at)
        if sender is not None and ticket in sender.waiting:
            sender.waiting.remove(ticket)
            self._drop_if_idle(at, sender)

    def _grant_unawaited(self, name: str) -> bool:
        """A grant came for ticket ``name`` before its call took it up. If an earlier call of
        this process still waits (see `Sender`), the process's waiting tickets are
        registered again, this one with them, and the grant is void: True then."""
        ticket = self.early_names.get(name)
        if ticket is None or ticket.taken or ticket.withdrawn:
            return False
        sender = self.senders.get((ticket.reply.get_loop(), ticket.base))
        if sender is None or not sender.waiting or sender.waiting[0] is ticket:
            return False  # its call is the next here: it takes the grant up shortly
        self._lost_early(ticket)
        return True

    async def _send_early(self, ticket: EarlyTicket) -> str:
        listener = await self.listener()
        ticket.name = listener.new_ticket()
        ticket.asked = asyncio.get_running_loop().time()
        try:
            reply = text(
                await self.script(self.acquire_script, ticket.base, self.lease_ms, ticket.name)
            )
        except BaseException:
            # Its call registers anew when it takes it up. The request may still reach a
            # stalled Redis: leaving marks the ticket gone, so that it is refused then.
            listener.forget(ticket.name)
            self.background.spawn(self.leave(ticket.base, ticket.name))
            raise
        if ticket.taken or ticket.withdrawn or reply == "-":
            return reply
        self.early_names[ticket.name] = ticket
        if reply != "" and self._grant_unawaited(ticket.name):
            reply = ""  # granted at once, but an earlier call here waits: registered again
        if reply == "":
            self._keep_alive(ticket, listener)
        return reply

    def _keep_alive(self, ticket: EarlyTicket, listener: GrantListener) -> None:
        keep_alive(
            ticket,
            self.poll,
            self._poll_early,
            listener.grant,
            self.background.spawn,
            self._lost_early,
        )

    def _lost_early(self, ticket: EarlyTicket) -> None:
        """Redis lost ``ticket``: register every waiting ticket of its key here again."""
        at = (ticket.reply.get_loop(), ticket.base)
        sender = self.senders.get(at)
        if sender is None or ticket not in sender.waiting:
            return
        sender.resend = True
        if sender.start():
            self.background.spawn(self._send_all(at, sender))

    def _named_anew(self, ticket: EarlyTicket, listener: GrantListener) -> None:
        """``ticket``'s registration failed: name it anew, to be registered by `_requeue`."""
        self.early_names.pop(ticket.name, None)
        listener.forget(ticket.name)
        ticket.name = listener.new_ticket()
        ticket.reply = asyncio.get_running_loop().create_future()
        ticket.reply.set_result("")
        self.early_names[ticket.name] = ticket

    async def _requeue(self, sender: Sender) -> None:
        """Register ``sender``'s sent tickets whose calls still wait again, together, in
        call order (see `Sender`). A ticket whose registration failed (Redis unreachable
        then) is named anew and registered with them, in its place: its call would
        otherwise register only once it is next here, behind later calls of this process."""
        listener = await self.listener()
        loop = asyncio.get_running_loop()
        tickets: list[EarlyTicket] = []
        for ticket in sender.waiting:
            if ticket.withdrawn or not ticket.reply.done():
                continue  # given up, or not sent yet (it is sent after these, in order)
            failed = ticket.reply.cancelled() or ticket.reply.exception() is not None
            if failed or ticket.reply.result() == "-":
                if ticket.taken:
                    continue  # its call registers anew itself
                self._named_anew(ticket, listener)
            tickets.append(ticket)
        if not tickets:
            return
        asked = loop.time()
        names = [ticket.name for ticket in tickets]
        await self.script(self.requeue_script, tickets[0].base, self.lease_ms, *names)
        for ticket in tickets:
            ticket.asked = max(ticket.asked, asked)
            if not (ticket.taken or ticket.withdrawn) and ticket.timer is None:
                self._keep_alive(ticket, listener)

    async def _poll_early(self, base: str, ticket: str) -> tuple[str, str]:
        status, fence = await self.script(self.poll_script, base, ticket, self.lease_ms)
        return text(status), text(fence)

    async def take_early(
        self, ticket: EarlyTicket, encoded: str, deadline: float | None, task: Task
    ) -> tuple[Turn, LeaseKeeper]:
        """`take`, for a call whose ticket `register` already sent."""
        ticket.taken = True
        ticket.stop_keeping()
        try:
            turn = await self._acquire_early(ticket, encoded, deadline)
        finally:
            self._done_waiting(ticket)
        return await self._confirmed(turn, encoded, deadline, task)

    async def _acquire_early(
        self, ticket: EarlyTicket, encoded: str, deadline: float | None
    ) -> Turn:
        loop = asyncio.get_running_loop()
        try:
            if not ticket.reply.done():  # still being sent: wait, as a request is bounded
                remaining = None if deadline is None else max(0.0, deadline - loop.time())
                await asyncio.wait([ticket.reply], timeout=remaining)
                if not ticket.reply.done():
                    raise TimeoutError(f"timed out waiting for the turn of {ticket.base!r}")
            failed = ticket.reply.cancelled() or ticket.reply.exception() is not None
        except BaseException:
            ticket.taken = False
            self.withdraw(ticket)
            raise
        if failed or ticket.reply.result() == "-":
            # It never reached Redis (unreachable then): it registers now, first in Redis's
            # queue, ahead of this process's later tickets (see Sender).
            return await self.acquire(encoded, deadline, first=True)
        listener = await self.listener()
        base, name, reply = ticket.base, ticket.name, ticket.reply.result()
        try:
            if reply:
                return Turn(base, name, int(reply), ticket.asked)
            granted = await self._wait(
                listener, base, name, ticket.asked, deadline, lambda: self._lost_early(ticket)
            )
        except BaseException:
            self.background.spawn(self.leave(base, name))
            raise
        finally:
            listener.forget(name)
        if granted is None:  # Redis lost the ticket (a restart): register again
            return await self.acquire(encoded, deadline)
        fence, asked = granted
        return Turn(base, name, fence, asked)

    def withdraw(self, ticket: EarlyTicket) -> None:
        """The call of ``ticket`` ended without taking it up: take it out of Redis's queue.

        A ticket not sent yet is never sent; one on its way leaves once it arrives; one
        already granted passes the turn on.
        """
        if ticket.taken or ticket.withdrawn:
            return
        ticket.withdrawn = True
        ticket.stop_keeping()
        self._done_waiting(ticket)
        ticket.reply.add_done_callback(lambda _: self._leave_early(ticket))

    def _leave_early(self, ticket: EarlyTicket) -> None:
        reply = ticket.reply
        if reply.cancelled() or reply.exception() is not None or reply.result() == "-":
            return  # it never reached Redis's queue
        listener = self.listeners.get(reply.get_loop())
        if listener is not None:
            listener.forget(ticket.name)
        self.background.spawn(self.leave(ticket.base, ticket.name))

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
        return await self._confirmed(turn, encoded, deadline, task)

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
