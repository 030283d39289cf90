"""Wait options for every way of taking a turn: ``queue.with_options(timeout=...)``.

PEP 612 allows no keyword-only parameter between ``*args: P.args`` and
``**kwargs: P.kwargs``, so ``run(key, fn, *args, timeout=5, **kwargs)`` could not be typed
without taking ``timeout`` from the function's own keywords. A queue's ``with_options``
returns a view instead, as the OpenAI Python SDK's ``client.with_options(timeout=...)``
does: the same methods, each with the options applied, and every keyword argument still
going to the function.

A view holds the queue's own ways of taking a turn with options (bound methods the queue
hands it), so it works the same for the in-process queue and the distributed ones.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Iterable
from typing import Any, ParamSpec, Protocol, TypeVar, cast

from ._errors import called, check_function, check_timeout, warn_deprecated_call
from ._keylock import KeyLock

T = TypeVar("T")
P = ParamSpec("P")

CallWith = Callable[
    [
        Hashable,
        Callable[..., Awaitable[Any]],
        tuple[Any, ...],
        dict[str, Any],
        "float | None",
        "Hashable | None",
    ],
    Coroutine[Any, Any, Any],
]
"""A queue's ``run`` with the arguments as a tuple and a dict, the wait's bound and group."""

SubmitWith = Callable[
    [
        Hashable,
        Callable[..., Awaitable[Any]],
        tuple[Any, ...],
        dict[str, Any],
        "float | None",
        "Hashable | None",
    ],
    "asyncio.Task[Any]",
]
"""A queue's ``submit``, with its arguments as a tuple and a dict, the wait's bound and group."""

LockWith = Callable[[Hashable, "float | None", "Hashable | None"], KeyLock]
"""A queue's ``lock``, with the wait's bound and group."""

LockAllWith = Callable[[Iterable[Hashable], "float | None"], KeyLock]
"""A queue's ``lock_all``, with the wait's bound."""


class WaitOptions:
    """A queue's ways of taking one key's turn, each with the same options.

    Made by ``queue.with_options(timeout=...)``. ``timeout`` bounds only the wait for the
    turn: on expiry the built-in ``TimeoutError`` is raised, the function never starts,
    and the queue is left as it was. ``timeout=0`` is a try: it never waits, so a held key
    raises ``TimeoutError`` at once (never ``DeadlockError``). ``None`` waits as long as it
    takes. A started call is never interrupted. ``group`` (the in-process queue only) makes
    the calls coalescing: see ``KeyedSerialQueue.with_options``.

    Example:
        ```pycon
        >>> import asyncio
        >>> from keyserial import KeyedSerialQueue
        >>> async def double(x: int) -> int:
        ...     return 2 * x
        >>> asyncio.run(KeyedSerialQueue().with_options(timeout=5).run("k", double, 21))
        42

        ```
    """

    __slots__ = ("_call", "_lock", "_owner", "_submit", "group", "timeout")

    def __init__(
        self,
        owner: object,
        *,
        call: CallWith,
        submit: SubmitWith,
        lock: LockWith,
        timeout: float | None,
        group: Hashable | None = None,
    ) -> None:
        check_timeout(timeout)
        if group is not None:
            try:
                hash(group)
            except TypeError as exc:
                raise TypeError(f"group must be hashable, got {group!r}") from exc
        self._owner = owner
        self._call = call
        self._submit = submit
        self._lock = lock
        self.timeout = timeout
        """Seconds the turn is waited for at most, or ``None``."""
        self.group = group
        """The coalescing group of the calls, or ``None``."""

    def run(
        self, key: Hashable, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs
    ) -> Coroutine[Any, Any, T]:
        """The queue's ``run``, with this view's options.

        Raises:
            TimeoutError: the turn did not come within ``timeout`` seconds.
            Superseded: a newer call of the same ``group`` replaced this one.
        """
        check_function(fn, "run")
        return self._call(key, fn, args, kwargs, self.timeout, self.group)

    def submit(
        self, key: Hashable, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs
    ) -> asyncio.Task[T]:
        """The queue's ``submit``, with this view's options for the wait of the new task.

        Raises:
            TimeoutError: from the task, when its turn did not come within ``timeout``
                seconds; from ``submit`` itself, when ``timeout=0`` finds the key held.
            Superseded: from the task, when a newer call of the same ``group`` replaced it.
        """
        check_function(fn, "submit")
        task = self._submit(key, fn, args, kwargs, self.timeout, self.group)
        return cast("asyncio.Task[T]", task)

    def lock(self, key: Hashable) -> KeyLock:
        """The queue's ``lock``, with this view's options.

        Raises:
            TimeoutError: on entering, the turn did not come within ``timeout`` seconds.
            Superseded: on entering, a newer block of the same ``group`` replaced this one.
        """
        return self._lock(key, self.timeout, self.group)

    def __repr__(self) -> str:
        group = "" if self.group is None else f" group={self.group!r}"
        return f"<{type(self).__name__} timeout={self.timeout!r}{group} of {self._owner!r}>"


class MultiKeyWaitOptions(WaitOptions):
    """``WaitOptions`` of a queue that can also hold several keys at once."""

    __slots__ = ("_lock_all",)

    def __init__(
        self,
        owner: object,
        *,
        call: CallWith,
        submit: SubmitWith,
        lock: LockWith,
        lock_all: LockAllWith,
        timeout: float | None,
        group: Hashable | None = None,
    ) -> None:
        super().__init__(owner, call=call, submit=submit, lock=lock, timeout=timeout, group=group)
        self._lock_all = lock_all

    def run_all(
        self,
        keys: Iterable[Hashable],
        fn: Callable[P, Awaitable[T]],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> Coroutine[Any, Any, T]:
        """The queue's ``run_all``, with this view's bound on the wait for all the turns.

        Raises:
            TimeoutError: the turns did not all come within ``timeout`` seconds.
            ValueError: the view has a ``group``: several keys do not coalesce.
        """
        check_function(fn, "run_all")
        return _run_holding(self.lock_all(keys), fn, args, kwargs)

    def lock_all(self, keys: Iterable[Hashable]) -> KeyLock:
        """The queue's ``lock_all``, with this view's bound on the wait for all the turns.

        Raises:
            TimeoutError: on entering, the turns did not all come within ``timeout`` seconds.
            ValueError: the view has a ``group``: several keys do not coalesce.
        """
        if self.group is not None:
            raise ValueError("calls on several keys do not coalesce: use a view without group=")
        return self._lock_all(keys, self.timeout)


async def _run_holding(
    lock: KeyLock, fn: Callable[..., Awaitable[T]], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> T:
    async with lock:
        return await called(fn, args, kwargs)


class _TakesOptions(Protocol):
    def _call(
        self,
        key: Hashable,
        fn: Callable[..., Awaitable[Any]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None,
        group: Hashable | None,
    ) -> Coroutine[Any, Any, Any]: ...


def deprecated_call(
    self: _TakesOptions,
    key: Hashable,
    fn: Callable[..., Awaitable[T]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout: float | None = None,
    group: Hashable | None = None,
) -> Coroutine[Any, Any, T]:
    """Deprecated: ``queue.with_options(timeout=..., group=...).run(key, fn, *args, **kwargs)``.

    Every queue's ``call`` is this function.

    Warns:
        DeprecationWarning: always; the call then runs as ``with_options(...).run``.
    """
    warn_deprecated_call(type(self).__name__)
    check_function(fn, "call")
    return self._call(key, fn, args, kwargs, timeout, group)  # pyright: ignore[reportPrivateUsage]
