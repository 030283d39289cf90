"""One ownership of one partition: takeover, reading, per-key handling, acks, drain.

The hard part is what an acknowledgement may mean. An ack here is written *before* the key
moves on: a message's turn in the in-process keyed queue ends only once its ack (or its
dead letter) is confirmed by the broker. So whatever crashes, the unacknowledged messages of
a key are its last started one and those after it, and a new owner that replays them in
stream order never runs a message after a later message of its key completed. Acks of
different keys that finish together share one round trip (``AckBatcher``), so the ack costs
a key one round trip of latency and the consumer almost no throughput.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Container, Sequence
from typing import Any

from .._queue import KeyedSerialQueue
from ._message import StreamCounts, StreamMessage
from ._redeliveries import Redeliveries
from ._source import AttemptFailed, Entry, PartitionLost, StreamSource

Handler = Callable[[StreamMessage], Awaitable[Any]]

logger = logging.getLogger("keyserial.streams")

#: Messages read (or claimed) per request to the broker, at most.
READ_BATCH = 256
#: The fewest messages a read may take when the room allows (see ``InFlight.share``).
MIN_SHARE = 16
#: How long an idle owner waits for new messages before it asks again.
IDLE_WAIT = 1.0
#: How often an owner asks the broker how many of its partition's messages are unread.
LAG_INTERVAL = 1.0
#: The most of its time the connection those questions go on spends answering them, over
#: all of a consumer's partitions: a question that takes long (counting a large backlog on
#: PostgreSQL) is asked less often than every ``LAG_INTERVAL``, but at least every
#: ``LAG_INTERVAL_MOST``.
LAG_SHARE = 0.05
LAG_INTERVAL_MOST = 60.0


class NotOwned(Exception):
    """An attempt was about to start after the partition's lease may have run out."""


class InFlight:
    """Messages read but not finished, across a consumer's partitions, up to a bound.

    Room is reserved *before* a read and the unused part given back after it: partitions
    reading at the same time could otherwise each see the same room and together read
    past the bound. Once the bound is reached, reading resumes when an eighth of it is
    free again (``low_water``), not at each message that finishes: a read per finished
    message would cost a request to the broker per message. Each partition also keeps
    to its share (``PartitionWorker._reserve``), so that the bound is rarely reached.
    """

    __slots__ = ("_room", "count", "limit", "low_water", "messages", "readers")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.low_water = max(1, limit // 8)
        self.count = 0  # reserved: messages in flight, and room held for reads still out
        self.messages = 0  # messages read and not finished
        #: The partitions assigned to the consumer, owned or waited for: written by
        #: ``KeyedStream`` as it starts and ends serving one.
        self.readers = 0
        self._room = asyncio.Event()
        self._room.set()

    def reserve(self, most: int) -> int:
        """Reserve room for up to ``most`` messages now; how many. All of them if they fit,
        else what is free, but nothing while less than ``low_water`` is."""
        free = self.limit - self.count
        n = max(0, min(most, free)) if free >= min(most, self.low_water) else 0
        self.count += n
        if self.limit - self.count < self.low_water:
            self._room.clear()
        return n

    def release(self, n: int = 1) -> None:
        """``n`` reserved messages finished, or were never read."""
        self.count -= n
        if self.limit - self.count >= self.low_water:
            self._room.set()

    def share(self) -> int:
        """The most one partition may hold unfinished: an even share of ``limit`` among
        the partitions assigned, but no fewer than ``MIN_SHARE`` (or ``limit``, if
        smaller), as a smaller read would cost a request for too few messages. Counted
        over the partitions assigned, not only those owned yet, so that the first owned
        ones do not take the room of those whose takeover comes a moment later."""
        even = self.limit // max(1, self.readers)  # rounded down: the shares fit the bound
        return max(even, min(self.limit, MIN_SHARE))

    async def room(self) -> None:
        """Wait until at least ``low_water`` places are free."""
        await self._room.wait()


class AckBatcher:
    """Acknowledges finished messages of one partition, those finishing together at once.

    While one ack request is out, the messages finishing meanwhile gather into the next,
    sent as soon as it returns: one round trip per batch, however many keys finish.
    """

    __slots__ = ("_batch", "_done", "_fence", "_flusher", "_partition", "_source", "counts")

    def __init__(
        self, source: StreamSource, partition: int, fence: int, counts: StreamCounts
    ) -> None:
        self._source = source
        self._partition = partition
        self._fence = fence
        self.counts = counts
        self._batch: list[str] = []
        self._done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._flusher: asyncio.Task[None] | None = None

    async def ack(self, message_id: str) -> None:
        """Return once the broker confirmed the ack. Raises ``PartitionLost`` if fenced."""
        self._batch.append(message_id)
        done = self._done
        if self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush())
        # Shielded: a handler cancelled while its ack is out does not cancel the others'.
        await asyncio.shield(done)

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._batch:
                batch, done = self._batch, self._done
                self._batch, self._done = [], loop.create_future()
                try:
                    lag = await self._source.ack(self._partition, self._fence, batch)
                except asyncio.CancelledError:
                    done.cancel()
                    raise
                except Exception as exc:
                    done.set_exception(exc)
                    done.exception()  # retrieved here: each waiter re-raises it itself
                else:
                    self.counts.lag[self._partition] = lag
                    done.set_result(None)
        finally:
            self._flusher = None

    async def aclose(self) -> None:
        """Stop sending; acks still waiting are cancelled."""
        flusher = self._flusher
        if flusher is not None:
            flusher.cancel()
            await asyncio.gather(flusher, return_exceptions=True)
        self._done.cancel()


