"""Watching a queue: the observer protocol, and the timing of each observed call.

``QueueObserver`` is what a user subclasses. A queue made with an ``observer`` or a
``slow_turn`` threshold keeps a ``Watching`` here; each of its entry points then hands the
call to one of the ``watched_*`` methods, which wrap it in a ``Watch`` (timed from
registration to start to finish) and run it through the same entry point of the queue
without the watching. A queue made without them pays one ``is None`` test per call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Coroutine, Hashable
from types import TracebackType
from typing import Any, Literal, ParamSpec, TypeVar

from ._errors import QueueClosed, QueueFull, Superseded, called
from ._protocols import KeyLock
from ._stats import QueueStats

T = TypeVar("T")
P = ParamSpec("P")

logger = logging.getLogger("keyserial")


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


def _outcome_before_start(exc: BaseException) -> Outcome:
    if isinstance(exc, (QueueFull, QueueClosed)):
        return "rejected"
    if isinstance(exc, Superseded):
        return "superseded"
    if isinstance(exc, TimeoutError):
        return "timed_out"
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    return "failed"


def function_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


class Watching:
    """What an observed queue watches with: its observer, slow-turn bound and running calls."""

    __slots__ = ("observer", "running", "slow_turn")

    def __init__(self, observer: QueueObserver | None, slow_turn: float | None) -> None:
        self.observer = observer
        self.slow_turn = slow_turn
        self.running: set[Watch] = set()

    async def watched_run(
        self,
        run: Callable[..., Coroutine[Any, Any, T]],
        key: Hashable,
        fn: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> T:
        """``run(key, fn, *args, **kwargs)`` (the queue's own, unwatched), watched; or
        ``run_all``, with the tuple of its keys as ``key``."""
        watch = Watch(self, key, function_name(fn))
        return await watch.watch(run(key, watch.run, fn, *args, **kwargs))

    async def watched_call(
        self,
        call: Callable[..., Coroutine[Any, Any, T]],
        key: Hashable,
        fn: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None,
        group: Hashable | None,
    ) -> T:
        """A ``with_options`` call (the queue's own ``_call``, unwatched), watched."""
        watch = Watch(self, key, function_name(fn))
        return await watch.watch(call(key, watch.run, (fn, *args), kwargs, timeout, group))

    def watched_submit(
        self,
        submit: Callable[..., asyncio.Task[T]],
        key: Hashable,
        fn: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None,
        group: Hashable | None,
    ) -> asyncio.Task[T]:
        """``submit`` (the queue's own ``_submit``, unwatched), watched."""
        watch = Watch(self, key, function_name(fn))
        try:
            task = submit(key, watch.run_and_finish, (fn, *args), kwargs, timeout, group)
        except BaseException as exc:
            watch.finish(exc)
            raise
        # A task that ends before its turn (cancelled while waiting) never runs
        # run_and_finish's report: this callback reports it.
        task.add_done_callback(
            lambda done: watch.finish(
                asyncio.CancelledError() if done.cancelled() else done.exception()
            )
        )
        return task

    def with_longest_running(
        self, stats: QueueStats, loop: asyncio.AbstractEventLoop | None
    ) -> QueueStats:
        """``stats`` with ``longest_running`` exact: every watched turn on ``loop`` is timed."""
        watches = [w for w in self.running if w.started is not None and w.loop is loop]
        if not watches:
            return stats
        now = watches[0].loop.time()
        longest = max(watches, key=lambda w: now - w.started)  # type: ignore[operator]
        running = (longest.key, now - longest.started)  # type: ignore[operator]
        return dataclasses.replace(stats, longest_running=running)

    def notify(self, hook: str, *args: Any) -> None:
        """Call the observer's ``hook``; a failing observer is logged, never raised."""
        if self.observer is None:
            return
        try:
            getattr(self.observer, hook)(*args)
        except Exception:
            logger.exception("keyserial: observer %r failed in %s", self.observer, hook)


class Watch:
    """One call being watched, from registration to finish, on its loop's clock."""

    __slots__ = ("finished", "function", "key", "loop", "registered", "started", "timer", "to")

    def __init__(self, to: Watching, key: Hashable, function: str) -> None:
        self.to = to
        self.key = key
        self.function = function
        self.loop = asyncio.get_running_loop()
        self.registered = self.loop.time()
        self.started: float | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.finished = False
        to.notify("on_register", key, self.function)

    def start(self) -> None:
        self.started = now = self.loop.time()
        self.to.running.add(self)
        if self.to.slow_turn is not None:
            self.timer = self.loop.call_later(self.to.slow_turn, self._warn_slow)
        self.to.notify("on_start", self.key, self.function, now - self.registered)

    def finish(self, exc: BaseException | None) -> None:
        if self.finished:
            return
        self.finished = True
        if self.timer is not None:
            self.timer.cancel()
        now = self.loop.time()
        started = self.started
        waited = (started if started is not None else now) - self.registered
        outcome: Outcome
        if started is None:
            outcome = _outcome_before_start(exc) if exc is not None else "cancelled"
        elif exc is None:
            outcome = "completed"
        else:
            outcome = "cancelled" if isinstance(exc, asyncio.CancelledError) else "failed"
        self.to.running.discard(self)
        ran = None if started is None else now - started
        self.to.notify("on_finish", self.key, self.function, waited, ran, outcome)

    def _warn_slow(self) -> None:
        logger.warning(
            "keyserial: %s has held the turn of key %r for more than %s s",
            self.function,
            self.key,
            self.to.slow_turn,
        )

    async def run(self, fn: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run ``fn`` as the watched call's turn."""
        self.start()
        return await called(fn, args, kwargs)

    async def run_and_finish(
        self, fn: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """Run ``fn`` as the watched call's turn, and report its end before the turn ends.

        For ``submit``: the caller awaiting the task then resumes after ``on_finish``, even
        when the task ran eagerly and finished inside ``create_task``.
        """
        self.start()
        try:
            result = await called(fn, args, kwargs)
        except BaseException as exc:
            self.finish(exc)
            raise
        self.finish(None)
        return result

    async def watch(self, call: Awaitable[T]) -> T:
        """Await ``call``, the whole watched call, and report how it finished."""
        try:
            result = await call
        except BaseException as exc:
            self.finish(exc)
            raise
        self.finish(None)
        return result


class ObservedLock:
    """``lock()``/``lock_all()`` of an observed queue: the block is the watched call."""

    __slots__ = ("_inner", "_key", "_watch", "_watching")

    def __init__(self, watching: Watching, key: Hashable, inner: KeyLock) -> None:
        self._watching = watching
        self._key = key
        self._inner = inner
        self._watch: Watch | None = None

    async def __aenter__(self) -> None:
        self._watch = watch = Watch(self._watching, self._key, "lock")  # registers now
        try:
            await self._inner.__aenter__()
        except BaseException as exc:
            watch.finish(exc)
            raise
        watch.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self._inner.__aexit__(exc_type, exc, tb)
        finally:
            if self._watch is not None:
                self._watch.finish(exc)
