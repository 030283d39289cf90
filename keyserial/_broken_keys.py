"""A key whose hash or equality fails while registered: drop it and refuse its waiters.

A key that cannot be looked up any more cannot be handed on either. Rather than stay
registered for ever, its entry is removed by identity (never compared with another key)
and every call waiting for it gets the error that the caller who found it broken gets.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from ._errors import BrokenKeyError, safe_repr
from ._records import KeyState, MultiTurn, Wait

if TYPE_CHECKING:
    from ._share import LoopShare


def refused_for_broken_key(waiter: Wait) -> bool:
    """Whether ``waiter`` was refused because its key broke (its entry is gone already)."""
    return waiter.done() and not waiter.cancelled() and type(waiter.result()) is BrokenKeyError


def remove_broken_key(share: LoopShare, key: Hashable, error: BaseException) -> BrokenKeyError:
    """Drop ``key`` from ``share``, refuse the calls waiting for it; the error to raise.

    Example:
        ```python
        try:
            held = holders.pop(key)
        except Exception as exc:  # the key broke during the turn: never leave it stuck
            raise remove_broken_key(share, key, exc) from exc
        ```
    """
    broken = BrokenKeyError(
        f"keyserial key {safe_repr(key)} failed to hash or compare while registered "
        f"({error!r}); its turn ended and the calls waiting for it were refused"
    )
    held = _pop_identical(share.holders, key)
    if share.fences:
        share.fences.drop_identical(key)
        share.update_attention()
    if type(held) is KeyState:
        for waiter in held.waiters:
            future = waiter.future if type(waiter) is MultiTurn else waiter
            if not future.done():  # type: ignore[union-attr]
                future.set_result(broken)  # type: ignore[union-attr]
    if not share.holders and share.idle_waiters:
        share.wake_idle()
    return broken


def _pop_identical(entries: dict[Any, Any], key: object) -> Any:
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