class PartitionWorker:
    """Runs one partition for as long as its owner holds it (see the module docstring)."""

    def __init__(
        self,
        source: StreamSource,
        partition: int,
        fence: int,
        consumer: str,
        handler: Handler,
        queue: KeyedSerialQueue,
        in_flight: InFlight,
        counts: StreamCounts,
        max_attempts: int,
        max_deliveries: int | None,
        retry_delay: float,
    ) -> None:
        self.source = source
        self.partition = partition
        self.fence = fence
        self.consumer = consumer
        self.handler = handler
        self.queue = queue
        self.in_flight = in_flight
        self.counts = counts
        self.max_attempts = max_attempts
        self.redeliveries = Redeliveries(max_deliveries)
        self._solo = asyncio.Lock()  # held by a suspect's run (see Redeliveries)
        self.retry_delay = retry_delay
        self.acks = AckBatcher(source, partition, fence, counts)
        self.tasks: set[asyncio.Task[None]] = set()
        self.failure: BaseException | None = None
        self._turn = _named_after(handler, self._handle)
        self._turn_alone = _named_after(handler, self._handle_alone)
        self._wake = asyncio.Event()
        #: Set while this partition's unfinished messages are at most half its window.
        self._low = asyncio.Event()
        self._closing = False  # the worker is cancelling its handlers
        self._closed = asyncio.get_running_loop().create_future()  # set when it starts to
        self._lag_due = 0.0  # when stats().lag is next read from the broker

    async def run(self, stop: asyncio.Event, drain_timeout: float) -> None:
        """Take over, then read until ``stop`` is set; then let the handlers finish.

        Raises ``PartitionLost`` (or the broker's error) when the partition can no longer
        be served; its handlers are cancelled then, unacknowledged.
        """
        try:
            await self._take_over(stop)
            await self._read(stop)
            if self.failure is None:
                await self._drain(drain_timeout)
        finally:
            await self._cancel_handlers()
        if self.failure is not None:
            raise self.failure

    async def _follow_lag(self) -> None:
        """Keep ``stats().lag`` of this partition current: asked at most every
        ``LAG_INTERVAL``, by the reader between its reads and waits (never a request of
        its own to cancel); less often when the answer is slow to come (see ``LAG_SHARE``)."""
        loop = asyncio.get_running_loop()
        asked = loop.time()
        if asked < self._lag_due:
            return
        self._lag_due = asked + LAG_INTERVAL
        try:
            self.counts.lag[self.partition] = await self.source.lag(self.partition)
        except Exception as exc:  # the broker's trouble: reads and acks report it
            logger.debug("partition %d: lag not read (%r)", self.partition, exc)
            return
        # Every partition of the consumer asks as often: together they keep to LAG_SHARE.
        spaced = (loop.time() - asked) * max(1, self.in_flight.readers) / LAG_SHARE
        self._lag_due = asked + min(max(LAG_INTERVAL, spaced), LAG_INTERVAL_MOST)

    async def _take_over(self, stop: asyncio.Event) -> None:
        """Run the earlier owners' unacknowledged messages first, in stream order."""
        start = "0-0"
        while not stop.is_set() and self.failure is None:
            room = await self._reserve(stop)
            if room == 0:
                return
            try:
                start, entries = await self.source.claim(
                    self.partition, self.fence, self.consumer, start, room
                )
                entries = await self._recount(entries)
            except BaseException:
                self.in_flight.release(room)
                raise
            self.in_flight.release(room - len(entries))  # the rest stays reserved for them
            self._dispatch(entries, alone=self.redeliveries.suspects)
            if start == "0-0":
                return

    async def _recount(self, entries: Sequence[Entry]) -> Sequence[Entry]:
        """``entries`` with the deliveries that cannot have run taken back (see
        ``Redeliveries``), in the broker too, so that the next owner sees the same counts."""
        kept, corrected = self.redeliveries.recount(entries)
        if corrected:
            await self.source.set_deliveries(self.partition, self.fence, self.consumer, corrected)
        return kept

    async def _read(self, stop: asyncio.Event) -> None:
        while not stop.is_set() and self.failure is None:
            room = await self._reserve(stop)
            if room == 0:
                return
            try:
                got = await self.source.read(self.partition, self.fence, self.consumer, room)
            except BaseException:
                self.in_flight.release(room)
                raise
            self.in_flight.release(room - (0 if isinstance(got, str) else len(got)))
            if isinstance(got, str):
                await self._until_any(stop, self.source.wait(self.partition, got, IDLE_WAIT))
            else:
                self._dispatch(got)
            await self._follow_lag()

    async def _reserve(self, stop: asyncio.Event) -> int:
        """Reserve room to read messages into; 0 if told to stop while waiting for room.

        A partition keeps at most its window (its share of ``max_in_flight``) unfinished,
        and reads again once half of that is left: its keys never run dry while another
        partition's reads fill the consumer's bound, and a read takes at least half a
        window's messages."""
        while True:
            window = self._window()
            unfinished = len(self.tasks)
            waiting: Awaitable[Any]
            if unfinished <= window // 2:
                room = self.in_flight.reserve(window - unfinished)
                if room:
                    return room
                waiting = self.in_flight.room()
            else:
                self._low.clear()
                waiting = self._low.wait()
            await self._until_any(stop, waiting, LAG_INTERVAL)
            if stop.is_set() or self.failure is not None:
                return 0
            await self._follow_lag()

    def _window(self) -> int:
        return min(READ_BATCH, self.in_flight.share())

    async def _until_any(
        self, stop: asyncio.Event, awaitable: Awaitable[Any], timeout: float | None = None
    ) -> None:
        """Await ``awaitable`` until it ends, ``stop`` is set, a handler failed the worker,
        or ``timeout`` seconds passed."""
        work = asyncio.ensure_future(awaitable)
        stopped = asyncio.ensure_future(stop.wait())
        failed = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait(
                {work, stopped, failed}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for future in (work, stopped, failed):
                future.cancel()
            await asyncio.gather(work, stopped, failed, return_exceptions=True)
        if work.done() and not work.cancelled() and work.exception() is not None:
            raise work.exception()  # type: ignore[misc]

    def _dispatch(self, entries: Any, alone: Container[str] = ()) -> None:
        """Start a task per entry (each holds one reserved place until it finishes); those
        whose id is in ``alone`` run one at a time (suspects, see ``Redeliveries``)."""
        self.in_flight.messages += len(entries)
        for entry in entries:
            turn = self._turn_alone if entry.id in alone else self._turn
            task = self.queue.submit(entry.key, turn, entry)
            self.tasks.add(task)
            task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self.in_flight.messages -= 1
        self.in_flight.release()
        if len(self.tasks) <= self._window() // 2:
            self._low.set()
        if not task.cancelled() and task.exception() is not None:
            self._fail(task.exception())  # type: ignore[arg-type]

    async def _handle_alone(self, entry: Entry) -> None:
        """``_handle`` for a suspect: alone, until its ack (see ``Redeliveries``)."""
        # Suspects were dispatched in stream order, and each is the head of its key, so
        # they queue here, for a lock that wakes its waiters in order, in stream order.
        async with self._solo:
            await self._handle(entry)

    async def _handle(self, entry: Entry) -> None:
        """Run ``entry`` in its key's turn: retried, then acknowledged or dead-lettered.

        If the ack or the dead letter fails, the key's turn is *not* given up: the next
        message of the key must not start while this one may still run again (it is
        unacknowledged). The worker stops instead, and a new ownership replays the message
        first.
        """
        try:
            error = (
                entry.malformed or self.redeliveries.refusal(entry) or await self._attempts(entry)
            )
            if self._closing:
                return  # shutdown, not the message, failed it: left for the next owner
        except NotOwned as exc:
            # Nothing was started: the message stays pending for the partition's next owner,
            # and its key here must not move on.
            self._fail(PartitionLost(str(exc)))
            await self._hold_key()
            return
        except (PartitionLost, AttemptFailed) as exc:
            # The broker refused the attempt's transaction, or its commit is in doubt: the
            # next ownership runs the message again first, or finds it acknowledged.
            self._fail(exc)
            await self._hold_key()
            return
        except asyncio.CancelledError:
            if self._closing:
                raise
            # The handler raised CancelledError without the worker cancelling it: the
            # message is unfinished, so its key must not move on.
            self._fail(RuntimeError(f"the handler of message {entry.id} was cancelled"))
            await self._hold_key()
            return
        try:
            if error is None:
                if not self.source.acks_in_attempt:
                    await self.acks.ack(entry.id)
                self.counts.handled += 1
            else:
                await self.source.dead_letter(self.partition, self.fence, entry, error)
                self.counts.dead_lettered += 1
                logger.warning("message %s of key %r dead-lettered: %s", entry.id, entry.key, error)
        except Exception as exc:
            self._fail(exc)
            await self._hold_key()

    async def _hold_key(self) -> None:
        """Keep this message's key until the worker ends: its next message must not start.

        Ends when the worker closes, not only when this task is cancelled: the error that
        brought us here may itself have been a cancellation that cleanup code turned into
        another exception, and a task that waited for a second cancellation would never end.
        """
        if not self._closing:
            await asyncio.shield(self._closed)

    async def _attempts(self, entry: Entry) -> str | None:
        """Run the handler up to ``max_attempts`` times; None once it succeeded, else the error."""
        for attempt in range(1, self.max_attempts + 1):
            # Before every attempt, not only the first: a consumer paused past its lease
            # (waiting out a retry delay, or with the rest of a batch not started) must not
            # start old work once another owner may have run newer messages of the key.
            if self.failure is not None or not self.source.holds(self.partition, self.fence):
                raise NotOwned(
                    f"partition {self.partition} (fence {self.fence}) may have another owner "
                    f"now: message {entry.id} of key {entry.key!r} was not started"
                )
            message = StreamMessage(
                entry.key,
                entry.fields,
                entry.id,
                self.partition,
                attempt,
                entry.deliveries,
                self.fence,
            )
            try:
                async with self.source.attempt(self.partition, self.fence, entry) as needed:
                    if needed:
                        await self.handler(message)
            except (PartitionLost, AttemptFailed):
                raise
            except Exception as exc:
                self.counts.failed_attempts += 1
                # Closing: the worker cancelled it, and the handler turned that into an error.
                if attempt == self.max_attempts or self._closing:
                    return f"{type(exc).__name__}: {exc}"
                self.counts.retries += 1
                if self.retry_delay:
                    await asyncio.sleep(self.retry_delay * 2 ** (attempt - 1))
            else:
                return None
        raise AssertionError("unreachable: max_attempts >= 1")

    def _fail(self, exc: BaseException) -> None:
        """Stop the worker with ``exc`` (the first failure wins)."""
        if self.failure is None:
            self.failure = exc
            self._wake.set()

    async def _drain(self, drain_timeout: float) -> None:
        """Let the handlers started here finish and be acknowledged, for ``drain_timeout``."""
        if not self.tasks:
            return
        # Never cancelled (that would cancel the handlers): left to end with them.
        handlers: asyncio.Future[Any] = asyncio.gather(*self.tasks, return_exceptions=True)
        failed: asyncio.Future[Any] = asyncio.ensure_future(self._wake.wait())  # ends it at once
        try:
            await asyncio.wait(
                {handlers, failed}, timeout=drain_timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            failed.cancel()
        pending = [task for task in self.tasks if not task.done()]
        if pending and self.failure is None:
            logger.warning(
                "partition %d: %d handlers still running after %.1f s; cancelled, unacknowledged",
                self.partition,
                len(pending),
                drain_timeout,
            )

    async def _cancel_handlers(self) -> None:
        self._closing = True
        self._closed.set_result(None)  # in the same step as the cancellations below
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        await self.acks.aclose()


def _named_after(
    handler: Handler, handle: Callable[[Entry], Awaitable[None]]
) -> Callable[[Entry], Awaitable[None]]:
    """``handle``, named after the user's handler: the queue's hooks and tasks show that name."""

    async def turn(entry: Entry) -> None:
        await handle(entry)

    turn.__qualname__ = getattr(handler, "__qualname__", turn.__qualname__)
    turn.__name__ = getattr(handler, "__name__", turn.__name__)
    return turn
