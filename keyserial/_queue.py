"""The in-process keyed serial queue."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from types import TracebackType
from typing import Any, NamedTuple, TypeVar

from ._errors import QueueClosed, QueueFull
from ._loops import get_running_loop, task_of

T = TypeVar("T")

Task = asyncio.Task[Any]

#: ``_KeyState.holder`` while the turn has been handed to a waiter that has not resumed yet.
_GRANTED = object()
#: The owner passed for ``submit``: its task does not exist yet, so it can hold nothing.
_NEW_TASK = object()
#: Dead waiters (cancelled or timed out) are dropped lazily; rebuild the deque once
#: they outnumber the live ones by this much, so cancelling many stays linear.
_COMPACT_SLACK = 32


class _KeyState:
    """A key that saw contention during its current busy period.

    A key that is only ever used by one call at a time never gets one of these:
    its partition entry is simply the holding task.
    """

    __slots__ = ("holder", "pending", "waiters")

    def __init__(self, holder: object) -> None:
        # The running task, _GRANTED, or None when free with only dead waiters left.
        self.holder = holder
        # Running plus waiting calls, counting waiters that died but have not resumed yet.
        self.pending = 1
        # Waiters in registration order; a done future is a dead waiter, skipped on hand-off.
        self.waiters: deque[asyncio.Future[bool]] = deque()


class _Registration(NamedTuple):
    """A call registered on a busy key: what it waits on, and the timer bounding the wait."""

    state: _KeyState
    waiter: asyncio.Future[bool] | None
    timer: asyncio.TimerHandle | None


class _Partition(dict[Hashable, "Task | _KeyState"]):
    """One event loop's share of a queue: key -> holding task, or ``_KeyState`` once contended."""

    __slots__ = ("closed", "idle_waiters", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        super().__init__()
        self.loop = loop
        self.closed = False
        self.idle_waiters: list[asyncio.Future[None]] = []

    def forget(self, key: Hashable) -> None:
        """Drop a key whose last registered call is gone, waking ``join`` if now idle."""
        del self[key]
        if not self and self.idle_waiters:
            self.wake_idle()

    def wake_idle(self) -> None:
        waiters, self.idle_waiters = self.idle_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


def _unhashable(key: object) -> TypeError:
    return TypeError(f"keyserial keys must be hashable, got {type(key).__name__}: {key!r}")


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)


def _check_timeout(timeout: float | None) -> None:
    if timeout is not None and not timeout >= 0:
        raise ValueError(f"timeout must be None or a number >= 0, got {timeout!r}")


