"""Watching a queue: observer hooks and slow-turn warnings.

A queue made with an ``observer`` or a ``slow_turn`` threshold is an
``ObservedQueue``: it wraps each call so that it is timed from registration
to start to finish. A queue made without them never runs this code, so its
uncontended path pays nothing for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Hashable, Iterable
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

from ._errors import QueueClosed, QueueFull, Superseded
from ._observer import Outcome, QueueObserver
from ._protocols import KeyLock
from ._queue import KeyedSerialQueue, register_observed_queue
from ._stats import QueueStats

T = TypeVar("T")
P = ParamSpec("P")

logger = logging.getLogger("keyserial")


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


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


class Watching:
    """What an observed queue watches with: its observer, slow-turn bound and running calls."""

    __slots__ = ("observer", "running", "slow_turn")

    def __init__(self, observer: QueueObserver | None, slow_turn: float | None) -> None:
        self.observer = observer
        self.slow_turn = slow_turn
        self.running: set[_Watch] = set()

    def notify(self, hook: str, *args: Any) -> None:
        """Call the observer's ``hook``; a failing observer is logged, never raised."""
        if self.observer is None:
            return
        try:
            getattr(self.observer, hook)(*args)
        except Exception:
            logger.exception("keyserial: observer %r failed in %s", self.observer, hook)


class _Watch:
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
        return await fn(*args, **kwargs)

    async def run_and_finish(
        self, fn: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """Run ``fn`` as the watched call's turn, and report its end before the turn ends.

        For ``submit``: the caller awaiting the task then resumes after ``on_finish``, even
        when the task ran eagerly and finished inside ``create_task``.
        """
        self.start()
        try:
            result = await fn(*args, **kwargs)
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


class ObservedQueue(KeyedSerialQueue):
    """A keyed serial queue that reports each call to an observer and warns of slow turns.

    Made by ``KeyedSerialQueue(observer=..., slow_turn=...)``; see there.
    """

    __slots__ = ("_watching",)

    def __init__(
        self,
        max_pending: int | None = None,
        *,
        detect_deadlocks: bool = True,
        count_calls: bool = False,
        observer: QueueObserver | None = None,
        slow_turn: float | None = None,
    ) -> None:
        super().__init__(max_pending, detect_deadlocks=detect_deadlocks, count_calls=count_calls)
        if slow_turn is not None and not slow_turn > 0:
            raise ValueError(f"slow_turn must be None or a number > 0, got {slow_turn!r}")
        self._watching = Watching(observer, slow_turn)

    async def run(
        self, key: Hashable, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs
    ) -> T:
        watch = _Watch(self._watching, key, _name(fn))
        turn = super().run(key, watch.run, fn, *args, **kwargs)  # type: ignore[arg-type]  # mypy cannot forward P through watch.run
        return await watch.watch(turn)

    async def _call(
        self,
        key: Hashable,
        fn: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None,
        group: Hashable | None,
    ) -> T:
        watch = _Watch(self._watching, key, _name(fn))
        call: Awaitable[T] = super()._call(  # pyright: ignore[reportAssignmentType]
            key, watch.run, (fn, *args), kwargs, timeout, group
        )
        return await watch.watch(call)

    def _submit(
        self,
        key: Hashable,
        fn: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None,
        group: Hashable | None,
    ) -> asyncio.Task[T]:
        watch = _Watch(self._watching, key, _name(fn))
        try:
            task: asyncio.Task[T] = super()._submit(  # pyright: ignore[reportAssignmentType]
                key, watch.run_and_finish, (fn, *args), kwargs, timeout, group
            )
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

    async def run_all(
        self,
        keys: Iterable[Hashable],
        fn: Callable[P, Awaitable[T]],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> T:
        keys = tuple(keys)
        watch = _Watch(self._watching, keys, _name(fn))
        turn = super().run_all(keys, watch.run, fn, *args, **kwargs)  # type: ignore[arg-type]  # mypy cannot forward P through watch.run
        return await watch.watch(turn)

    def lock(
        self, key: Hashable, timeout: float | None = None, group: Hashable | None = None
    ) -> KeyLock:
        return _ObservedLock(self._watching, key, super().lock(key, timeout, group))

    def lock_all(self, keys: Iterable[Hashable], timeout: float | None = None) -> KeyLock:
        keys = tuple(keys)
        return _ObservedLock(self._watching, keys, super().lock_all(keys, timeout))

    def stats(self) -> QueueStats:
        """As [stats][keyserial.KeyedSerialQueue.stats], with every running turn timed exactly."""
        base = super().stats()
        share = self._shares.inspected()
        watches = [
            w for w in self._watching.running if w.started is not None and w.loop is share.loop
        ]
        if not watches:
            return base
        now = watches[0].loop.time()
        longest = max(watches, key=lambda w: now - w.started)  # type: ignore[operator]
        running = (longest.key, now - longest.started)  # type: ignore[operator]
        return dataclasses.replace(base, longest_running=running)


class _ObservedLock:
    """``lock()``/``lock_all()`` of an observed queue: the block is the watched call."""

    __slots__ = ("_inner", "_key", "_watch", "_watching")

    def __init__(self, watching: Watching, key: Hashable, inner: KeyLock) -> None:
        self._watching = watching
        self._key = key
        self._inner = inner
        self._watch: _Watch | None = None

    async def __aenter__(self) -> None:
        self._watch = watch = _Watch(self._watching, self._key, "lock")  # registers now
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


register_observed_queue(ObservedQueue)
