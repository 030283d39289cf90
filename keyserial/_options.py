"""Wait options for every way of taking a turn: ``queue.with_options(timeout=...)``.

PEP 612 allows no keyword-only parameter between ``*args: P.args`` and
``**kwargs: P.kwargs``, so ``run(key, fn, *args, timeout=5, **kwargs)`` could not be typed
without taking ``timeout`` from the function's own keywords. A queue's ``with_options``
returns a view instead, as the OpenAI Python SDK's ``client.with_options(timeout=...)``
does: the same methods, each with the options applied, and every keyword argument still
going to the function.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Iterable
from typing import Any, ParamSpec, Protocol, TypeVar, cast

from ._errors import awaitable_result, check_function
from ._multikey import check_timeout
from ._protocols import KeyLock

T = TypeVar("T")
P = ParamSpec("P")

SubmitCall = Callable[
    [Hashable, Callable[..., Awaitable[Any]], tuple[Any, ...], dict[str, Any], "float | None"],
    "asyncio.Task[Any]",
]
"""A queue's ``submit``, with its arguments as a tuple and a dict and the wait's bound."""


class TurnTaker(Protocol):
    def call(
        self,
        key: Hashable,
        fn: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None = None,
    ) -> Coroutine[Any, Any, T]: ...

    def lock(self, key: Hashable, timeout: float | None = None) -> KeyLock: ...


class MultiKeyTurnTaker(TurnTaker, Protocol):
    def lock_all(self, keys: Iterable[Hashable], timeout: float | None = None) -> KeyLock: ...


class WaitOptions:
    """A queue's ways of taking one key's turn, each with the same bound on the wait.

    Made by ``queue.with_options(timeout=...)``. ``timeout`` bounds only the wait for the
    turn: on expiry the built-in ``TimeoutError`` is raised, the function never starts,
    and the queue is left as it was. ``timeout=0`` is a try: it never waits, so a held key
    raises ``TimeoutError`` at once (never ``DeadlockError``). ``None`` waits as long as it
    takes. A started call is never interrupted.

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

    __slots__ = ("_queue", "_submit", "timeout")

    def __init__(self, queue: TurnTaker, submit: SubmitCall, timeout: float | None) -> None:
        check_timeout(timeout)
        self._queue = queue
        self._submit = submit
        self.timeout = timeout
        """Seconds the turn is waited for at most, or ``None``."""

    def run(
        self, key: Hashable, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs
    ) -> Coroutine[Any, Any, T]:
        """The queue's ``run``, with this view's bound on the wait.

        Raises:
            TimeoutError: the turn did not come within ``timeout`` seconds.
        """
        check_function(fn, "run")
        return self._queue.call(key, fn, args, kwargs, self.timeout)

    def submit(
        self, key: Hashable, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs
    ) -> asyncio.Task[T]:
        """The queue's ``submit``, with this view's bound on the wait of the new task.

        Raises:
            TimeoutError: from the task, when its turn did not come within ``timeout``
                seconds; from ``submit`` itself, when ``timeout=0`` finds the key held.
        """
        check_function(fn, "submit")
        return cast("asyncio.Task[T]", self._submit(key, fn, args, kwargs, self.timeout))

    def lock(self, key: Hashable) -> KeyLock:
        """The queue's ``lock``, with this view's bound on the wait.

        Raises:
            TimeoutError: on entering, the turn did not come within ``timeout`` seconds.
        """
        return self._queue.lock(key, self.timeout)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} timeout={self.timeout!r} of {self._queue!r}>"


class MultiKeyWaitOptions(WaitOptions):
    """``WaitOptions`` of a queue that can also hold several keys at once."""

    __slots__ = ()

    _queue: MultiKeyTurnTaker

    def __init__(self, queue: MultiKeyTurnTaker, submit: SubmitCall, timeout: float | None) -> None:
        super().__init__(queue, submit, timeout)

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
        """
        check_function(fn, "run_all")
        return _run_holding(self._queue.lock_all(keys, self.timeout), fn, args, kwargs)

    def lock_all(self, keys: Iterable[Hashable]) -> KeyLock:
        """The queue's ``lock_all``, with this view's bound on the wait for all the turns.

        Raises:
            TimeoutError: on entering, the turns did not all come within ``timeout`` seconds.
        """
        return self._queue.lock_all(keys, self.timeout)


async def _run_holding(
    lock: KeyLock, fn: Callable[..., Awaitable[T]], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> T:
    async with lock:
        return await awaitable_result(fn, fn(*args, **kwargs))
