"""The observer protocol: hooks a queue calls as calls register, start and finish.

A leaf module: the queue types name it, and ``_observe`` (the observed queue) calls it.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Literal

Outcome = Literal["completed", "failed", "cancelled", "timed_out", "rejected", "superseded"]


class QueueObserver:
    """Hooks a queue calls as calls register, start and finish; subclass and override.

    Every hook runs synchronously in the event loop, so keep it short. An
    exception raised by a hook is logged through the ``keyserial`` logger and
    otherwise ignored: a failing observer never breaks the queue.

    ``function`` is the qualified name of the called function. ``outcome`` is
    one of ``"completed"``, ``"failed"``, ``"cancelled"``, ``"timed_out"``,
    ``"rejected"`` (``max_pending`` or a closed queue) or ``"superseded"``;
    ``ran`` is ``None`` for a call that never started.

    Example:
        ```pycon
        >>> from keyserial import KeyedSerialQueue, QueueObserver
        >>> class PrintWaits(QueueObserver):
        ...     def on_start(self, key, function, waited):
        ...         print(f"{function} waited {waited:.0f} s for {key!r}")
        >>> queue = KeyedSerialQueue(observer=PrintWaits())

        ```
    """

    def on_register(self, key: Hashable, function: str) -> None:
        """A call registered for ``key``."""

    def on_start(self, key: Hashable, function: str, waited: float) -> None:
        """A call started its turn after waiting ``waited`` seconds."""

    def on_finish(
        self, key: Hashable, function: str, waited: float, ran: float | None, outcome: Outcome
    ) -> None:
        """A call ended: it waited ``waited`` s, ran ``ran`` s (None if it never started)."""
