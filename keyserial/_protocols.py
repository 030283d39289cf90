"""What the decorator and the documentation promise about any queue: the shared protocols.

Every queue of keyserial — the in-process ``KeyedSerialQueue`` and the distributed ones —
implements ``SerialQueue``; those that can hold several keys at once also implement
``MultiKeySerialQueue``. ``lock()`` and ``lock_all()`` return a ``KeyLock``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Hashable, Iterable
from typing import Any, ParamSpec, Protocol, TypeVar, runtime_checkable

from ._keylock import KeyLock
from ._options import WaitOptions

__all__ = ["KeyLock", "MultiKeySerialQueue", "SerialQueue"]

T = TypeVar("T")
P = ParamSpec("P")


class SerialQueue(Protocol):
    """What ``@serialized`` needs from a queue: run one call in a key's turn, with options.

    [KeyedSerialQueue][keyserial.KeyedSerialQueue] implements it, and so do
    the distributed backends.
    """

    def run(
        self, key: Hashable, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs
    ) -> Coroutine[Any, Any, T]:
        """Return a coroutine running ``fn(*args, **kwargs)`` in ``key``'s turn."""
        ...

    def with_options(self, *, timeout: float | None = None) -> WaitOptions:
        """The queue's ways of taking a turn, each with ``timeout`` bounding the wait."""
        ...


@runtime_checkable
class MultiKeySerialQueue(SerialQueue, Protocol):
    """A queue that can also hold several keys at once (``@serialized(keys=...)`` needs it)."""

    def lock_all(self, keys: Iterable[Hashable], timeout: float | None = None) -> KeyLock:
        """Hold the turns of all ``keys`` for the body of an ``async with`` block."""
        ...