class KeyedSerialQueue:
    """Run async calls one at a time per key, in registration order; different keys concurrently.

    Guarantees:

    * calls with the same key start one at a time, in registration order, each
      after the previous one has returned, raised or been cancelled;
    * calls with different keys never wait for each other;
    * a call that raises or is cancelled does not stop the calls behind it, and
      every caller gets its own result or exception, unchanged;
    * a key with no registered work has no entry (``len(queue)`` counts only
      keys with work);
    * a call made from the task that currently holds the key's turn runs at
      once inside that turn (re-entrancy); any other task, including a child
      of the holder, queues;
    * each event loop has its own share of the queue, including its closed
      state, so a queue can be used by one ``asyncio.run`` after another.

    Args:
        max_pending: per-key bound on running plus waiting calls; the call that
            would exceed it raises :class:`QueueFull` at once. ``None`` means
            unbounded.

    Raises:
        ValueError: ``max_pending`` is not ``None`` or an int >= 1.

    Example:
        >>> import asyncio
        >>> from keyserial import KeyedSerialQueue
        >>> async def main() -> list[str]:
        ...     queue, log = KeyedSerialQueue(), []
        ...     async def save(text: str) -> None:
        ...         await asyncio.sleep(0)
        ...         log.append(text)
        ...     await asyncio.gather(*(queue.run("seg-1", save, t) for t in "abc"))
        ...     return log
        >>> asyncio.run(main())
        ['a', 'b', 'c']
    """

    __slots__ = ("_cached", "_max_pending", "_partitions", "_switch_lock")

    def __init__(self, max_pending: int | None = None) -> None:
        if max_pending is not None and (
            isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1
        ):
            raise ValueError(f"max_pending must be None or an int >= 1, got {max_pending!r}")
        self._max_pending = max_pending
        self._partitions: dict[asyncio.AbstractEventLoop, _Partition] = {}
        # The last partition used; it carries its loop, so one read gives a consistent pair
        # even when threads with loops of their own share the queue.
        self._cached = _Partition(None)
        self._switch_lock = threading.Lock()

    @property
    def max_pending(self) -> int | None:
        """The per-key bound on running plus waiting calls, or ``None``."""
        return self._max_pending

    # -- partitions -----------------------------------------------------------------------

    def _partition(self, loop: asyncio.AbstractEventLoop) -> _Partition:
        part = self._cached
        if part.loop is loop:
            return part
        with self._switch_lock:
            part = self._partitions.get(loop)  # type: ignore[assignment]
            if part is None:
                # A closed loop never runs its tasks again: dropping its share keeps a later
                # loop unaffected by work it left registered, and frees what it held.
                for stale in [old for old in self._partitions if old.is_closed()]:
                    del self._partitions[stale]
                part = self._partitions[loop] = _Partition(loop)
            self._cached = part
        return part

    def _inspected(self) -> _Partition:
        try:
            loop = get_running_loop()
        except RuntimeError:
            return self._cached
        return self._partition(loop)

    # -- registration ---------------------------------------------------------------------

    def _register(
        self,
        part: _Partition,
        key: Hashable,
        holder: Task | _KeyState,
        owner: object,
        timeout: float | None,
    ) -> _Registration | None:
        """Register ``owner`` on the busy ``key``; ``None`` if ``owner`` holds it (re-entry).

        The registration's future is ``None`` when the turn is free (only dead
        waiters, not yet resumed, kept the state alive): the turn is taken at once.
        """
        if type(holder) is _KeyState:
            state = holder
            if state.holder is owner:
                return None
        elif holder is owner:
            return None
        else:
            state = part[key] = _KeyState(holder)
        if part.closed:
            raise QueueClosed(f"queue is closed; cannot register key {key!r}")
        if self._max_pending is not None and state.pending >= self._max_pending:
            raise QueueFull(key, self._max_pending)
        state.pending += 1
        if state.holder is None:
            state.holder = _GRANTED if owner is _NEW_TASK else owner
            return _Registration(state, None, None)
        loop: asyncio.AbstractEventLoop = part.loop  # type: ignore[assignment]
        waiter: asyncio.Future[bool] = loop.create_future()
        state.waiters.append(waiter)
        timer = None if timeout is None else loop.call_later(timeout, _expire, waiter)
        return _Registration(state, waiter, timer)

    def _give_up(self, part: _Partition, key: Hashable, registration: _Registration) -> None:
        """The wait for the turn was interrupted (cancelled, or another BaseException)."""
        if registration.timer is not None:
            registration.timer.cancel()
        self._abandon(part, key, registration.state, registration.waiter)

    def _take_turn(
        self, part: _Partition, key: Hashable, registration: _Registration, task: Task
    ) -> None:
        """The wait ended: take the turn, or raise TimeoutError if the timer ended it."""
        state, waiter, timer = registration
        if timer is not None:
            timer.cancel()
        if waiter is not None and not waiter.result():
            self._abandon(part, key, state, waiter)
            raise TimeoutError(f"timed out waiting for the turn of key {key!r}")
        state.holder = task

    async def _await_turn(
        self, part: _Partition, key: Hashable, registration: _Registration
    ) -> None:
        if registration.waiter is not None:
            try:
                await registration.waiter
            except BaseException:
                self._give_up(part, key, registration)
                raise
        self._take_turn(part, key, registration, asyncio.current_task())  # type: ignore[arg-type]

    def _abandon(
        self, part: _Partition, key: Hashable, state: _KeyState, waiter: asyncio.Future[bool] | None
    ) -> None:
        """A registered call gives up before running; ``waiter=None`` means it had the turn."""
        if part.loop.is_closed():  # type: ignore[union-attr]
            return  # a coroutine finalized after its loop closed: that share is gone
        if waiter is None or (waiter.done() and not waiter.cancelled() and waiter.result()):
            # The turn was handed over but its owner stopped before using it: pass it on.
            self._release(part, key, state)
            return
        if not waiter.done():
            waiter.cancel()
        state.pending -= 1
        if state.pending == 0:
            part.forget(key)
        elif len(state.waiters) > 2 * state.pending + _COMPACT_SLACK:
            state.waiters = deque(w for w in state.waiters if not w.done())

    def _release(self, part: _Partition, key: Hashable, state: _KeyState) -> None:
        """End the current turn of a contended key: hand it to the next live waiter, if any."""
        if part.loop.is_closed():  # type: ignore[union-attr]
            return  # a coroutine finalized after its loop closed: that share is gone
        state.pending -= 1
        waiters = state.waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                state.holder = _GRANTED
                waiter.set_result(True)
                return
        state.holder = None
        if state.pending == 0:
            part.forget(key)

    def _leave(self, part: _Partition, key: Hashable, task: Task) -> None:
        held = part.pop(key)
        if held is not task or part.idle_waiters:
            self._after_turn(part, key, held, task)

    def _after_turn(
        self, part: _Partition, key: Hashable, held: Task | _KeyState, task: Task
    ) -> None:
        """Finish a turn whose entry ``held`` was popped: hand it on, or wake ``join``."""
        if held is task:
            if not part:
                part.wake_idle()
        else:
            part[key] = held
            self._release(part, key, held)  # type: ignore[arg-type]

    # -- running calls --------------------------------------------------------------------
    #
    # run() and call() share one body, written out twice because their signatures differ
    # and each path must avoid a second coroutine: an extra frame per call costs about
    # 50 ns and, while waiting, about 200 bytes. Keep the two bodies identical.

    async def run(
        self, key: Hashable, fn: Callable[..., Awaitable[T]], /, *args: Any, **kwargs: Any
    ) -> T:
        """Run ``await fn(*args, **kwargs)`` in ``key``'s turn, inside the caller's task.

        The call registers when the coroutine first runs; a coroutine that is
        never awaited never registers. It returns what ``fn`` returns and
        raises what ``fn`` raises.

        Raises:
            QueueClosed: the queue is closed (for the running event loop).
            QueueFull: ``key`` already has ``max_pending`` pending calls.
            TypeError: ``key`` is not hashable.
            RuntimeError: awaited outside an asyncio task.

        Example:
            >>> import asyncio
            >>> from keyserial import KeyedSerialQueue
            >>> async def double(x: int) -> int:
            ...     return 2 * x
            >>> asyncio.run(KeyedSerialQueue().run("k", double, 21))
            42
        """
        timeout = None
        loop = get_running_loop()
        part = self._cached
        if part.loop is not loop:
            part = self._partition(loop)
        task = task_of(loop)
        if task is None:
            raise RuntimeError("keyserial calls must run inside an asyncio task")
        try:
            holder = part.get(key)
        except TypeError:
            raise _unhashable(key) from None
        if holder is None:
            if part.closed:
                raise QueueClosed(f"queue is closed; cannot register key {key!r}")
            part[key] = task  # the uncontended path: one dict entry, nothing else
        else:
            registration = self._register(part, key, holder, task, timeout)
            if registration is None:  # re-entry: run inside the turn this task holds
                return await fn(*args, **kwargs)
            if registration.waiter is not None:
                try:
                    await registration.waiter
                except BaseException:
                    self._give_up(part, key, registration)
                    raise
            self._take_turn(part, key, registration, task)
        try:
            if kwargs:
                return await fn(*args, **kwargs)
            return await fn(*args)  # unpacking an empty **kwargs costs measurably here
        finally:
            held = part.pop(key)
            if held is not task or part.idle_waiters:
                self._after_turn(part, key, held, task)

    async def call(
        self,
        key: Hashable,
        fn: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None = None,
    ) -> T:
        """Run ``await fn(*args, **kwargs)`` in ``key``'s turn: :meth:`run` with a wait timeout.

        ``timeout`` bounds only the wait for the turn: on expiry the built-in
        :class:`TimeoutError` is raised, ``fn`` never starts and the key is not
        left blocked. Once started, ``fn`` runs to completion.

        Raises:
            TimeoutError: the turn did not come within ``timeout`` seconds.
            ValueError: ``timeout`` is negative.
            QueueClosed, QueueFull, TypeError, RuntimeError: as for :meth:`run`.

        Example:
            >>> import asyncio
            >>> from keyserial import KeyedSerialQueue
            >>> async def add(a: int, b: int) -> int:
            ...     return a + b
            >>> asyncio.run(KeyedSerialQueue().call("k", add, (1, 2), {}, timeout=1.0))
            3
        """
        if timeout is not None:
            _check_timeout(timeout)
        loop = get_running_loop()
        part = self._cached
        if part.loop is not loop:
            part = self._partition(loop)
        task = task_of(loop)
        if task is None:
            raise RuntimeError("keyserial calls must run inside an asyncio task")
        try:
            holder = part.get(key)
        except TypeError:
            raise _unhashable(key) from None
        if holder is None:
            if part.closed:
                raise QueueClosed(f"queue is closed; cannot register key {key!r}")
            part[key] = task  # the uncontended path: one dict entry, nothing else
        else:
            registration = self._register(part, key, holder, task, timeout)
            if registration is None:  # re-entry: run inside the turn this task holds
                return await fn(*args, **kwargs)
            if registration.waiter is not None:
                try:
                    await registration.waiter
                except BaseException:
                    self._give_up(part, key, registration)
                    raise
            self._take_turn(part, key, registration, task)
        try:
            if kwargs:
                return await fn(*args, **kwargs)
            return await fn(*args)  # unpacking an empty **kwargs costs measurably here
        finally:
            held = part.pop(key)
            if held is not task or part.idle_waiters:
                self._after_turn(part, key, held, task)

    def submit(
        self, key: Hashable, fn: Callable[..., Awaitable[T]], /, *args: Any, **kwargs: Any
    ) -> asyncio.Task[T]:
        """Start ``fn(*args, **kwargs)`` in ``key``'s turn as a new task; it is registered at once.

        The new task is a different task from the caller, so it queues even
        when the caller holds ``key`` (awaiting it from inside that turn would
        deadlock). Cancelling the task before its turn withdraws it without a
        trace; cancelling it during its turn passes the turn on when ``fn`` exits.

        Raises:
            QueueClosed: the queue is closed (for the running event loop).
            QueueFull: ``key`` already has ``max_pending`` pending calls.
            TypeError: ``key`` is not hashable or ``fn`` is not callable.
            RuntimeError: no event loop is running.

        Example:
            >>> import asyncio
            >>> from keyserial import KeyedSerialQueue
            >>> async def main() -> list[int]:
            ...     queue = KeyedSerialQueue()
            ...     async def echo(i: int) -> int:
            ...         return i
            ...     tasks = [queue.submit("k", echo, i) for i in range(3)]
            ...     return list(await asyncio.gather(*tasks))
            >>> asyncio.run(main())
            [0, 1, 2]
        """
        if not callable(fn):
            raise TypeError(f"submit() needs an async callable, got {fn!r}")
        loop = get_running_loop()
        part = self._partition(loop)
        if part.closed:
            raise QueueClosed(f"queue is closed; cannot register key {key!r}")
        try:
            holder = part.get(key)
        except TypeError:
            raise _unhashable(key) from None
        if holder is None:
            # The task may start eagerly inside create_task, so the turn is reserved first.
            state = part[key] = _KeyState(_GRANTED)
            registration: _Registration | None = _Registration(state, None, None)
        else:
            registration = self._register(part, key, holder, _NEW_TASK, None)
        assert registration is not None  # a task that does not exist yet holds nothing
        submission = _Submission(self, part, key, registration)
        task = loop.create_task(submission.execute(fn, args, kwargs))
        task.add_done_callback(submission.withdraw_if_unstarted)
        return task

    def lock(self, key: Hashable, timeout: float | None = None) -> _KeyLock:
        """Hold ``key``'s turn for the body of an ``async with`` block.

        The block registers when it is entered. ``timeout`` bounds only the
        wait for the turn; entering from the task that already holds ``key``
        does not wait and does not release the outer turn on exit.

        Raises:
            TimeoutError: the turn did not come within ``timeout`` seconds.
            QueueClosed, QueueFull, TypeError, RuntimeError: as for :meth:`run`.
            ValueError: ``timeout`` is negative.

        Example:
            >>> import asyncio
            >>> from keyserial import KeyedSerialQueue
            >>> async def main() -> bool:
            ...     queue = KeyedSerialQueue()
            ...     async with queue.lock("seg-1", timeout=5):
            ...         return queue.locked("seg-1")
            >>> asyncio.run(main())
            True
        """
        _check_timeout(timeout)
        return _KeyLock(self, key, timeout)

    # -- inspection and shutdown ----------------------------------------------------------

    def pending(self, key: Hashable) -> int:
        """Running plus waiting calls for ``key`` in the running loop's share (0 if unknown).

        Example:
            >>> from keyserial import KeyedSerialQueue
            >>> KeyedSerialQueue().pending("nobody")
            0
        """
        held = self._inspected().get(key)
        if held is None:
            return 0
        if type(held) is _KeyState:
            return held.pending
        return 1

    def locked(self, key: Hashable) -> bool:
        """Whether ``key``'s turn is currently held (granted to a call).

        Example:
            >>> from keyserial import KeyedSerialQueue
            >>> KeyedSerialQueue().locked("nobody")
            False
        """
        held = self._inspected().get(key)
        if type(held) is _KeyState:
            return held.holder is not None
        return held is not None

    def __len__(self) -> int:
        """Number of keys with registered work in the running loop's share."""
        return len(self._inspected())

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` has registered work in the running loop's share."""
        try:
            return key in self._inspected()
        except TypeError:
            return False

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called (for the running event loop)."""
        return self._inspected().closed

    async def join(self) -> None:
        """Wait until no work is registered; work registered while waiting is waited for too.

        Example:
            >>> import asyncio
            >>> from keyserial import KeyedSerialQueue
            >>> async def main() -> int:
            ...     queue = KeyedSerialQueue()
            ...     async def work() -> None:
            ...         await asyncio.sleep(0)
            ...     queue.submit("k", work)
            ...     await queue.join()
            ...     return len(queue)
            >>> asyncio.run(main())
            0
        """
        part = self._partition(asyncio.get_running_loop())
        if not part:
            return
        idle: asyncio.Future[None] = part.loop.create_future()  # type: ignore[union-attr]
        part.idle_waiters.append(idle)
        await idle

    async def aclose(self) -> None:
        """Refuse new work with :class:`QueueClosed`, then wait for the registered work to finish.

        Closing applies to the running event loop's share of the queue. Calls
        already registered, and re-entrant calls made inside their turns, still run.

        Example:
            >>> import asyncio
            >>> from keyserial import KeyedSerialQueue
            >>> async def main() -> bool:
            ...     queue = KeyedSerialQueue()
            ...     await queue.aclose()
            ...     return queue.closed
            >>> asyncio.run(main())
            True
        """
        self._partition(asyncio.get_running_loop()).closed = True
        await self.join()

    def __repr__(self) -> str:
        part = self._inspected()
        state = "closed" if part.closed else "open"
        return f"<KeyedSerialQueue {state} keys={len(part)} max_pending={self._max_pending}>"


class _Submission:
    """The registration made by ``submit``, and its withdrawal if the task never starts."""

    __slots__ = ("key", "part", "queue", "registration", "started")

    def __init__(
        self, queue: KeyedSerialQueue, part: _Partition, key: Hashable, registration: _Registration
    ) -> None:
        self.queue = queue
        self.part = part
        self.key = key
        self.registration = registration
        self.started = False

    async def execute(
        self, fn: Callable[..., Awaitable[T]], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> T:
        self.started = True
        queue, part, key = self.queue, self.part, self.key
        await queue._await_turn(part, key, self.registration)
        try:
            return await fn(*args, **kwargs)
        finally:
            queue._release(part, key, self.registration.state)

    def withdraw_if_unstarted(self, task: asyncio.Task[Any]) -> None:
        # A task cancelled before its first step never runs execute()'s cleanup.
        if not self.started:
            self.queue._give_up(self.part, self.key, self.registration)


class _KeyLock:
    """The async context manager returned by :meth:`KeyedSerialQueue.lock`."""

    __slots__ = ("_key", "_part", "_queue", "_task", "_timeout")

    def __init__(self, queue: KeyedSerialQueue, key: Hashable, timeout: float | None) -> None:
        self._queue = queue
        self._key = key
        self._timeout = timeout
        self._part: _Partition | None = None
        self._task: Task | None = None

    async def __aenter__(self) -> None:
        if self._part is not None:
            raise RuntimeError("a keyserial lock() object cannot be entered twice at once")
        queue, key = self._queue, self._key
        loop = get_running_loop()
        part = queue._partition(loop)
        task = task_of(loop)
        if task is None:
            raise RuntimeError("keyserial calls must run inside an asyncio task")
        try:
            holder = part.get(key)
        except TypeError:
            raise _unhashable(key) from None
        if holder is None:
            if part.closed:
                raise QueueClosed(f"queue is closed; cannot register key {key!r}")
            part[key] = task
        else:
            registration = queue._register(part, key, holder, task, self._timeout)
            if registration is None:
                return  # re-entry: the outer turn stays in charge of releasing
            await queue._await_turn(part, key, registration)
        self._part, self._task = part, task

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        part, task = self._part, self._task
        if part is not None and task is not None:
            self._part = self._task = None
            self._queue._leave(part, self._key, task)
