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
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

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
