"""The in-process keyed serial queue, in one class: its public methods and the hot path.

The work behind them lives in the modules they call: registration and hand-off in
``_share``, several keys in ``_multikey``, ``lock`` blocks in ``_locks``, ``submit`` in
``_submit``, loop routing in ``_loops``, wait options in ``_options``."""

from __future__ import annotations

import asyncio
import dataclasses
from _thread import get_ident
from asyncio import Future
from collections.abc import Awaitable, Callable, Hashable, Iterable, Mapping
from inspect import isawaitable
from typing import Any, ParamSpec, TypeVar

from ._deadlock import register_entry_code, register_waiting_code
from ._errors import (
    awaitable_result,
    check_function,
    key_error,
    not_awaitable,
)
from ._fence import register_fence_reader
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
from ._observation import ObservedLock, QueueObserver, Watch, Watching, function_name
from ._options import MultiKeyWaitOptions, deprecated_call
from ._protocols import KeyLock
from ._records import KeyState
from ._stats import QueueStats, snapshot
from ._submit import Submission, submit

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

    __slots__ = ("_max_pending", "_shares")

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
            # Only an observed queue times calls: a plain queue's hot path stays untouched.
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
        bad = isinstance(max_pending, bool) or not isinstance(max_pending, (int, type(None)))
        if bad or (max_pending is not None and max_pending < 1):
            raise ValueError(f"max_pending must be None or an int >= 1, got {max_pending!r}")
        self._max_pending = max_pending
        self._shares = LoopShares(detect_deadlocks, count_calls)

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
        return snapshot(share.holders, share.counts, now)

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
        share, task = self._shares.running()
        registration = await acquire_all(share, task, keys, None, self._max_pending)
        error: BaseException | None = None
        try:
            return await awaitable_result(fn, fn(*args, **kwargs))
        except BaseException as exc:
            error = exc
            raise
        finally:
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
        # A contract with code that reads this frame (registered at the end of this module):
        # the locals ``share``, ``key``, ``fn``, ``waiter`` and ``since`` are read by name by
        # current_fence(), the deadlock check and stats(). Renaming one breaks them; the
        # fence, deadlock and stats tests say so.
        if not callable(fn):
            check_function(fn, "run")
        share = self._shares.cached
        loop = share.thread_loop  # None but where the thread tells the loop (see LoopShares.of)
        if loop is None or loop._thread_id != get_ident():  # type: ignore[attr-defined]
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
        if holder is None:
            holders[key] = task  # the uncontended path: one dict entry, nothing else
        else:
            if (  # anything but the commonest case goes to register(): see quick_waits
                type(holder) is not KeyState
                or not share.quick_waits
                or holder.holder is task
                or getattr(holder.holder, "_fut_waiter", True) is not None  # not running
                or loop._task_factory is not None  # type: ignore[attr-defined]
                or self._max_pending is not None
            ):
                waiter = share.register(key, holder, task, None, self._max_pending)
                if waiter is None:  # re-entry: run inside the turn this task holds
                    return await awaitable_result(fn, fn(*args, **kwargs))
            else:  # queued as register() would, a frame fewer (no new local)
                waiter = share.new_future()
                holder.pending += 1
                holder.waiters.append(waiter)
            since = share.clock()  # noqa: F841  # pyright: ignore[reportUnusedVariable]
            try:
                granted = await waiter
            except BaseException:
                share.give_up(key, waiter)
                raise
            if granted is True and type(waiter) is Future:  # take_turn, without its frame
                state: KeyState = holders[key]  # type: ignore[assignment]
                state.holder, state.since = task, share.clock()
            else:
                share.take_turn(key, waiter, task)
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
            raise
        finally:
            try:
                held = holders.pop(key)
            except Exception as exc:  # the key broke during the turn: never leave it stuck
                raise share.remove_broken(key, exc) from exc
            if share.attention:
                share.end_turn(key, held, task)
            elif held is not task:  # a contended turn: hand it on
                share.release(key, held)  # type: ignore[arg-type]

    async def _run_packed(
        self,
        key: Hashable,
        fn: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> T:
        """``run(key, fn, *args, **kwargs)`` with the arguments as the decorator holds them.

        A deliberate copy of ``run``'s body (benchmarks: the decorated rows): unpacking the
        decorator's arguments into ``run`` and packing them again costs every decorated call
        more than the copy costs a reader. tests/test_twins.py keeps the two bodies identical,
        and the behaviour suites run over both (tests/conftest.py).
        """
        # A contract with code that reads this frame (registered at the end of this module):
        # the locals ``share``, ``key``, ``fn``, ``waiter`` and ``since`` are read by name by
        # current_fence(), the deadlock check and stats(). Renaming one breaks them; the
        # fence, deadlock and stats tests say so.
        if not callable(fn):
            check_function(fn, "run")
        share = self._shares.cached
        loop = share.thread_loop  # None but where the thread tells the loop (see LoopShares.of)
        if loop is None or loop._thread_id != get_ident():  # type: ignore[attr-defined]
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
        if holder is None:
            holders[key] = task  # the uncontended path: one dict entry, nothing else
        else:
            if (  # anything but the commonest case goes to register(): see quick_waits
                type(holder) is not KeyState
                or not share.quick_waits
                or holder.holder is task
                or getattr(holder.holder, "_fut_waiter", True) is not None  # not running
                or loop._task_factory is not None  # type: ignore[attr-defined]
                or self._max_pending is not None
            ):
                waiter = share.register(key, holder, task, None, self._max_pending)
                if waiter is None:  # re-entry: run inside the turn this task holds
                    return await awaitable_result(fn, fn(*args, **kwargs))
            else:  # queued as register() would, a frame fewer (no new local)
                waiter = share.new_future()
                holder.pending += 1
                holder.waiters.append(waiter)
            since = share.clock()  # noqa: F841  # pyright: ignore[reportUnusedVariable]
            try:
                granted = await waiter
            except BaseException:
                share.give_up(key, waiter)
                raise
            if granted is True and type(waiter) is Future:  # take_turn, without its frame
                state: KeyState = holders[key]  # type: ignore[assignment]
                state.holder, state.since = task, share.clock()
            else:
                share.take_turn(key, waiter, task)
        result: Any = UNCALLED  # what fn returned, for the error if it cannot be awaited
        try:
            if kwargs:
                result = fn(*args, **kwargs)
            elif args:
                result = fn(*args)  # kwargs is empty; unpacking it costs
            else:
                # A plain call makes fn's coroutine in this interpreter loop; an unpacking
                # one goes through the C call protocol.
                result = fn()  # args and kwargs are empty
            return await result  # type: ignore[no-any-return]
        except BaseException as exc:
            share.counts.failure(exc)
            if type(exc) is TypeError and result is not UNCALLED and not isawaitable(result):
                raise not_awaitable(fn, result) from None
            raise
        finally:
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
        async with SingleKeyLock(self._shares, key, timeout, group, self._max_pending):
            return await awaitable_result(fn, fn(*args, **kwargs))

    call = deprecated_call


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
        # One watched path for both ways in: run's copy takes the arguments as they are here.
        return await self._run_packed(key, fn, args, kwargs)

    async def _run_packed(
        self,
        key: Hashable,
        fn: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> T:
        watch = Watch(self._watching, key, function_name(fn))
        turn: Awaitable[T] = super()._run_packed(  # pyright: ignore[reportAssignmentType]
            key, watch.run, (fn, *args), kwargs
        )
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
        watch = Watch(self._watching, key, function_name(fn))
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
        watch = Watch(self._watching, key, function_name(fn))
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
        watch = Watch(self._watching, keys, function_name(fn))
        turn = super().run_all(keys, watch.run, fn, *args, **kwargs)  # type: ignore[arg-type]  # mypy cannot forward P through watch.run
        return await watch.watch(turn)

    def lock(
        self, key: Hashable, timeout: float | None = None, group: Hashable | None = None
    ) -> KeyLock:
        return ObservedLock(self._watching, key, super().lock(key, timeout, group))

    def lock_all(self, keys: Iterable[Hashable], timeout: float | None = None) -> KeyLock:
        keys = tuple(keys)
        return ObservedLock(self._watching, keys, super().lock_all(keys, timeout))

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


def _multi_key_fence(frame: Mapping[str, Any]) -> int | None:
    return frame["share"].fence_for(frame["registration"].keys)  # type: ignore[no-any-return]


def _single_key_fence(frame: Mapping[str, Any]) -> int | None:
    return frame["share"].fence_for((frame["key"],))  # type: ignore[no-any-return]


# Frames of these methods run a turn: current_fence() finds them on the task's await chain,
# and the deadlock check names a task running one after the function it runs. A run or a
# call waiting for its turn says in its frame what it waits for (see _waiting).
register_fence_reader(KeyedSerialQueue.run.__code__, _single_key_fence)
register_entry_code(KeyedSerialQueue.run.__code__)
register_waiting_code(KeyedSerialQueue.run.__code__, share_local="share")
register_fence_reader(KeyedSerialQueue._run_packed.__code__, _single_key_fence)  # pyright: ignore[reportPrivateUsage]
register_entry_code(KeyedSerialQueue._run_packed.__code__)  # pyright: ignore[reportPrivateUsage]
register_waiting_code(KeyedSerialQueue._run_packed.__code__, share_local="share")  # pyright: ignore[reportPrivateUsage]
register_entry_code(KeyedSerialQueue._call.__code__)  # pyright: ignore[reportPrivateUsage]
register_fence_reader(KeyedSerialQueue.run_all.__code__, _multi_key_fence)
register_entry_code(KeyedSerialQueue.run_all.__code__)
register_fence_reader(Submission.execute.__code__, _single_key_fence)
register_entry_code(Submission.execute.__code__)


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
