"""Exceptions raised by keyserial queues, and the helpers that word the common ones."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Coroutine, Hashable, Mapping, Sequence
from inspect import isawaitable
from typing import Any, TypeVar

T = TypeVar("T")


class QueueClosed(RuntimeError):
    """Raised when work is registered on a queue that has been closed with ``aclose()``.

    Work that was registered before the queue closed still runs; only new
    ``run``, ``submit`` and ``lock`` calls are refused.

    Example:
        ```pycon
        >>> import asyncio
        >>> from keyserial import KeyedSerialQueue, QueueClosed
        >>> async def main() -> str:
        ...     queue = KeyedSerialQueue()
        ...     await queue.aclose()
        ...     try:
        ...         async with queue.lock("k"):
        ...             return "ran"
        ...     except QueueClosed:
        ...         return "refused"
        >>> asyncio.run(main())
        'refused'

        ```
    """


class QueueFull(RuntimeError):
    """Raised when a call would push a key's pending count above ``max_pending``.

    The refused call never starts and leaves no trace in the queue.
    ``key`` and ``max_pending`` name what was full.

    Example:
        ```pycon
        >>> QueueFull("seg-1", 10).key
        'seg-1'

        ```
    """

    def __init__(self, key: Hashable, max_pending: int) -> None:
        super().__init__(f"key {key!r} already has {max_pending} pending calls (max_pending)")
        self.key = key
        self.max_pending = max_pending


class DeadlockError(RuntimeError):
    """Raised in the task whose wait for a key would close a cycle of tasks waiting on each other.

    Instead of hanging, the call that would complete the cycle fails at once
    (nothing of it stays registered); the other tasks in the cycle proceed.
    ``keys`` and ``tasks`` name the cycle, in order.

    Example:
        ```pycon
        >>> DeadlockError("deadlock: ...", keys=["a", "b"], tasks=[]).keys
        ['a', 'b']

        ```
    """

    def __init__(self, message: str, *, keys: Sequence[Hashable], tasks: Sequence[object]) -> None:
        super().__init__(message)
        self.keys = list(keys)
        self.tasks = list(tasks)


class Superseded(Exception):
    """Raised to a waiting call that a newer call of its coalescing group replaced.

    The superseded call never started. ``key`` names the key it waited for.
    See ``@serialized(coalesce=True)`` and the ``group`` argument of
    [KeyedSerialQueue.with_options][keyserial.KeyedSerialQueue.with_options].

    Example:
        ```pycon
        >>> Superseded("seg-1").key
        'seg-1'

        ```
    """

    def __init__(self, key: Hashable) -> None:
        super().__init__(f"superseded by a newer call for key {key!r} before it started")
        self.key = key


class LeaseLost(RuntimeError):
    """A distributed turn's lease was lost while its call ran.

    The holder was paused (or cut off from Redis) past its lease, or Redis lost
    its data, so the key may already have been granted to another caller with
    a higher fence. A resource that checks fences refuses this call's late
    writes; this exception tells the call itself. ``key`` is the encoded key and
    ``fence`` the fence of the lost turn.

    Example:
        ```pycon
        >>> LeaseLost("kc2VnLTE", 7).fence
        7

        ```
    """

    def __init__(self, key: str, fence: int) -> None:
        super().__init__(f"the lease of key {key!r} (fence {fence}) was lost during the call")
        self.key = key
        self.fence = fence


class BrokenKeyError(TypeError):
    """A registered key whose hash or equality failed; the calls waiting for it are refused."""


def closed_error(key: Hashable) -> QueueClosed:
    return QueueClosed(f"queue is closed; cannot register key {safe_repr(key)}")


def safe_repr(key: object) -> str:
    """``repr(key)``, or a description of it when its ``__repr__`` fails too."""
    try:
        return repr(key)
    except Exception:
        return f"<{type(key).__name__} object>"


def key_error(key: object, error: Exception) -> TypeError:
    """The error for a key that cannot be hashed or compared, for every method that takes one."""
    if isinstance(error, TypeError) and "unhashable" in str(error):
        name = type(key).__name__
        return TypeError(f"keyserial keys must be hashable, got {name}: {safe_repr(key)}")
    return TypeError(
        f"keyserial keys must be hashable and comparable; {safe_repr(key)} raised {error!r}"
    )


def check_function(fn: object, method: str) -> None:
    """Refuse, before any turn is taken, an ``fn`` that cannot be called.

    A coroutine object (``queue.run(key, save(1))``) is closed here, so that it leaves no
    "never awaited" warning behind.

    Raises:
        TypeError: ``fn`` is not callable; the message says what to pass instead.
    """
    if callable(fn):
        return
    if isinstance(fn, Coroutine):
        coroutine: Coroutine[Any, Any, Any] = fn  # pyright: ignore[reportUnknownVariableType]
        name = getattr(coroutine, "__qualname__", type(coroutine).__name__)
        coroutine.close()
        raise TypeError(
            f"{method}() takes the function and its arguments, not a coroutine: write "
            f"{method}(key, {name}, arg, ...) instead of {method}(key, {name}(arg, ...))"
        )
    raise TypeError(f"{method}() needs an async function to call, got {safe_repr(fn)}")


def not_awaitable(fn: object, result: object) -> TypeError:
    """The error for a call whose ``fn`` returned something that cannot be awaited."""
    name = getattr(fn, "__qualname__", None) or safe_repr(fn)
    return TypeError(
        f"{name} returned {type(result).__name__} {safe_repr(result)}, which cannot be awaited: "
        "pass an async def function, or hold the turn around synchronous code with "
        "'async with queue.lock(key): ...'"
    )


#: The options of ``with_options``, which ``run`` and ``submit`` pass on to the function.
_WAIT_OPTIONS = ("timeout", "group")


def call_error(fn: object, error: TypeError, kwargs: dict[str, Any]) -> TypeError:
    """``error``, raised by calling ``fn`` with ``kwargs``; if a keyword it refused is a wait
    option, a new error saying where the option goes."""
    refused = [
        name for name in _WAIT_OPTIONS if name in kwargs and f"argument '{name}'" in str(error)
    ]
    if not refused:
        return error
    name = getattr(fn, "__qualname__", None) or safe_repr(fn)
    option = refused[0]
    return TypeError(
        f"{error}: run(), submit() and run_all() pass their keyword arguments to {name}; "
        f"to set the call's {option}, use queue.with_options({option}=...).run(key, fn, ...)"
    )


def called(fn: Callable[..., T], args: Sequence[Any], kwargs: Mapping[str, Any]) -> T:
    """``fn(*args, **kwargs)``, once it is known to be awaitable.

    Raises:
        TypeError: what calling ``fn`` raised (naming a wait option it refused, see
            ``call_error``), or its result cannot be awaited (see ``not_awaitable``).
    """
    try:
        result = fn(*args, **kwargs)
    except TypeError as exc:
        error = call_error(fn, exc, dict(kwargs)) if kwargs else exc
        if error is exc:
            raise
        raise error from exc
    return awaitable_result(fn, result)


def awaitable_result(fn: object, result: T) -> T:
    """``result``, once it is known to be awaitable.

    Raises:
        TypeError: ``result`` cannot be awaited (see ``not_awaitable``).
    """
    if not isawaitable(result):
        raise not_awaitable(fn, result)
    return result


def check_timeout(timeout: float | None) -> None:
    """Refuse a bound on a wait that is not ``None`` or a number >= 0, before anything is
    registered.

    Raises:
        ValueError: ``timeout`` is negative, NaN or not a number.
    """
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise ValueError(f"timeout must be None or a number of seconds >= 0, got {timeout!r}")


def warn_deprecated_call(queue: str) -> None:
    """Warn that ``queue.call(...)`` is deprecated, naming its replacement."""
    warnings.warn(
        f"{queue}.call(key, fn, args, kwargs, timeout, group) is deprecated: write "
        f"queue.with_options(timeout=..., group=...).run(key, fn, *args, **kwargs)",
        DeprecationWarning,
        stacklevel=3,
    )
