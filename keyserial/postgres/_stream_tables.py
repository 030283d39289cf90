"""The tables of keyed streams on PostgreSQL, and how they are made.

Every ``KeyedStream`` on a database shares five tables, told apart by a ``stream`` column:

* ``keyserial_streams``: each stream's partition count, fixed at its first use (it decides
  where each key's messages go, so every process must agree on it);
* ``keyserial_stream_partitions``: one row per partition, its owner, the owner's lease, and
  its fence, raised by every new owner. A transaction that acts for an owner locks the row
  ``FOR KEY SHARE`` with the owner's fence; a new owner takes it ``FOR UPDATE``, so a
  takeover waits until every transaction of the old owner has ended, and every later
  transaction of the old owner finds the fence changed;
* ``keyserial_stream_messages``: the messages not yet acknowledged. ``deliveries`` counts
  hand-outs, 0 for a message no owner has read. An acknowledgement deletes the row, in the
  handler's own transaction, so the table holds only the backlog;
* ``keyserial_stream_dead``: dead letters, kept until deleted;
* ``keyserial_stream_members``: the live consumers, for the partitions' assignment.

Message fields are kept as names and byte values, so that any value a Redis stream takes
(bytes that are not UTF-8 included) comes back the same.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import AsyncConnection, sql

from ._errors import SetupRequired
from ._ids import SETUP_LOCK

#: The tables, in the order they are made.
TABLES = (
    "keyserial_streams",
    "keyserial_stream_partitions",
    "keyserial_stream_messages",
    "keyserial_stream_dead",
    "keyserial_stream_members",
)

_CREATE = """\
CREATE TABLE IF NOT EXISTS keyserial_streams (
    stream text PRIMARY KEY,
    partitions integer NOT NULL CHECK (partitions > 0)
);
CREATE TABLE IF NOT EXISTS keyserial_stream_partitions (
    stream text NOT NULL,
    partition integer NOT NULL,
    fence bigint NOT NULL DEFAULT 0,
    owner text,
    lease_until timestamptz NOT NULL DEFAULT '-infinity',
    PRIMARY KEY (stream, partition)
);
CREATE TABLE IF NOT EXISTS keyserial_stream_messages (
    stream text NOT NULL,
    partition integer NOT NULL,
    id bigint GENERATED ALWAYS AS IDENTITY,
    key bytea NOT NULL,
    names text[] NOT NULL,
    vals bytea[] NOT NULL,
    deliveries integer NOT NULL DEFAULT 0,
    PRIMARY KEY (stream, partition, id)
);
CREATE INDEX IF NOT EXISTS keyserial_stream_unread
    ON keyserial_stream_messages (stream, partition, id) WHERE deliveries = 0;
CREATE TABLE IF NOT EXISTS keyserial_stream_dead (
    stream text NOT NULL,
    partition integer NOT NULL,
    id bigint GENERATED ALWAYS AS IDENTITY,
    message_id bigint NOT NULL,
    key bytea NOT NULL,
    names text[] NOT NULL,
    vals bytea[] NOT NULL,
    error text NOT NULL,
    deliveries integer NOT NULL,
    dead_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (stream, partition, id)
);
CREATE TABLE IF NOT EXISTS keyserial_stream_members (
    stream text NOT NULL,
    member text NOT NULL,
    expires timestamptz NOT NULL,
    PRIMARY KEY (stream, member)
)"""


def stream_tables_sql(grant_to: str | None = None) -> str:
    """The SQL that makes the stream tables (and grants their use to ``grant_to``).

    Example:
        ```pycon
        >>> print(stream_tables_sql("app").splitlines()[-1])
        GRANT SELECT, INSERT, UPDATE, DELETE ON "keyserial_stream_members" TO "app";

        ```
    """
    lines = [_CREATE + ";"]
    if grant_to is not None:
        lines += [grant.as_string(None) + ";" for grant in _grants(grant_to)]
    return "\n".join(lines)


def _grants(role: str) -> list[sql.Composed]:
    return [
        sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON {} TO {}").format(
            sql.Identifier(table), sql.Identifier(role)
        )
        for table in TABLES
    ]


async def ensure_stream_tables(connection: AsyncConnection[Any]) -> None:
    """Make the stream tables if one is missing (by whichever process is first).

    Raises:
        SetupRequired: a table is missing and this role may not create it.
    """
    async with connection.transaction():
        found = await connection.execute(
            "SELECT count(to_regclass(name)) FROM unnest(%s::text[]) AS name", (list(TABLES),)
        )
        row = await found.fetchone()
        if row is not None and row[0] == len(TABLES):
            return
        await connection.execute("SELECT pg_advisory_xact_lock(%s)", (SETUP_LOCK,))
        try:
            await connection.execute(_CREATE)
        except psycopg.errors.InsufficientPrivilege as exc:
            raise SetupRequired(
                "the keyed stream tables (keyserial_stream_messages and others) do not exist, "
                "and this role may not create them: run 'python -m keyserial.postgres setup "
                "<dsn> --grant <role>' or the SQL of keyserial.postgres.setup_sql() once, as a "
                "role that may"
            ) from exc


async def grant_stream_tables(connection: AsyncConnection[Any], role: str) -> None:
    """Grant ``role`` the use of the stream tables."""
    for grant in _grants(role):
        await connection.execute(grant)
