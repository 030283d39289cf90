"""Fair mode's turns: each call's transaction waits in the server from when the call registers.

In the default mode only the first call of a key in a process waits in the database, so a
later call of another process can take the lock before an earlier call still queued here.
With ``fair=True`` every call begins its turn's transaction when it registers: it takes a
connection and asks for its locks at once, and the server's lock queue orders the calls of
all processes by when their requests reached it.

Within a process, a call's request for a key must reach the server's queue after the
earlier calls' requests for that key: requests sent on different connections may overtake
each other on their way. So a call asks for a key's lock only once the previous call's
request for it is known to be queued (or over): seen in ``pg_locks``, looked up by a short
probe on a connection of the pool, and only while a later call waits for that answer.

The in-process queue still runs the calls of one process in order, and the turns it hands
out agree with the server's: a process's requests for a key are queued in its call order.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Hashable, Iterable, Mapping
from typing import Any

from psycopg_pool import AsyncConnectionPool

from .._background import Background
from ._errors import naming
from ._turn import PgTurn

Task = asyncio.Task[Any]

_U64 = 1 << 64
_U32 = 0xFFFFFFFF

#: How long the probe waits between two looks at ``pg_locks``.
PROBE_INTERVAL = 0.002

#: The advisory locks a backend holds or waits for, as ``pg_locks`` shows a bigint key.
WAITING_OR_HELD = (
    "SELECT classid::bigint, objid::bigint FROM pg_locks "
    "WHERE locktype = 'advisory' AND objsubid = 1 AND pid = %s"
)


def lock_parts(lock: int) -> tuple[int, int]:
    """How ``pg_locks`` shows the advisory lock of a bigint: its high and low 32 bits."""
    unsigned = lock % _U64
    return unsigned >> 32, unsigned & _U32


class EarlyTurn:
    """One call's turn in fair mode, from its registration until the call takes it up.

    Its begin task alone writes ``pid`` and ``since``; the futures of ``queued`` are set by
    that task or its probe; the call's side alone writes ``taken`` and ``withdrawn``.
    """

    __slots__ = (
        "begin",
        "keys",
        "pid",
        "probe",
        "queued",
        "since",
        "taken",
        "watched",
        "withdrawn",
    )

    def __init__(self, keys: Mapping[int, Hashable]) -> None:
        loop = asyncio.get_running_loop()
        self.keys = keys
        #: lock id -> set once this turn's request for it is in the server's queue, granted,
        #: or will never be made: a later call of this process may then ask for it.
        self.queued: dict[int, asyncio.Future[None]] = {key: loop.create_future() for key in keys}
        self.pid: int | None = None  # the backend of its connection, once it has one
        self.since = loop.time()  # no later than the server's idle timer of the turn starts
        self.begin: asyncio.Task[PgTurn] | None = None
        self.probe: Task | None = None
        self.watched = False  # a later call waits for one of its requests
        self.taken = False
        self.withdrawn = False

    def pending(self) -> list[asyncio.Future[None]]:
        return [future for future in self.queued.values() if not future.done()]

    def mark_queued(self, locks: Iterable[int]) -> None:
        for lock in locks:
            future = self.queued.get(lock)
            if future is not None and not future.done():
                future.set_result(None)

    def release_all(self) -> None:
        """Its requests are granted, failed or withdrawn: no later call waits on it now."""
        self.mark_queued(self.queued)
        if self.probe is not None:
            self.probe.cancel()


class EarlyTurns:
    """Fair mode's turns of one queue: begun at registration, taken up or withdrawn.

    It alone writes ``latest`` (the latest call to ask for each lock) and ``background``.
    ``begin`` begins a turn's transaction (``PostgresTurns.begin`` without a deadline);
    ``rollback`` ends one without keeping anything.
    """

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        lease: float,
        begin: Callable[[EarlyTurn], Awaitable[PgTurn]],
        rollback: Callable[[PgTurn], Awaitable[None]],
    ) -> None:
        self.pool = pool
        self.lease = lease
        self.begin = begin
        self.rollback = rollback
        #: lock id -> the latest call of this process to ask for it.
        self.latest: dict[int, EarlyTurn] = {}
        #: Turns given up and being rolled back, and probes, running on their own.
        self.background = Background("fair mode's background work")

    def register(self, keys: Mapping[int, Hashable]) -> EarlyTurn:
        """Begin the turn of a call registering now: its locks are asked for at once, each
        after this process's earlier requests for it are queued in the server.

        The call takes it up with `take_up` when its turn in this process comes, or gives it
        up with `withdraw`; one of the two must follow.
        """
        early = EarlyTurn(keys)
        before: list[asyncio.Future[None]] = []
        for lock in keys:
            previous = self.latest.get(lock)
            if previous is not None and not previous.queued[lock].done():
                before.append(previous.queued[lock])
                previous.watched = True
                self.probe_if_watched(previous)
            self.latest[lock] = early
        early.begin = asyncio.get_running_loop().create_task(self._begin_early(early, before))
        return early

    async def _begin_early(self, early: EarlyTurn, before: list[asyncio.Future[None]]) -> PgTurn:
        try:
            if before:
                await asyncio.wait(before)  # waits without cancelling them
            return await self.begin(early)
        finally:
            early.release_all()
            for lock in early.keys:
                if self.latest.get(lock) is early:
                    del self.latest[lock]

    def probe_if_watched(self, early: EarlyTurn) -> None:
        """Look for ``early``'s requests in ``pg_locks`` once it has a connection and a
        later call waits for them."""
        if early.watched and early.pid is not None and early.probe is None and early.pending():
            early.probe = self.background.spawn(self._probe(early))

    async def _probe(self, early: EarlyTurn) -> None:
        """Look in ``pg_locks`` until each of ``early``'s requests is seen queued (or over)."""
        wanted = {lock_parts(lock): lock for lock in early.keys}
        while early.pending():
            async with self.pool.connection() as probe:
                cursor = await probe.execute(WAITING_OR_HELD, (early.pid,))
                seen = {(int(high), int(low)) for high, low in await cursor.fetchall()}
            early.mark_queued(wanted[parts] for parts in seen if parts in wanted)
            if early.pending():
                await asyncio.sleep(PROBE_INTERVAL)

    async def withdraw(self, early: EarlyTurn) -> None:
        """The call of ``early`` ended without taking it up: stop its wait in the server, or
        roll back its transaction if it already holds the locks; return once its connection
        is back in the pool, as a call that waited itself would.

        Cancelled again meanwhile, it still waits for that (a wait left on the server would
        take the key when it comes free), and is cancelled all the same.
        """
        giving_up = self.withdraw_soon(early)
        if giving_up is None:
            return
        try:
            await asyncio.wait([giving_up])
        except asyncio.CancelledError:
            while not giving_up.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([giving_up])
            raise

    def withdraw_soon(self, early: EarlyTurn) -> Task | None:
        """`withdraw`, in the background; the task doing it, or None if nothing is to do."""
        if early.taken or early.withdrawn or early.begin is None:
            return None
        early.withdrawn = True
        return self.background.spawn(self._give_up(early.begin))

    async def _give_up(self, begin: asyncio.Task[PgTurn]) -> None:
        begin.cancel()  # a wait for the locks is cancelled in the server too
        await asyncio.wait([begin])
        if not begin.cancelled() and begin.exception() is None:
            await self.rollback(begin.result())  # it had the locks already

    async def take_up(
        self, early: EarlyTurn, deadline: float | None, loop: asyncio.AbstractEventLoop
    ) -> PgTurn:
        """The turn ``early`` began, once it holds its locks, within ``deadline``.

        Its wait in the server has no timeout of its own (the call's wait in this process
        is bounded by the deadline too, and two timers racing could cancel the statement
        twice): past the deadline, or cancelled, the call withdraws it.
        """
        begin = early.begin
        assert begin is not None
        try:
            if deadline is None:
                await asyncio.wait([begin])
            else:
                await asyncio.wait([begin], timeout=max(0.0, deadline - loop.time()))
        except BaseException:
            await self.withdraw(early)
            raise
        if not begin.done():
            await self.withdraw(early)
            raise TimeoutError(f"timed out waiting for the turn of {naming(early.keys)}")
        early.taken = True
        return begin.result()

    async def settle(self) -> None:
        """Wait for this loop's background work of fair mode (turns given up being rolled
        back), at most a lease."""
        await self.background.wait(self.lease)
