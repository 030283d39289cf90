"""Fair mode's tickets in Redis: one per call, sent when the call registers (see _tickets).

``FairTickets`` owns what fair mode adds to a queue's turns: the senders of each key's tickets
per event loop, and the tickets sent and still waiting, by name. It sends, keeps alive,
registers again and withdraws tickets through the queue's `RedisTurns`, whose requests and
waits it shares with the default mode.
"""

from __future__ import annotations

import asyncio
from typing import Any

from . import _scripts as scripts
from ._grants import GrantListener
from ._lease import LeaseKeeper, Turn
from ._tickets import EarlyTicket, Sender, keep_alive
from ._transport import LuaScript, text
from ._turns import RedisTurns

Task = asyncio.Task[Any]


class FairTickets:
    """The tickets of one fair-mode queue (see the module docstring)."""

    def __init__(self, turns: RedisTurns) -> None:
        self.turns = turns
        self.requeue_script = LuaScript(scripts.REQUEUE)
        #: The senders of tickets still to be sent or waiting, by event loop and base name.
        self.senders: dict[tuple[asyncio.AbstractEventLoop, str], Sender] = {}
        #: The tickets sent and still waiting, by name (see `_grant_unawaited`).
        self.early_names: dict[str, EarlyTicket] = {}

    async def _listener(self) -> GrantListener:
        """The running loop's grant listener, which asks this object about early grants."""
        listener = await self.turns.listener()
        listener.unawaited = self._grant_unawaited
        return listener

    def register(self, encoded: str) -> EarlyTicket:
        """Send a ticket for ``encoded`` now, behind this event loop's earlier ones for it.

        The call that registers it takes it up with `take_early` when its turn in this
        process comes, or gives it up with `withdraw`; one of the two must follow.
        """
        loop = asyncio.get_running_loop()
        ticket = EarlyTicket(self.turns.base(encoded))
        at = (loop, ticket.base)
        sender = self.senders.get(at)
        if sender is None:
            sender = self.senders[at] = Sender()
        if sender.add(ticket):
            self.turns.background.spawn(self._send_all(at, sender))
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
        listener = await self._listener()
        ticket.name = listener.new_ticket()
        ticket.asked = asyncio.get_running_loop().time()
        try:
            reply = text(
                await self.turns.script(
                    self.turns.acquire_script, ticket.base, self.turns.lease_ms, ticket.name
                )
            )
        except BaseException:
            # Its call registers anew when it takes it up. The request may still reach a
            # stalled Redis: leaving marks the ticket gone, so that it is refused then.
            listener.forget(ticket.name)
            self.turns.background.spawn(self.turns.leave(ticket.base, ticket.name))
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
            self.turns.poll,
            self._poll_early,
            listener.grant,
            self.turns.background.spawn,
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
            self.turns.background.spawn(self._send_all(at, sender))

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
        listener = await self._listener()
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
        if sender.waiting and sender.waiting[0] is not tickets[0]:
            # The earliest call here is not among them (it registers on its own, or is sent
            # after them): none of them may keep a turn it holds, or its call, waiting here
            # behind that earlier one, would hold the key while that one waits in Redis.
            names.insert(0, scripts.EARLIER_ELSEWHERE)
        since, holding = await self.turns.script(
            self.requeue_script, tickets[0].base, self.turns.lease_ms, *names
        )
        since_us, kept = int(text(since)), text(holding)
        for ticket in tickets:
            if ticket.name != kept:
                # Registered again: a grant of its earlier registration, still on its way
                # (a process stopped past its lease reads it when it resumes), is void, and
                # its lease, measured from before this request, starts after it. The ticket
                # that keeps its turn keeps its grant and the measure of its lease.
                listener.registered_again(ticket.name, since_us)
                ticket.asked = max(ticket.asked, asked)
            if not (ticket.taken or ticket.withdrawn) and ticket.timer is None:
                self._keep_alive(ticket, listener)

    async def _poll_early(self, base: str, ticket: str) -> tuple[str, str]:
        status, fence = await self.turns.script(
            self.turns.poll_script, base, ticket, self.turns.lease_ms
        )
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
        return await self.turns.confirmed(turn, encoded, deadline, task)

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
            return await self.turns.acquire(encoded, deadline, first=True)
        listener = await self._listener()
        base, name, reply = ticket.base, ticket.name, ticket.reply.result()
        try:
            if reply:
                return Turn(base, name, int(reply), ticket.asked)
            granted = await self.turns.wait_for_grant(
                listener, base, name, ticket.asked, deadline, lambda: self._lost_early(ticket)
            )
        except BaseException:
            self.turns.background.spawn(self.turns.leave(base, name))
            raise
        finally:
            listener.forget(name)
        if granted is None:  # Redis lost the ticket (a restart): register again
            return await self.turns.acquire(encoded, deadline)
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
        listener = self.turns.listeners.get(reply.get_loop())
        if listener is not None:
            listener.forget(ticket.name)
        self.turns.background.spawn(self.turns.leave(ticket.base, ticket.name))
