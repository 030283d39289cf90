"""The in-process keyed serial queue."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Hashable, Iterable, Mapping
from contextvars import Token
from types import CoroutineType, TracebackType
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, cast

from ._deadlock import check_later, check_no_cycle, register_entry_code
from ._errors import DeadlockError
from ._fence import enter_lock_block, exit_lock_block, register_turn_code
from ._loops import drop_closed_loops, get_running_loop, no_event_loop, running_loop, task_of
from ._protocols import KeyLock
from ._state import (
    GRANTED,
    NEW_TASK,
    KeyState,
    MultiRegistration,
    Partition,
    Waiter,
    closed_error,
    granted_waiter,
    key_error,
)
from ._stats import QueueStats, snapshot

if TYPE_CHECKING:
    from ._observe import QueueObserver

T = TypeVar("T")
P = ParamSpec("P")

Task = asyncio.Task[Any]


def _outside_task() -> RuntimeError:
    return RuntimeError("keyserial calls must run inside an asyncio task")


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
        detect_deadlocks: check, whenever a call must wait, that the wait does
            not close a cycle of tasks waiting on each other, and raise
            :class:`DeadlockError` instead of hanging. Only waiting calls pay.
        count_calls: count every turn, so that :meth:`stats` reports ``started``
            and ``completed``. Off by default: the count would make every
            uncontended call about 8% dearer. Failures, cancellations, timeouts,
            rejections and supersessions are counted either way.
        observer: a :class:`QueueObserver` told of every call's registration,
            start (with time waited) and finish (with time run and outcome).
        slow_turn: seconds; a turn running longer logs one warning through the
            ``keyserial`` logger, naming the key and the function.

    Raises:
        ValueError: ``max_pending`` is not ``None`` or an int >= 1, or
            ``slow_turn`` is not ``None`` or a number > 0.

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

    __slots__ = (
        "_cached",
        "_count_calls",
        "_detect_deadlocks",
        "_max_pending",
        "_partitions",
        "_switch_lock",
    )

    def __new__(
        cls,
        max_pending: int | None = None,
        *,
        detect_deadlocks: bool = True,
        count_calls: bool = False,
        observer: QueueObserver | None = None,
        slow_turn: float | None = None,
    ) -> KeyedSerialQueue:
        if cls is KeyedSerialQueue and (observer is not None or slow_turn is not None):
            # Only an observed queue runs the code that times calls: a plain queue's
            # uncontended path stays as fast as it is without observers.
            from ._observe import ObservedQueue

            cls = ObservedQueue
        return object.__new__(cls)

    def __init__(
        self,
        max_pending: int | None = None,
        *,
        detect_deadlocks: bool = True,
        count_calls: bool = False,
        observer: QueueObserver | None = None,
        slow_turn: float | None = None,
    ) -> None:
        if max_pending is not None and (
            isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1
        ):
            raise ValueError(f"max_pending must be None or an int >= 1, got {max_pending!r}")
        self._max_pending = max_pending
        self._detect_deadlocks = detect_deadlocks
        self._count_calls = count_calls
        self._partitions: dict[asyncio.AbstractEventLoop, Partition] = {}
        # The last partition used; it carries its loop, so one read gives a consistent pair
        # even when threads with loops of their own share the queue.
        self._cached = Partition(None, detect_deadlocks, count_calls)
        self._switch_lock = threading.Lock()

    @property
    def max_pending(self) -> int | None:
        """The per-key bound on running plus waiting calls, or ``None``."""
        return self._max_pending

    # -- partitions -----------------------------------------------------------------------

    def _partition(self, loop: asyncio.AbstractEventLoop) -> Partition:
        part = self._cached
        if part.loop is loop:
            return part
        with self._switch_lock:
            part = self._partitions.get(loop)  # type: ignore[assignment]
            if part is None:
                # A closed loop never runs its tasks again: dropping its share keeps a later
                # loop unaffected by work it left registered, and frees what it held.
                drop_closed_loops(self._partitions)
                part = self._partitions[loop] = Partition(
                    loop, self._detect_deadlocks, self._count_calls
                )
            self._cached = part
        return part

    def _inspected(self) -> Partition:
        try:
            loop = get_running_loop()
        except RuntimeError:
            return self._cached
        return self._partition(loop)

    def _here(self) -> tuple[Partition, Task]:
        """The running loop's share and the current task (run and call inline this)."""
        loop = running_loop()
        part = self._partition(loop)
        task = task_of(loop)
        if task is None:
            raise _outside_task()
        return part, task

    async def _await_turn(self, part: Partition, key: Hashable, waiter: Waiter) -> None:
        try:
            await waiter
        except BaseException:
            part.give_up(key, waiter)
            raise
        part.take_turn(key, waiter, asyncio.current_task())  # type: ignore[arg-type]

    # -- running calls --------------------------------------------------------------------
    #
    # run() and call() share one body, written out twice because their signatures differ
    # and each path must avoid a second coroutine: an extra frame per call costs about
    # 50 ns and, while waiting, about 200 bytes. Keep the two bodies identical.

    async def run(
        self, key: Hashable, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs
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
        try:
            loop = get_running_loop()
        except RuntimeError:
            raise no_event_loop() from None
        part = self._cached
        if part.loop is not loop:
            part = self._partition(loop)
        task = task_of(loop)
        if task is None:
            raise _outside_task()
        try:
            holder = part.get(key)
        except Exception as exc:
            raise key_error(key, exc) from exc
        if holder is None:
            if part.closed:
                raise closed_error(key)
            part[key] = task  # the uncontended path: one dict entry, nothing else
        else:
            waiter = part.register(key, holder, task, timeout, self._max_pending)
            if waiter is None:  # re-entry: run inside the turn this task holds
                return await fn(*args, **kwargs)
            try:
                await waiter
            except BaseException:
                part.give_up(key, waiter)
                raise
            part.take_turn(key, waiter, task)
        try:
            if kwargs:
                return await fn(*args, **kwargs)
            return await fn(*args)  # type: ignore[call-arg]  # kwargs is empty; unpacking it costs
        except BaseException as exc:
            part.count_failure(exc)
            raise
        finally:
            try:
                held = part.pop(key)
            except Exception as exc:  # the key broke during the turn: never leave it stuck
                raise part.remove_broken(key, exc) from exc
            if held is not task or part.attention:
                part.end_turn(key, held, task)

    async def call(
        self,
        key: Hashable,
        fn: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None = None,
        group: Hashable | None = None,
    ) -> T:
        """Run ``await fn(*args, **kwargs)`` in ``key``'s turn: :meth:`run` with more options.

        ``timeout`` bounds only the wait for the turn: on expiry the built-in
        :class:`TimeoutError` is raised, ``fn`` never starts and the key is not
        left blocked. Once started, ``fn`` runs to completion.

        ``group`` makes the call coalescing (latest wins): when it has to wait,
        it supersedes the call of the same key and group that is still waiting,
        which then raises :class:`Superseded` and never starts. A call that has
        started is never interrupted; calls of other groups keep their places.

        Raises:
            TimeoutError: the turn did not come within ``timeout`` seconds.
            Superseded: a newer call of the same ``group`` replaced this one.
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
        try:
            loop = get_running_loop()
        except RuntimeError:
            raise no_event_loop() from None
        part = self._cached
        if part.loop is not loop:
            part = self._partition(loop)
        task = task_of(loop)
        if task is None:
            raise _outside_task()
        try:
            holder = part.get(key)
        except Exception as exc:
            raise key_error(key, exc) from exc
        if holder is None:
            if part.closed:
                raise closed_error(key)
            part[key] = task  # the uncontended path: one dict entry, nothing else
        else:
            waiter = part.register(key, holder, task, timeout, self._max_pending, group)
            if waiter is None:  # re-entry: run inside the turn this task holds
                return await fn(*args, **kwargs)
            try:
                await waiter
            except BaseException:
                part.give_up(key, waiter)
                raise
            part.take_turn(key, waiter, task)
        try:
            if kwargs:
                return await fn(*args, **kwargs)
            return await fn(*args)  # kwargs is empty: unpacking it costs measurably here
        except BaseException as exc:
            part.count_failure(exc)
            raise
        finally:
            try:
                held = part.pop(key)
            except Exception as exc:  # the key broke during the turn: never leave it stuck
                raise part.remove_broken(key, exc) from exc
            if held is not task or part.attention:
                part.end_turn(key, held, task)

    def submit(
        self, key: Hashable, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs
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
        loop = running_loop()
        part = self._partition(loop)
        if part.closed:
            raise closed_error(key)
        try:
            holder = part.get(key)
        except Exception as exc:
            raise key_error(key, exc) from exc
        if holder is None:
            # The task may start eagerly inside create_task, so the turn is reserved first.
            part[key] = KeyState(GRANTED)
            waiter: Waiter | None = granted_waiter(part, key)
        else:
            waiter = part.register(key, holder, NEW_TASK, None, self._max_pending)
        assert waiter is not None  # a task that does not exist yet holds nothing
        submission = _Submission(self, part, key, waiter)
        coroutine = cast("CoroutineType[Any, Any, T]", submission.execute(fn, args, kwargs))
        coroutine.__qualname__ = getattr(fn, "__qualname__", coroutine.__qualname__)
        task = loop.create_task(coroutine)
        task.add_done_callback(submission.withdraw_if_unstarted)
        return task

    def lock(
        self, key: Hashable, timeout: float | None = None, group: Hashable | None = None
    ) -> KeyLock:
        """Hold ``key``'s turn for the body of an ``async with`` block.

        The block registers when it is entered. ``timeout`` bounds only the
        wait for the turn; entering from the task that already holds ``key``
        does not wait and does not release the outer turn on exit. ``group``
        coalesces as for :meth:`call`.

        Raises:
            TimeoutError: the turn did not come within ``timeout`` seconds.
            Superseded: a newer block of the same ``group`` replaced this one.
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
        return _KeyLock(self, key, timeout, group)

    # -- several keys at once ---------------------------------------------------------------

    def _entered(self, keys: Iterable[Hashable]) -> tuple[Partition, Task, tuple[Hashable, ...]]:
        """The running loop's share, the current task and ``keys`` checked and deduplicated."""
        part, task = self._here()
        if isinstance(keys, (str, bytes)):
            raise TypeError(f"keys must be an iterable of keys, not a single {type(keys).__name__}")
        unique: dict[Hashable, None] = {}
        for key in keys:
            try:
                unique[key] = None
            except Exception as exc:
                raise key_error(key, exc) from exc
        if not unique:
            raise ValueError("a multi-key call needs at least one key")
        return part, task, tuple(unique)

    async def _acquire_all(
        self, keys: Iterable[Hashable], timeout: float | None
    ) -> tuple[Partition, MultiRegistration]:
        part, task, unique = self._entered(keys)
        registration = part.register_all(unique, task, timeout, self._max_pending)
        if registration.turn is not None and registration.turn.missing:
            try:
                await registration.turn.future
            except BaseException:
                part.give_up_all(registration)
                raise
        part.take_all(registration)
        return part, registration

    async def run_all(
        self,
        keys: Iterable[Hashable],
        fn: Callable[P, Awaitable[T]],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> T:
        """Run ``await fn(*args, **kwargs)`` once it holds the turns of all ``keys``.

        The call registers in every key's queue in one step, so multi-key calls
        that name the same keys in different orders cannot deadlock each other,
        and single-key calls on any of the keys keep their order with it.
        Duplicate keys count once. Keys that the calling task already holds
        (inside their turns) are not waited for.

        Raises:
            ValueError: ``keys`` is empty.
            TypeError: ``keys`` is a string, or one of them is not hashable.
            DeadlockError: waiting would close a cycle of tasks waiting on each other.
            QueueClosed, QueueFull, RuntimeError: as for :meth:`run` (for any of the keys).

        Example:
            >>> import asyncio
            >>> from keyserial import KeyedSerialQueue
            >>> async def merge(src: str, dst: str) -> str:
            ...     return f"{src} -> {dst}"
            >>> asyncio.run(KeyedSerialQueue().run_all(["a", "b"], merge, "a", "b"))
            'a -> b'
        """
        part, registration = await self._acquire_all(keys, None)
        error: BaseException | None = None
        try:
            return await fn(*args, **kwargs)
        except BaseException as exc:
            error = exc
            raise
        finally:
            part.count_end(error)
            part.leave_all(registration, task_of(part.loop))  # type: ignore[arg-type]

    def lock_all(self, keys: Iterable[Hashable], timeout: float | None = None) -> KeyLock:
        """Hold the turns of all ``keys`` for the body of an ``async with`` block.

        As :meth:`run_all`; ``timeout`` bounds only the wait for the turns.

        Raises:
            TimeoutError: the turns did not all come within ``timeout`` seconds.
            ValueError: ``keys`` is empty, or ``timeout`` is negative.
            TypeError, DeadlockError, QueueClosed, QueueFull: as for :meth:`run_all`.

        Example:
            >>> import asyncio
            >>> from keyserial import KeyedSerialQueue
            >>> async def main() -> list[bool]:
            ...     queue = KeyedSerialQueue()
            ...     async with queue.lock_all(["a", "b"]):
            ...         return [queue.locked("a"), queue.locked("b")]
            >>> asyncio.run(main())
            [True, True]
        """
        _check_timeout(timeout)
        return _KeysLock(self, keys, timeout)

    # -- inspection and shutdown ----------------------------------------------------------

    def pending(self, key: Hashable) -> int:
        """Running plus waiting calls for ``key`` in the running loop's share (0 if unknown).

        Example:
            >>> from keyserial import KeyedSerialQueue
            >>> KeyedSerialQueue().pending("nobody")
            0
        """
        try:
            return self._inspected().pending_of(key)
        except Exception as exc:
            raise key_error(key, exc) from exc

    def locked(self, key: Hashable) -> bool:
        """Whether ``key``'s turn is currently held (granted to a call).

        Example:
            >>> from keyserial import KeyedSerialQueue
            >>> KeyedSerialQueue().locked("nobody")
            False
        """
        try:
            return self._inspected().holder_of(key) is not None
        except Exception as exc:
            raise key_error(key, exc) from exc

    def stats(self) -> QueueStats:
        """An immutable snapshot of the running loop's share: current load and cumulative counts.

        Counts are of turns (a re-entrant call runs inside its caller's turn and
        is not counted). ``started`` and ``completed`` are ``None`` unless the
        queue was made with ``count_calls=True``; the other counts are always
        kept. ``longest_wait`` is exact. ``longest_running`` is exact
        for turns handed over from a waiting call; a turn that began while no
        one waited is timed from when the first call queued behind it — how long
        it has been keeping others waiting — unless the queue has an observer or
        a ``slow_turn`` threshold, which time every turn.

        Example:
            >>> from keyserial import KeyedSerialQueue
            >>> KeyedSerialQueue().stats().waiting
            0
            >>> print(KeyedSerialQueue().stats().started)
            None
            >>> KeyedSerialQueue(count_calls=True).stats().started
            0
        """
        return snapshot(self._inspected(), time.monotonic())

    def __len__(self) -> int:
        """Number of keys with registered work in the running loop's share."""
        return len(self._inspected())

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` has registered work in the running loop's share."""
        try:
            return key in self._inspected()
        except Exception:
            return False  # a key that cannot be hashed or compared has no work registered

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
        part = self._partition(running_loop())
        if not part:
            return
        idle: asyncio.Future[None] = part.loop.create_future()  # type: ignore[union-attr]
        part.idle_waiters.append(idle)
        part.attention = True
        try:
            await idle
        except BaseException:
            part.forget_idle_waiter(idle)  # cancelled or timed out: leave nothing behind
            raise

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
        self._partition(running_loop()).closed = True
        await self.join()

    def __repr__(self) -> str:
        part = self._inspected()
        state = "closed" if part.closed else "open"
        return f"<KeyedSerialQueue {state} keys={len(part)} max_pending={self._max_pending}>"


class _Submission:
    """The registration made by ``submit``, and its withdrawal if the task never starts."""

    __slots__ = ("key", "part", "queue", "started", "waiter")

    def __init__(
        self, queue: KeyedSerialQueue, part: Partition, key: Hashable, waiter: Waiter
    ) -> None:
        self.queue = queue
        self.part = part
        self.key = key
        self.waiter = waiter
        self.started = False

    async def execute(
        self, fn: Callable[..., Awaitable[T]], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> T:
        self.started = True
        queue, part, key = self.queue, self.part, self.key
        waiter = self.waiter
        if not waiter.done() and part.detect_deadlocks:
            # Checked now rather than in submit(): by its first step, a holder that submitted
            # this task may already be awaiting it, which is a cycle.
            task: Task = asyncio.current_task()  # type: ignore[assignment]
            try:
                recheck = check_no_cycle(part, task, (key,))
            except DeadlockError:
                part.give_up(key, waiter)
                raise
            if recheck:
                check_later(part, task, (key,), waiter, waiter.set_result)
        await queue._await_turn(part, key, waiter)
        error: BaseException | None = None
        try:
            return await fn(*args, **kwargs)
        except BaseException as exc:
            error = exc
            raise
        finally:
            part.count_end(error)
            try:
                state = part[key]
            except Exception as exc:  # the key broke during the turn: never leave it stuck
                raise part.remove_broken(key, exc) from exc
            part.release(key, state)  # type: ignore[arg-type]

    def withdraw_if_unstarted(self, task: asyncio.Task[Any]) -> None:
        # A task cancelled before its first step never runs execute()'s cleanup.
        if not self.started:
            self.part.give_up(self.key, self.waiter)


class _KeyLock:
    """The async context manager returned by :meth:`KeyedSerialQueue.lock`."""

    __slots__ = ("_fence_token", "_group", "_key", "_part", "_queue", "_task", "_timeout")

    def __init__(
        self, queue: KeyedSerialQueue, key: Hashable, timeout: float | None, group: Hashable | None
    ) -> None:
        self._queue = queue
        self._key = key
        self._timeout = timeout
        self._group = group
        self._part: Partition | None = None
        self._task: Task | None = None
        self._fence_token: Token[Any] | None = None

    async def __aenter__(self) -> None:
        if self._part is not None:
            raise RuntimeError("a keyserial lock() object cannot be entered twice at once")
        queue, key = self._queue, self._key
        part, task = queue._here()
        try:
            holder = part.get(key)
        except Exception as exc:
            raise key_error(key, exc) from exc
        if holder is None:
            if part.closed:
                raise closed_error(key)
            part[key] = task
        else:
            waiter = part.register(
                key, holder, task, self._timeout, queue._max_pending, self._group
            )
            if waiter is None:
                return  # re-entry: the outer turn stays in charge of releasing
            await queue._await_turn(part, key, waiter)
        self._part, self._task = part, task
        owner = sys._getframe(1)  # the coroutine running the ``async with`` block
        self._fence_token = enter_lock_block(owner, lambda: part.fence_for((key,)))

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        part, task = self._part, self._task
        if part is not None and task is not None:
            self._part = self._task = None
            if self._fence_token is not None:
                exit_lock_block(self._fence_token)
                self._fence_token = None
            part.count_end(exc)
            part.leave(self._key, task)


class _KeysLock:
    """The async context manager returned by :meth:`KeyedSerialQueue.lock_all`."""

    __slots__ = ("_fence_token", "_held", "_keys", "_queue", "_timeout")

    def __init__(
        self, queue: KeyedSerialQueue, keys: Iterable[Hashable], timeout: float | None
    ) -> None:
        self._queue = queue
        self._keys = keys
        self._timeout = timeout
        self._held: tuple[Partition, MultiRegistration] | None = None
        self._fence_token: Token[Any] | None = None

    async def __aenter__(self) -> None:
        if self._held is not None:
            raise RuntimeError("a keyserial lock_all() object cannot be entered twice at once")
        self._held = part, registration = await self._queue._acquire_all(self._keys, self._timeout)
        owner = sys._getframe(1)  # the coroutine running the ``async with`` block
        self._fence_token = enter_lock_block(owner, lambda: part.fence_for(registration.keys))

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._held is not None:
            part, registration = self._held
            self._held = None
            if self._fence_token is not None:
                exit_lock_block(self._fence_token)
                self._fence_token = None
            part.count_end(exc)
            part.leave_all(registration, task_of(part.loop))  # type: ignore[arg-type]


def _single_key_fence(frame: Mapping[str, Any]) -> int | None:
    return frame["part"].fence_for((frame["key"],))  # type: ignore[no-any-return]


def _multi_key_fence(frame: Mapping[str, Any]) -> int | None:
    return frame["part"].fence_for(frame["registration"].keys)  # type: ignore[no-any-return]


# Frames of these methods run a turn: current_fence() finds them on the task's await chain.
register_turn_code(KeyedSerialQueue.run.__code__, _single_key_fence)
register_turn_code(KeyedSerialQueue.call.__code__, _single_key_fence)
register_turn_code(_Submission.execute.__code__, _single_key_fence)
register_turn_code(KeyedSerialQueue.run_all.__code__, _multi_key_fence)

for _code in (
    KeyedSerialQueue.run.__code__,
    KeyedSerialQueue.call.__code__,
    KeyedSerialQueue.run_all.__code__,
    _Submission.execute.__code__,
):
    register_entry_code(_code)
