"""``KeyLock``: what every queue's ``lock()`` and ``lock_all()`` return."""

from __future__ import annotations

from types import TracebackType
from typing import Protocol


class KeyLock(Protocol):
    """What ``lock()`` and ``lock_all()`` return: an async context manager holding turns.

    Entering waits for the turn (or turns) and holds it for the block; leaving the block,
    whether it returned or raised, gives the turn on. One object is entered once at a time.
    """

    async def __aenter__(self) -> None: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None: ...
