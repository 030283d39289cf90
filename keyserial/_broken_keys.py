"""A key whose hash or equality fails while registered: drop it and refuse its waiters.

A key that cannot be looked up any more cannot be handed on either. Rather than stay
registered for ever, its entry is removed by identity (never compared with another key)
and every call waiting for it gets the error that the caller who found it broken gets.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from ._errors import BrokenKeyError, safe_repr
from ._records import KeyState, MultiTurn, Wait


def refused_for_broken_key(waiter: Wait) -> bool:
    """Whether ``waiter`` was refused because its key broke (its entry is gone already)."""
    return waiter.done() and not waiter.cancelled() and type(waiter.result()) is BrokenKeyError


def broken_key_error(key: Hashable, error: BaseException) -> BrokenKeyError:
    """The error for ``key``, whose hash or equality failed with ``error`` while registered."""
    return BrokenKeyError(
        f"keyserial key {safe_repr(key)} failed to hash or compare while registered "
        f"({error!r}); its turn ended and the calls waiting for it were refused"
    )


def refuse_waiters(held: Any, broken: BrokenKeyError) -> None:
    """End the wait of every call waiting in ``held`` (a broken key's entry) with ``broken``."""
    if type(held) is KeyState:
        for waiter in held.waiters:
            future = waiter.future if type(waiter) is MultiTurn else waiter
            if not future.done():  # type: ignore[union-attr]
                future.set_result(broken)  # type: ignore[union-attr]


def pop_identical(entries: dict[Any, Any], key: object) -> Any:
    """Remove the entry whose key *is* ``key`` without comparing it to any other key.

    ``popitem`` takes the newest entry without a lookup; the entries taken before ours
    are put back (they compared fine with each other when they were first inserted).
    """
    if not any(present is key for present in entries):
        return None
    taken: list[tuple[Any, Any]] = []
    try:
        while True:
            present, value = entries.popitem()
            if present is key:
                return value
            taken.append((present, value))
    finally:
        for present, value in reversed(taken):
            entries[present] = value
