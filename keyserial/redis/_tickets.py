"""Fair mode's tickets: each call's place in Redis's queue, taken when the call is made.

In the default mode only the head of a process's in-process queue for a key holds a ticket
in Redis, so a later call of another process can be granted before an earlier call still
queued here. With ``fair=True`` every call sends its ticket when it registers, and Redis's
ticket queue orders the calls of all processes by when they reached it.

Two things keep that order honest:

* Within a process, tickets of one key reach Redis in call order: they are sent one at a
  time, each after the previous one's reply (concurrent requests on a pool's connections
  may overtake each other). A `Sender` per key and event loop does that.
* A ticket whose call still waits in this process's queue is kept alive: Redis skips a
  ticket whose heartbeat stopped. Its `EarlyTicket` polls it every third of a lease,
  as a waiting call does, until the call takes it up or gives up.

The in-process queue still runs the calls of one process in order, and the turns it hands
out agree with Redis's: a process's tickets are in Redis in the same order as its calls.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

#: Names a ticket and sends its registration: a fence text if granted at once, '' if
#: queued, '-' if Redis had it as withdrawn.
SendTicket = Callable[["EarlyTicket"], Awaitable[str]]
#: Registers a sender's waiting tickets again, together, in call order.
Requeue = Callable[["Sender"], Awaitable[object]]
#: Polls a queued ticket: ``(base, ticket) -> ('granted', fence) | ('waiting', '') | ('lost', '')``.
PollTicket = Callable[[str, str], Awaitable[tuple[str, str]]]


class EarlyTicket:
    """One call's ticket in fair mode, from its registration until its call takes it up.

    The sending side alone writes ``name`` and ``reply``; it writes ``asked``, and then the
    keeper moves it on with each poll that finds the ticket waiting; the keeper writes
    ``timer``; the call's side alone writes ``withdrawn`` and ``taken``.
    """

    __slots__ = ("asked", "base", "name", "reply", "taken", "timer", "withdrawn")

    def __init__(self, base: str) -> None:
        self.base = base
        self.name = ""  # set by the sender just before the registration is sent
        #: When the last request that found the ticket waiting (its registration, then
        #: each keep-alive poll) was sent: a later grant's lease starts no earlier.
        self.asked = 0.0
        #: The registration's outcome: a fence text (granted at once), '' (queued), or the
        #: error that stopped it from being sent.
        self.reply: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.timer: asyncio.TimerHandle | None = None
        self.withdrawn = False
        self.taken = False

    def stop_keeping(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class Sender:
    """Sends one key's tickets of one event loop to Redis, one at a time, in call order, and
    knows which of them still wait for their turn.

    ``waiting`` lists, in call order, the tickets whose calls have not yet got their turn
    nor given up. When Redis lost one of them (a restart, a pause past its heartbeat), or
    granted one that is not the first (an earlier call's ticket was lost), ``resend`` is
    set: before any more tickets are sent, every sent ticket still waiting is registered
    again, together and in call order (the `Requeue` script's work), so that no later call
    of the process is granted before an earlier one, and no grant holds the key idle for a
    lease waiting for a call that cannot take it up.
    """

    __slots__ = ("queue", "resend", "running", "waiting")

    def __init__(self) -> None:
        self.queue: deque[EarlyTicket] = deque()
        self.running = False
        self.resend = False
        self.waiting: list[EarlyTicket] = []

    def add(self, ticket: EarlyTicket) -> bool:
        """Queue ``ticket``; True if no sending is under way (the caller starts `send_all`)."""
        self.queue.append(ticket)
        self.waiting.append(ticket)
        return self.start()

    def start(self) -> bool:
        """True if no sending is under way: the caller starts `send_all`."""
        if self.running:
            return False
        self.running = True
        return True

    async def send_all(self, send: SendTicket, requeue: Requeue) -> None:
        """Send every queued ticket, oldest first, each after the previous one's reply; first
        register the waiting ones again if Redis lost one of them."""
        try:
            while self.queue or self.resend:
                if self.resend:
                    self.resend = False
                    with contextlib.suppress(Exception):  # the next loss asks again
                        await requeue(self)
                    continue
                ticket = self.queue[0]
                if ticket.withdrawn:  # given up before it was sent: nothing to send
                    self.queue.popleft()
                    ticket.reply.cancel()
                    continue
                try:
                    reply = await send(ticket)
                except BaseException as exc:
                    self.queue.popleft()
                    if not ticket.reply.done():
                        ticket.reply.set_exception(exc)
                    if isinstance(exc, asyncio.CancelledError):
                        self._fail_rest(exc)
                        raise
                    continue
                self.queue.popleft()
                if not ticket.reply.done():
                    ticket.reply.set_result(reply)
        finally:
            self.running = False

    def _fail_rest(self, exc: BaseException) -> None:
        while self.queue:
            ticket = self.queue.popleft()
            if not ticket.reply.done():
                ticket.reply.set_exception(exc)


def keep_alive(
    ticket: EarlyTicket,
    every: float,
    poll: PollTicket,
    granted: Callable[[str, int], None],
    spawn: Callable[[Any], object],
    lost: Callable[[EarlyTicket], None],
) -> None:
    """Poll ``ticket`` every ``every`` seconds while its call waits in this process.

    A poll refreshes the ticket's heartbeat in Redis. A grant it finds is handed to
    ``granted`` (as the grant message would be); a ticket Redis lost is handed to ``lost``
    (which registers it again, and keeps it alive again).
    """
    loop = asyncio.get_running_loop()

    async def beat() -> None:
        sent = loop.time()
        try:
            status, fence = await poll(ticket.base, ticket.name)
        except Exception:  # Redis unreachable: the call finds out when it takes the ticket
            status, fence = "unknown", ""
        if ticket.taken or ticket.withdrawn:
            return
        if status == "granted":
            granted(ticket.name, int(fence))
            return
        if status == "waiting":
            ticket.asked = max(ticket.asked, sent)
        if status in ("waiting", "unknown"):
            ticket.timer = loop.call_later(every, due)
        elif status == "lost":
            lost(ticket)

    def due() -> None:
        ticket.timer = None
        spawn(beat())

    ticket.timer = loop.call_later(every, due)
