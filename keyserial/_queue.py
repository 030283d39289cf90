"""The in-process keyed serial queue, in one class: its public methods and the hot path.

The work behind them lives in the modules they call: registration and hand-off in
``_share``, several keys in ``_multikey``, ``lock`` blocks in ``_locks``, ``submit`` in
``_submit``, loop routing in ``_loops``, wait options in ``_options``."""

from __future__ import annotations

import asyncio
from asyncio import Future
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Iterable
from inspect import isawaitable
from threading import get_ident
from typing import Any, ParamSpec, TypeVar

from ._asyncio_internals import EAGER_TASKS, is_blocked_task, loop_task_factory, loop_thread_id
from ._errors import (
    call_error,
    called,
    check_function,
    key_error,
    not_awaitable,
)
from ._locks import SingleKeyLock
from ._loops import (
    LoopShares,
    get_running_loop,
    no_event_loop,
    on_closed_share,
    outside_task,
    running_loop,
    task_of,
)
from ._multikey import MultiKeyLock, acquire_all, leave_all
from ._observation import ObservedLock, QueueObserver, Watching
from ._options import MultiKeyWaitOptions, deprecated_call
from ._protocols import KeyLock
from ._records import KeyState
from ._share import KeysFence, LoopShare
from ._stats import QueueStats, snapshot
from ._submit import submit
from ._turns import RUNNING, enter_turn, leave_turn, restore

T = TypeVar("T")
P = ParamSpec("P")

Task = asyncio.Task[Any]

