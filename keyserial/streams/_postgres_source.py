"""``PostgresStreamSource``: a keyed stream's partitions as rows of PostgreSQL tables.

The tables are described in ``keyserial.postgres._stream_tables``. What makes effects
exactly-once is where the acknowledgement happens: each attempt of a handler runs in a
transaction of its own, which first locks its partition's row ``FOR KEY SHARE`` with the
owner's fence and deletes the message (its acknowledgement), then runs the handler's
statements (``keyserial.postgres.connection()`` is its connection), and commits when the
handler returns: the writes and the acknowledgement commit together or not at all. A
message found already deleted was acknowledged by an attempt whose commit landed; it is
not run again.

A new owner raises the fence after locking the row ``FOR UPDATE``, which waits for every
transaction of the old owner to end: a stale owner's transaction either committed before
the takeover (its message is gone when the new owner looks) or finds the fence changed and
runs nothing. A paused owner cannot hold the row for ever: its transactions set
``idle_in_transaction_session_timeout`` to its lease, so the server ends them.

Consumers wake on ``NOTIFY``: a publication notifies its partition when it commits, and a
released partition notifies the consumers waiting for it. An idle consumer holds one
listening connection and sends the server only its lease and membership renewals. Reads
and lease renewals go on a control connection of the owners' (``PartitionOwners``): the
pool's connections are the handlers' transactions, one per key being handled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Hashable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import psycopg
from psycopg import AsyncConnection, sql
from psycopg.pq import TransactionStatus
from psycopg_pool import AsyncConnectionPool

from .._keycodec import deserialize_key, serialize_key
from ..postgres._connection import stream_transaction
from ..postgres._stream_tables import ensure_stream_tables
from ._message import DeadLetter
from ._postgres_owners import CHANNEL, ERRORS, PartitionOwners
from ._source import (
    AttemptFailed,
    Entry,
    PartitionLost,
    StreamSource,
    Value,
    check_stream,
    checked_fields,
    partition_for,
)

logger = logging.getLogger("keyserial.streams")

#: Seconds an idle owner waits for news before it reads again anyway: a safety net only.
IDLE_RECHECK = 30.0

_MESSAGES = "keyserial_stream_messages"
#: Locks the partition's row for the owner with the given fence (no row: another owner has
#: it now), and has the server end the transaction if it stays idle past the lease.
_FENCE = (
    "SELECT set_config('idle_in_transaction_session_timeout', %s, true) "
    "FROM keyserial_stream_partitions "
    "WHERE stream = %s AND partition = %s AND fence = %s FOR KEY SHARE"
)
#: An attempt's first round trip: the transaction begins, the fence is checked as by
#: ``_FENCE``, and the message is deleted (its acknowledgement, undone if the transaction
#: rolls back). Sent as one simple query, so its values are literals: ints, and the
#: stream's name quoted by psycopg. Its row: whether the fence held, whether the message
#: was still there (an attempt whose commit landed without its reply leaves it gone).
_BEGIN_ATTEMPT = (
    "BEGIN; "
    "WITH owner AS (SELECT set_config('idle_in_transaction_session_timeout', '{idle}', true) "
    "FROM keyserial_stream_partitions WHERE stream = {name} AND partition = {partition} "
    "AND fence = {fence} FOR KEY SHARE), "
    "gone AS (DELETE FROM keyserial_stream_messages WHERE stream = {name} "
    "AND partition = {partition} AND id = {id} AND EXISTS (SELECT 1 FROM owner) RETURNING 1) "
    "SELECT EXISTS (SELECT 1 FROM owner), EXISTS (SELECT 1 FROM gone)"
)
_COLUMNS = "id, key, names, vals, deliveries"


def _hand_out_sql(counted: str, matching: str) -> str:
    """A statement that hands out messages of a partition to its owner, in one transaction:
    the partition's row locked ``FOR KEY SHARE`` with the owner's fence, as ``_FENCE`` does,
    then the oldest ``matching`` messages' deliveries set to ``counted``. Its rows: whether
    the fence held, then a message each (one row of NULLs when none matched).

    The messages are picked into an array, which the server computes once, and updated
    through the primary key within the range of their ids. On a table whose statistics are
    not gathered yet (after a burst of publications) the planner otherwise runs an
    ``IN (subquery)`` again for every message of the partition, or reads every message of
    the partition to find those in the array: a read would cost the whole backlog."""
    return (
        "WITH owner AS (SELECT 1 FROM keyserial_stream_partitions WHERE stream = %(stream)s "
        "AND partition = %(partition)s AND fence = %(fence)s FOR KEY SHARE), "
        f"picked AS (SELECT ARRAY(SELECT id FROM {_MESSAGES} "
        f"WHERE stream = %(stream)s AND partition = %(partition)s AND {matching} "
        "ORDER BY id LIMIT %(count)s) AS ids), "
        f"handed AS (UPDATE {_MESSAGES} SET deliveries = {counted} "
        "WHERE stream = %(stream)s AND partition = %(partition)s "
        "AND EXISTS (SELECT 1 FROM owner) AND id = ANY((SELECT ids FROM picked)::bigint[]) "
        "AND id BETWEEN (SELECT ids[1] FROM picked) "
        f"AND (SELECT ids[cardinality(ids)] FROM picked) RETURNING {_COLUMNS}) "
        "SELECT EXISTS (SELECT 1 FROM owner), handed.* "
        "FROM (SELECT) AS one LEFT JOIN handed ON true"
    )


#: Messages never handed out, the oldest first.
_READ = _hand_out_sql("1", "deliveries = 0")
#: Messages handed out before (to this or an earlier owner) after the ``after`` position.
_CLAIM = _hand_out_sql("deliveries + 1", "deliveries > 0 AND id > %(after)s")


def _as_bytes(value: Value) -> bytes:
    if isinstance(value, bytes):
        return value
    return str(value).encode("utf-8", "surrogateescape")


def _entry_of(row: Sequence[Any]) -> Entry:
    """An ``Entry`` from a row of ``_COLUMNS``."""
    message_id, key_data, names, vals, deliveries = row
    fields = {
        name: bytes(value).decode("utf-8", "surrogateescape")
        for name, value in zip(names, vals, strict=True)
    }
    try:
        key: Hashable = deserialize_key(bytes(key_data))
    except ValueError as exc:
        return Entry(str(message_id), None, fields, deliveries, f"the key cannot be read: {exc}")
    return Entry(str(message_id), key, fields, deliveries)


def _caller(connection: object) -> AsyncConnection[Any]:
    """The caller's connection a message joins the transaction of.

    Raises:
        TypeError: ``connection`` is not a psycopg ``AsyncConnection``.
    """
    if not isinstance(connection, AsyncConnection):
        raise TypeError(
            "connection must be a psycopg AsyncConnection whose transaction the message "
            f"joins, not {type(connection).__module__}.{type(connection).__qualname__}"
        )
    caller: AsyncConnection[Any] = connection  # pyright: ignore[reportUnknownVariableType]
    return caller


def _check_still_open(conn: AsyncConnection[Any], entry: Entry) -> None:
    """Refuse to commit a handler's transaction that the handler itself ended or broke.

    A COMMIT of a failed transaction rolls back without an error, so a handler that caught
    a statement's error and returned would otherwise count as done, its acknowledgement
    silently undone and its key moving on.

    Raises:
        RuntimeError: the transaction failed (a statement raised, and the handler went
            on): the attempt failed, nothing it wrote is kept.
        AttemptFailed: the handler committed or rolled back the transaction itself: what
            became of the message is not known here.
    """
    status = conn.info.transaction_status
    if status == TransactionStatus.INERROR:
        raise RuntimeError(
            f"a statement of message {entry.id}'s handler failed and the handler went on: "
            "its transaction is aborted, nothing it wrote is kept (let the error propagate, "
            "or use a savepoint: async with connection().transaction())"
        )
    if status != TransactionStatus.INTRANS:
        raise AttemptFailed(
            f"the handler of message {entry.id} ended connection()'s transaction itself; "
            "it must leave the commit to the stream"
        )


def _position(start: str) -> int:
    """A claim position as the worker holds it (``"0-0"``: the start) as a message id."""
    return 0 if start == "0-0" else int(start)


class PostgresStreamSource(StreamSource):
    """Partitions of one keyed stream in PostgreSQL (see the module docstring).

    Raises:
        TypeError: ``pool`` is not a ``psycopg_pool.AsyncConnectionPool``, or ``name`` not
            a str.
        ValueError: ``name`` is empty, or ``partitions`` is not a positive int.
    """

    errors = ERRORS
    acks_in_attempt = True

    def __init__(
        self, pool: AsyncConnectionPool[Any], name: str, partitions: int, lease: float
    ) -> None:
        if not isinstance(pool, AsyncConnectionPool):
            raise TypeError(
                "a KeyedStream on PostgreSQL needs a psycopg_pool.AsyncConnectionPool, not "
                f"{type(pool).__module__}.{type(pool).__qualname__}"
            )
        check_stream(name, partitions)
        self.partitions = partitions
        self.lease = float(lease)
        self._pool = pool
        self._name = name
        self._prepared = False
        self._preparing = asyncio.Lock()
        #: How long a transaction of the owner may stay idle before the server ends it.
        self._idle = f"{max(1, int(self.lease * 1000))}ms"
        self._quoted_name = sql.Literal(name).as_string(None)
        self._owners = PartitionOwners(pool, name, partitions, self.lease, self._prepare)

    def partition_of(self, key: Hashable) -> int:
        return partition_for(serialize_key(key, "KeyedStream"), self.partitions)

    async def _prepare(self) -> None:
        """Make the tables and this stream's partitions, once per source.

        Raises:
            ValueError: the stream exists with another partition count.
            SetupRequired: a table is missing and this role may not create it.
        """
        if self._prepared:
            return
        async with self._preparing:
            if self._prepared:
                return
            async with self._pool.connection() as conn:
                await ensure_stream_tables(conn)
                async with conn.transaction():
                    await conn.execute(
                        "INSERT INTO keyserial_streams (stream, partitions) VALUES (%s, %s) "
                        "ON CONFLICT (stream) DO NOTHING",
                        (self._name, self.partitions),
                    )
                    found = await conn.execute(
                        "SELECT partitions FROM keyserial_streams WHERE stream = %s",
                        (self._name,),
                    )
                    row = await found.fetchone()
                    if row is None or row[0] != self.partitions:
                        raise ValueError(
                            f"stream {self._name!r} has {row and row[0]} partitions in the "
                            f"database, not {self.partitions}: a stream's partition count "
                            "is fixed at its first use (it decides where each key's messages "
                            "go); give KeyedStream the same partitions= everywhere"
                        )
                    await conn.execute(
                        "INSERT INTO keyserial_stream_partitions (stream, partition) "
                        "SELECT %s, generate_series(0, %s - 1) ON CONFLICT DO NOTHING",
                        (self._name, self.partitions),
                    )
            self._prepared = True

    async def publish(
        self, key: Hashable, fields: Mapping[str, Value], connection: object = None
    ) -> str:
        data = serialize_key(key, "KeyedStream")
        checked = checked_fields(fields)
        caller = None if connection is None else _caller(connection)
        await self._prepare()
        partition = partition_for(data, self.partitions)
        values = (
            self._name,
            partition,
            data,
            list(checked),
            [_as_bytes(value) for value in checked.values()],
            CHANNEL,
            f"p:{partition}:{self._name}",
        )
        statement = (
            "WITH m AS (INSERT INTO keyserial_stream_messages (stream, partition, key, names, "
            "vals) VALUES (%s, %s, %s, %s, %s) RETURNING id) "
            "SELECT id, pg_notify(%s, %s) FROM m"
        )
        if caller is None:
            async with self._pool.connection() as conn:
                found = await conn.execute(statement, values)
                row = await found.fetchone()
        else:
            found = await caller.execute(statement, values)
            row = await found.fetchone()
        assert row is not None
        return str(row[0])

    def own(self, partition: int) -> AbstractAsyncContextManager[int]:
        return self._owners.own(partition)

    def holds(self, partition: int, fence: int) -> bool:
        return self._owners.holds(partition, fence)

    async def lag(self, partition: int) -> int:
        rows = await self._owners.on_control(
            f"SELECT count(*) FROM {_MESSAGES} "
            "WHERE stream = %(stream)s AND partition = %(partition)s AND deliveries = 0",
            {"stream": self._name, "partition": partition},
        )
        return int(rows[0][0]) if rows else 0

    @asynccontextmanager
    async def _fenced(
        self, partition: int, fence: int
    ) -> AsyncGenerator[AsyncConnection[Any], None]:
        """A transaction that acts for the owner with ``fence``: refused (``PartitionLost``)
        once another owner took the partition, and holding the takeover off until it ends."""
        async with self._pool.connection() as conn, conn.transaction():
            found = await conn.execute(_FENCE, (self._idle, self._name, partition, fence))
            if await found.fetchone() is None:
                raise PartitionLost(f"partition {partition} has another owner now")
            yield conn

    async def claim(
        self, partition: int, fence: int, consumer: str, start: str, count: int
    ) -> tuple[str, Sequence[Entry]]:
        if self._owners.nothing_to_claim(partition, fence):
            return "0-0", []
        entries = await self._hand_out(partition, fence, count, _CLAIM, {"after": _position(start)})
        return (entries[-1].id if len(entries) == count else "0-0"), entries

    async def set_deliveries(
        self, partition: int, fence: int, consumer: str, deliveries: Sequence[tuple[str, int]]
    ) -> None:
        async with self._fenced(partition, fence) as conn:
            await conn.execute(
                f"UPDATE {_MESSAGES} AS m SET deliveries = v.deliveries "
                "FROM unnest(%s::bigint[], %s::integer[]) AS v(id, deliveries) "
                "WHERE m.stream = %s AND m.partition = %s AND m.id = v.id",
                (
                    [int(message_id) for message_id, _ in deliveries],
                    [count for _, count in deliveries],
                    self._name,
                    partition,
                ),
            )

    async def read(
        self, partition: int, fence: int, consumer: str, count: int
    ) -> Sequence[Entry] | str:
        self._owners.forget_news(partition)  # before the read: a publication sets it again
        return await self._hand_out(partition, fence, count, _READ, {}) or ""

    async def _hand_out(
        self, partition: int, fence: int, count: int, statement: str, args: dict[str, Any]
    ) -> list[Entry]:
        """Hand out up to ``count`` messages by ``statement`` (``_READ`` or ``_CLAIM``), in
        one fenced statement on the control connection: the handlers' transactions hold
        the pool's connections, and a read must not wait for one of them to end.

        Raises:
            PartitionLost: another owner has the partition now.
        """
        rows = await self._owners.on_control(
            statement,
            {"stream": self._name, "partition": partition, "fence": fence, "count": count, **args},
        )
        if not rows or not rows[0][0]:
            raise PartitionLost(f"partition {partition} has another owner now")
        return sorted(
            (_entry_of(row[1:]) for row in rows if row[1] is not None), key=lambda e: int(e.id)
        )

    async def wait(self, partition: int, after: str, timeout: float) -> None:
        # Every publication is notified, and the listener raises every partition's news
        # when it (re)connects: a short ``timeout`` would only make idle owners poll.
        await self._owners.news_of(partition, max(timeout, IDLE_RECHECK))

    def attempt(
        self, partition: int, fence: int, entry: Entry
    ) -> AbstractAsyncContextManager[bool]:
        return self._attempt(partition, fence, entry)

    @asynccontextmanager
    async def _attempt(
        self, partition: int, fence: int, entry: Entry
    ) -> AsyncGenerator[bool, None]:
        """The handler's transaction: fenced, then the handler, then the ack, committed."""
        begin = _BEGIN_ATTEMPT.format(
            idle=self._idle,
            name=self._quoted_name,
            partition=partition,
            fence=fence,
            id=int(entry.id),
        )
        try:
            pooled = self._pool.connection()
            conn = await pooled.__aenter__()
        except psycopg.Error as exc:
            raise AttemptFailed(f"no connection for message {entry.id}: {exc}") from exc
        autocommit = conn.autocommit
        try:
            try:
                # In autocommit mode psycopg sends no BEGIN of its own: ours goes with the
                # fence check, and the handler's statements join the transaction it opens.
                await conn.set_autocommit(True)
                found = await conn.execute(begin)  # pyright: ignore[reportArgumentType]
                found.nextset()
                row = await found.fetchone()
            except psycopg.Error as exc:
                raise AttemptFailed(f"message {entry.id} could not begin: {exc}") from exc
            assert row is not None
            if not row[0]:
                raise PartitionLost(f"partition {partition} has another owner now")
            bound = stream_transaction.set(conn)
            try:
                yield row[1]
            finally:
                stream_transaction.reset(bound)
            _check_still_open(conn, entry)
            try:
                await conn.commit()
            except psycopg.Error as exc:
                raise AttemptFailed(
                    f"message {entry.id} was handled, but its commit failed or was not "
                    f"confirmed: {exc}"
                ) from exc
        except BaseException as exc:
            with contextlib.suppress(psycopg.Error, OSError):
                await conn.rollback()
                await conn.set_autocommit(autocommit)
            await pooled.__aexit__(type(exc), exc, exc.__traceback__)
            if conn.broken and isinstance(exc, psycopg.Error):
                # The connection died under the handler (a restart, a terminated backend):
                # the server's failure, not the handler's, so no attempt is charged for it.
                raise AttemptFailed(
                    f"the connection of message {entry.id}'s transaction was lost: {exc}"
                ) from exc
            raise
        with contextlib.suppress(psycopg.Error, OSError):
            await conn.set_autocommit(autocommit)
        await pooled.__aexit__(None, None, None)

    async def ack(self, partition: int, fence: int, ids: Sequence[str]) -> int:
        async with self._fenced(partition, fence) as conn:
            await conn.execute(
                f"DELETE FROM {_MESSAGES} WHERE stream = %s AND partition = %s "
                "AND id = ANY(%s::bigint[])",
                (self._name, partition, [int(message_id) for message_id in ids]),
            )
        return await self.lag(partition)

    async def dead_letter(self, partition: int, fence: int, entry: Entry, error: str) -> None:
        async with self._fenced(partition, fence) as conn:
            await conn.execute(
                f"WITH gone AS (DELETE FROM {_MESSAGES} WHERE stream = %s AND partition = %s "
                "AND id = %s RETURNING id, key, names, vals) "
                "INSERT INTO keyserial_stream_dead (stream, partition, message_id, key, names, "
                "vals, error, deliveries) SELECT %s, %s, id, key, names, vals, %s, %s FROM gone",
                (
                    self._name,
                    partition,
                    int(entry.id),
                    self._name,
                    partition,
                    error,
                    entry.deliveries,
                ),
            )

    async def dead_letters(self, partition: int, count: int) -> Sequence[DeadLetter]:
        async with self._pool.connection() as conn:
            found = await conn.execute(
                "SELECT message_id, key, names, vals, deliveries, error, id "
                "FROM keyserial_stream_dead WHERE stream = %s AND partition = %s "
                "ORDER BY id LIMIT %s",
                (self._name, partition, count),
            )
            rows = await found.fetchall()
        letters: list[DeadLetter] = []
        for row in rows:
            entry = _entry_of(row[:5])
            letters.append(
                DeadLetter(
                    entry.key,
                    entry.fields,
                    entry.id,
                    partition,
                    row[5],
                    str(row[6]),
                    entry.deliveries,
                )
            )
        return letters

    async def members(self, member: str, ttl: float, *, leaving: bool = False) -> list[str]:
        await self._prepare()
        async with self._pool.connection() as conn, conn.transaction():
            await conn.execute(
                "DELETE FROM keyserial_stream_members WHERE stream = %s "
                "AND (expires < clock_timestamp() OR (member = %s AND %s))",
                (self._name, member, leaving),
            )
            if not leaving:
                await conn.execute(
                    "INSERT INTO keyserial_stream_members (stream, member, expires) "
                    "VALUES (%s, %s, clock_timestamp() + %s * interval '1 second') "
                    "ON CONFLICT (stream, member) DO UPDATE SET expires = EXCLUDED.expires",
                    (self._name, member, ttl),
                )
            found = await conn.execute(
                "SELECT member FROM keyserial_stream_members WHERE stream = %s ORDER BY member",
                (self._name,),
            )
            return [row[0] for row in await found.fetchall()]

    async def aclose(self) -> None:
        await self._owners.aclose()