UNCALLED: Any = object()  # fn was not called: nothing it returned to blame


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
            would exceed it raises [QueueFull][keyserial.QueueFull] at once. ``None`` means
            unbounded.
        detect_deadlocks: check, whenever a call must wait, that the wait does
            not close a cycle of tasks waiting on each other, and raise
            [DeadlockError][keyserial.DeadlockError] instead of hanging. Only waiting calls pay.
        count_calls: count every turn, so that
            [stats][keyserial.KeyedSerialQueue.stats] reports ``started`` and
            ``completed``. Off by default: the count makes every uncontended
            call dearer (see docs/performance.md). Failures, cancellations, timeouts,
            rejections and supersessions are counted either way.
        observer: a [QueueObserver][keyserial.QueueObserver] told of every call's registration,
            start (with time waited) and finish (with time run and outcome).
        slow_turn: seconds; a turn running longer logs one warning through the
            ``keyserial`` logger, naming the key and the function.

    Raises:
        ValueError: ``max_pending`` is not ``None`` or an int >= 1, or
            ``slow_turn`` is not ``None`` or a number > 0.

    Example:
        ```pycon
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

        ```
    """

    __slots__ = ("_max_pending", "_shares", "_unwatched", "_watching")

    def __init__(
        self,
        max_pending: int | None = None,
        *,
        detect_deadlocks: bool = True,
        count_calls: bool = False,
        observer: QueueObserver | None = None,
        slow_turn: float | None = None,
    ) -> None:
        bad = isinstance(max_pending, bool) or not isinstance(max_pending, (int, type(None)))
        if bad or (max_pending is not None and max_pending < 1):
            raise ValueError(f"max_pending must be None or an int >= 1, got {max_pending!r}")
        if slow_turn is not None and not slow_turn > 0:
            raise ValueError(f"slow_turn must be None or a number > 0, got {slow_turn!r}")
        self._max_pending = max_pending
        self._shares = LoopShares(detect_deadlocks, count_calls)
        # An observed queue (observer or slow_turn): every entry point watches the call and
        # runs it through _unwatched, this same queue (same shares) without the watching.
        self._watching: Watching | None = None
        self._unwatched = self
        if observer is not None or slow_turn is not None:
            unwatched = object.__new__(KeyedSerialQueue)
            unwatched._max_pending, unwatched._shares = max_pending, self._shares
            unwatched._watching, unwatched._unwatched = None, unwatched
            self._watching, self._unwatched = Watching(observer, slow_turn), unwatched

    @property
    def max_pending(self) -> int | None:
        """The per-key bound on running plus waiting calls, or ``None``."""
        return self._max_pending

    def with_options(
        self, *, timeout: float | None = None, group: Hashable | None = None
    ) -> MultiKeyWaitOptions:
        """This queue's ``run``, ``submit``, ``lock``, ``run_all`` and ``lock_all``, each with
        ``timeout`` bounding the wait for the turn (``0``: try once, never wait); keyword
        arguments still go to the function. See [WaitOptions][keyserial.WaitOptions].

        ``group`` makes the view's single-key calls coalescing (latest wins): a call that
        has to wait supersedes the call of the same key and group that is still waiting,
        which then raises [Superseded][keyserial.Superseded] and never starts. A call that
        has started is never interrupted; calls of other groups keep their places.
        ``@serialized(coalesce=True)`` gives each function a group of its own.

        Raises:
            ValueError: ``timeout`` is negative or not a number.
            TypeError: ``group`` is not hashable.

        Example:
            ```pycon
            >>> import asyncio
            >>> from keyserial import KeyedSerialQueue
            >>> async def save(seg_id: str, *, text: str) -> str:
            ...     return f"{seg_id}:{text}"
            >>> timed = KeyedSerialQueue().with_options(timeout=5)
            >>> asyncio.run(timed.run("s1", save, "s1", text="hi"))
            's1:hi'

            ```
        """
        return MultiKeyWaitOptions(
            self,
            call=self._call,
            submit=self._submit,
            lock=self.lock,
            lock_all=self.lock_all,
            timeout=timeout,
            group=group,
        )

    # -- inspecting and closing ----------------------------------------------------------

    def pending(self, key: Hashable) -> int:
        """Running plus waiting calls for ``key`` in the running loop's share (0 if unknown).

        Example:
            ```pycon
            >>> from keyserial import KeyedSerialQueue
            >>> KeyedSerialQueue().pending("nobody")
            0

            ```
        """
        try:
            return self._shares.inspected().pending_of(key)
        except Exception as exc:
            raise key_error(key, exc) from exc

    def locked(self, key: Hashable) -> bool:
        """Whether ``key``'s turn is currently held (granted to a call).

        Example:
            ```pycon
            >>> from keyserial import KeyedSerialQueue
            >>> KeyedSerialQueue().locked("nobody")
            False

            ```
        """
        try:
            return self._shares.inspected().holder_of(key) is not None
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
            ```pycon
            >>> from keyserial import KeyedSerialQueue
            >>> KeyedSerialQueue().stats().waiting
            0
            >>> print(KeyedSerialQueue().stats().started)
            None
            >>> KeyedSerialQueue(count_calls=True).stats().started
            0

            ```
        """
        share = self._shares.inspected()
        now = share.loop.time() if share.loop is not None else 0.0
        stats = snapshot(share.holders, share.counts, now)
        if self._watching is not None:  # every running turn is timed: exact longest_running
            return self._watching.with_longest_running(stats, share.loop)
        return stats

    def __len__(self) -> int:
        """Number of keys with registered work in the running loop's share."""
        return len(self._shares.inspected().holders)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` has registered work in the running loop's share."""
        try:
            return key in self._shares.inspected().holders
        except Exception:
            return False  # a key that cannot be hashed or compared has no work registered

    @property
    def closed(self) -> bool:
        """Whether [aclose][keyserial.KeyedSerialQueue.aclose] was called (for the running loop)."""
        return self._shares.inspected().closed

    async def join(self) -> None:
        """Wait until no work is registered; work registered while waiting is waited for too.

        Example:
            ```pycon
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

            ```
        """
        loop = running_loop()
        share = self._shares.of(loop)
        if not share.holders:
            return
        idle: asyncio.Future[None] = loop.create_future()
        share.idle_waiters.append(idle)
        share.attention = True
        try:
            await idle
        except BaseException:
            share.forget_idle_waiter(idle)  # cancelled or timed out: leave nothing behind
            raise

    async def aclose(self) -> None:
        """Refuse new work with [QueueClosed][keyserial.QueueClosed], then wait for registered work.

        Closing applies to the running event loop's share of the queue. Calls
        already registered, and re-entrant calls made inside their turns, still run.

        Example:
            ```pycon
            >>> import asyncio
            >>> from keyserial import KeyedSerialQueue
            >>> async def main() -> bool:
            ...     queue = KeyedSerialQueue()
            ...     await queue.aclose()
            ...     return queue.closed
            >>> asyncio.run(main())
            True

            ```
        """
        self._shares.close(running_loop())
        await self.join()

    def __repr__(self) -> str:
        share = self._shares.inspected()
        state = "closed" if share.closed else "open"
        keys = len(share.holders)
        return f"<KeyedSerialQueue {state} keys={keys} max_pending={self._max_pending}>"

    # -- several keys, blocks and tasks of their own ----------------------------------------

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
            QueueClosed, QueueFull, RuntimeError: as for
                [run][keyserial.KeyedSerialQueue.run] (for any of the keys).

        Example:
            ```pycon
            >>> import asyncio
            >>> from keyserial import KeyedSerialQueue
            >>> async def merge(src: str, dst: str) -> str:
            ...     return f"{src} -> {dst}"
            >>> asyncio.run(KeyedSerialQueue().run_all(["a", "b"], merge, "a", "b"))
            'a -> b'

            ```
        """
        check_function(fn, "run_all")
        if self._watching is not None:  # an observed queue: the same body, watched
            keys = tuple(keys)
            return await self._watching.watched_run(self._unwatched.run_all, keys, fn, args, kwargs)
        share, task = self._shares.running()
        registration = await acquire_all(share, task, keys, None, self._max_pending)
        record = enter_turn(task, KeysFence(share), registration.keys, fn)
        error: BaseException | None = None
        try:
            return await called(fn, args, kwargs)
        except BaseException as exc:
            error = exc
            raise
        finally:
            leave_turn(task, record)
            share.counts.end(error)
            leave_all(share, registration, task)

    def lock_all(self, keys: Iterable[Hashable], timeout: float | None = None) -> KeyLock:
        """Hold the turns of all ``keys`` for the body of an ``async with`` block.

        As [run_all][keyserial.KeyedSerialQueue.run_all]; ``timeout`` bounds only the wait for
        the turns.

        Raises:
            TimeoutError: the turns did not all come within ``timeout`` seconds.
            ValueError: ``keys`` is empty, or ``timeout`` is negative.
            TypeError, DeadlockError, QueueClosed, QueueFull: as for
                [run_all][keyserial.KeyedSerialQueue.run_all].

        Example:
            ```pycon
            >>> import asyncio
            >>> from keyserial import KeyedSerialQueue
            >>> async def main() -> list[bool]:
            ...     queue = KeyedSerialQueue()
            ...     async with queue.lock_all(["a", "b"]):
            ...         return [queue.locked("a"), queue.locked("b")]
            >>> asyncio.run(main())
            [True, True]

            ```
        """
        if self._watching is not None:
            keys = tuple(keys)
            return ObservedLock(self._watching, keys, self._unwatched.lock_all(keys, timeout))
        return MultiKeyLock(self._shares, keys, timeout, self._max_pending)

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
            ```pycon
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

            ```
        """
        check_function(fn, "submit")
        return self._submit(key, fn, args, kwargs, None, None)

    def _submit(
        self,
        key: Hashable,
        fn: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None,
        group: Hashable | None,
    ) -> asyncio.Task[T]:
        if self._watching is not None:  # an observed queue: the same body, watched
            return self._watching.watched_submit(
                self._unwatched._submit, key, fn, args, kwargs, timeout, group
            )
        share = self._shares.of(running_loop())
        return submit(share, key, fn, args, kwargs, self._max_pending, timeout, group)

    def lock(
        self, key: Hashable, timeout: float | None = None, group: Hashable | None = None
    ) -> KeyLock:
        """Hold ``key``'s turn for the body of an ``async with`` block.

        The block registers when it is entered. ``timeout`` bounds only the
        wait for the turn; entering from the task that already holds ``key``
        does not wait and does not release the outer turn on exit. ``group``
        coalesces as for [with_options][keyserial.KeyedSerialQueue.with_options]; both are
        the same as ``queue.with_options(timeout=..., group=...).lock(key)``.

        Raises:
            TimeoutError: the turn did not come within ``timeout`` seconds.
            Superseded: a newer block of the same ``group`` replaced this one.
            QueueClosed, QueueFull, TypeError, RuntimeError: as for
                [run][keyserial.KeyedSerialQueue.run].
            ValueError: ``timeout`` is negative.

        Example:
            ```pycon
            >>> import asyncio
            >>> from keyserial import KeyedSerialQueue
            >>> async def main() -> bool:
            ...     queue = KeyedSerialQueue()
            ...     async with queue.lock("seg-1", timeout=5):
            ...         return queue.locked("seg-1")
            >>> asyncio.run(main())
            True

            ```
        """
        if self._watching is not None:
            return ObservedLock(self._watching, key, self._unwatched.lock(key, timeout, group))
        return SingleKeyLock(self._shares, key, timeout, group, self._max_pending)

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
            ```pycon
            >>> import asyncio
            >>> from keyserial import KeyedSerialQueue
            >>> async def double(x: int) -> int:
            ...     return 2 * x
            >>> asyncio.run(KeyedSerialQueue().run("k", double, 21))
            42

            ```
        """
        # The turn and the wait are recorded in keyserial._turns (RUNNING): that is all that
        # current_fence(), the deadlock check and stats() read of this call.
        if not callable(fn):
            check_function(fn, "run")
        if self._watching is not None:  # an observed queue: the same body, watched
            return await self._watching.watched_run(self._unwatched.run, key, fn, args, kwargs)
        share = self._shares.cached
        loop = share.quick_loop  # see _asyncio_internals.FIND_LOOP_BY_THREAD
        if loop is None or loop_thread_id(loop) != get_ident():
            try:
                loop = get_running_loop()
            except RuntimeError:
                raise no_event_loop() from None
            if share.open_loop is not loop:  # another loop's share, or a closed one
                share = self._shares.of(loop)
                if share.closed:
                    return await on_closed_share(share, key, fn, args, kwargs)
        task = task_of(loop)
        if task is None:
            raise outside_task()
        holders = share.holders
        try:
            # A membership test is cheaper than a get() call when the key is free (the usual case).
            holder = holders[key] if key in holders else None  # noqa: SIM401
        except Exception as exc:
            raise key_error(key, exc) from exc
        # The call's record (see keyserial._turns), written out here: its turn's, or first
        # its wait's, which becomes its turn's when the turn comes.
        running = RUNNING
        # A membership test is cheaper than a get() call when the task holds no turn yet.
        outer = running[task] if task in running else None  # noqa: SIM401
        if holder is None:
            holders[key] = task  # the uncontended path: one dict entry, nothing else
            running[task] = (outer, share, key, fn)
        else:
            if (  # anything but the commonest case goes to register(): see quick_waits
                type(holder) is not KeyState
                or not share.quick_waits
                or holder.holder is task
                or is_blocked_task(holder.holder)  # not running
                or (EAGER_TASKS and loop_task_factory(loop) is not None)
                or self._max_pending is not None
            ):
                waiter = share.register(key, holder, task, None, self._max_pending, None, fn)
                if waiter is None:  # re-entry: run inside the turn this task holds
                    return await reentered(share, task, key, fn, args, kwargs)
            else:  # queued as register() would, a frame fewer (no new local)
                waiter = share.new_future()
                holder.pending += 1
                holder.waiters.append(waiter)
            running[task] = (outer, share, key, fn, waiter, share.clock())
            try:
                granted = await waiter
            except BaseException:
                restore(task, outer)
                share.give_up(key, waiter)
                raise
            if granted is True and type(waiter) is Future:  # take_turn, without its frame
                state: KeyState = holders[key]  # type: ignore[assignment]
                state.holder, state.since = task, share.clock()
            else:
                try:
                    share.take_turn(key, waiter, task)
                except BaseException:  # refused after the wait (a key that broke, a cycle)
                    restore(task, outer)
                    raise
        result: Any = UNCALLED  # what fn returned, for the error if it cannot be awaited
        try:
            if kwargs:
                result = fn(*args, **kwargs)
            elif args:
                result = fn(*args)  # type: ignore[call-arg]  # kwargs is empty; unpacking it costs
            else:
                # A plain call makes fn's coroutine in this interpreter loop; an unpacking
                # one goes through the C call protocol.
                result = fn()  # type: ignore[call-arg]  # args and kwargs are empty
            return await result  # type: ignore[no-any-return]
        except BaseException as exc:
            share.counts.failure(exc)
            if type(exc) is TypeError and result is not UNCALLED and not isawaitable(result):
                raise not_awaitable(fn, result) from None
            if type(exc) is TypeError and result is UNCALLED and kwargs:
                error = call_error(fn, exc, kwargs)  # fn refused a keyword: a wait option?
                if error is not exc:
                    raise error from exc
            raise
        finally:
            if outer is None:  # keyserial._turns.leave_turn, written out here
                del running[task]
            else:
                restore(task, outer)
            try:
                held = holders.pop(key)
            except Exception as exc:  # the key broke during the turn: never leave it stuck
                raise share.remove_broken(key, exc) from exc
            if share.attention:
                share.end_turn(key, held, task)
            elif held is not task:  # a contended turn: hand it on
                share.release(key, held)  # type: ignore[arg-type]

    async def _call(
        self,
        key: Hashable,
        fn: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None,
        group: Hashable | None,
    ) -> T:
        """``run`` with options (``with_options``): the turn of a ``lock()`` block."""
        if self._watching is not None:  # an observed queue: the same body, watched
            return await self._watching.watched_call(
                self._unwatched._call, key, fn, args, kwargs, timeout, group
            )
        async with SingleKeyLock(self._shares, key, timeout, group, self._max_pending, fn):
            return await called(fn, args, kwargs)

    def call(
        self,
        key: Hashable,
        fn: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None = None,
        group: Hashable | None = None,
    ) -> Coroutine[Any, Any, T]:
        """Deprecated: ``queue.with_options(timeout=..., group=...).run(key, fn, *args, **kwargs)``.

        Warns:
            DeprecationWarning: always; the call then runs as ``with_options(...).run``.
        """
        return deprecated_call(self, key, fn, args, kwargs, timeout, group)


async def reentered(
    share: LoopShare,
    task: asyncio.Task[Any],
    key: Hashable,
    fn: Callable[..., Awaitable[T]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> T:
    """Run ``fn`` inside the turn of ``key`` that ``task`` already holds (re-entry)."""
    record = enter_turn(task, share, key, fn)
    try:
        return await called(fn, args, kwargs)
    finally:
        leave_turn(task, record)


_DEFAULT_QUEUE = KeyedSerialQueue()


def default_queue() -> KeyedSerialQueue:
    """Return the process-wide queue shared by every ``@serialized`` function given no ``queue``.

    Like every [KeyedSerialQueue][keyserial.KeyedSerialQueue], it behaves as if each event loop had
    its own queue: work, keys and the closed state of one loop never affect
    another, so ``asyncio.run`` after ``asyncio.run`` (or a test framework's
    loop per test) starts from a clean queue.

    Example:
        ```pycon
        >>> from keyserial import default_queue
        >>> default_queue() is default_queue()
        True

        ```
    """
    return _DEFAULT_QUEUE
