"""The queue's database objects, and how an operator makes them.

Every queue needs its fence sequence, ``<table>_seq``; a queue with ``fair=True`` also needs
its ticket table, ``<table>_tq``, where waiting calls keep their tickets (see ``_early``),
with its index by owner, ``<table>_tqo``. A role that may create objects in the schema gets
them made on first use. A role with less (the usual application role) needs them made
beforehand, once, by ``setup_sql()`` in a migration or by ``python -m keyserial.postgres
setup``; it then needs only ``USAGE`` on the schema and on the sequence, and ``SELECT,
INSERT, UPDATE, DELETE`` on the ticket table.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any

import psycopg
from psycopg import AsyncConnection, sql

from ._errors import SetupRequired
from ._ids import SETUP_LOCK
from ._stream_tables import ensure_stream_tables, grant_stream_tables, stream_tables_sql

logger = logging.getLogger("keyserial")

DEFAULT_TABLE = "keyserial_fences"


#: The longest identifier PostgreSQL keeps, in bytes (NAMEDATALEN - 1); a longer one is cut.
MAX_IDENTIFIER = 63
_SUFFIX = "_seq"
#: The ticket table's suffix, and its owner index's: no longer than the sequence's, so the
#: same limit keeps all three.
_TICKETS_SUFFIX = "_tq"
_OWNER_INDEX_SUFFIX = "_tqo"
#: The ticket tables (server, database, name) this process was told it may not add the owner
#: index to (see `ensure_ticket_table`): each is warned of once.
_WARNED_NO_INDEX: set[tuple[str, int, str, str]] = set()


def check_names(table: str, schema: str | None) -> None:
    """Refuse a ``table`` or ``schema`` PostgreSQL would cut short, before anything runs.

    Raises:
        TypeError: ``table`` is not a str, or ``schema`` is neither None nor a str.
        ValueError: ``table`` is empty or longer than 59 bytes (its sequence,
            ``<table>_seq``, must fit PostgreSQL's 63), or ``schema`` is empty or longer
            than 63 bytes.
    """
    if not isinstance(table, str):
        raise TypeError(f"table must be a str, not {type(table).__name__}")
    if schema is not None and not isinstance(schema, str):
        raise TypeError(f"schema must be None or a str, not {type(schema).__name__}")
    longest = MAX_IDENTIFIER - len(_SUFFIX)
    if not table or len(table.encode()) > longest:
        raise ValueError(
            f"table must be 1 to {longest} bytes long, got {len(table.encode())} "
            f"({table!r}): the fence sequence is named {table!r} + {_SUFFIX!r}, and "
            f"PostgreSQL cuts names longer than {MAX_IDENTIFIER} bytes"
        )
    if schema is not None and (not schema or len(schema.encode()) > MAX_IDENTIFIER):
        raise ValueError(
            f"schema must be 1 to {MAX_IDENTIFIER} bytes long (PostgreSQL cuts longer "
            f"names), got {len(schema.encode())} ({schema!r})"
        )


def sequence(table: str = DEFAULT_TABLE, schema: str | None = None) -> sql.Identifier:
    """The fence sequence of a queue made with ``table=`` and ``schema=``: ``<table>_seq``.

    Raises:
        TypeError, ValueError: as `check_names`.
    """
    check_names(table, schema)
    return _qualified(table + _SUFFIX, schema)


def ticket_table(table: str = DEFAULT_TABLE, schema: str | None = None) -> sql.Identifier:
    """The ticket table of a fair queue made with ``table=`` and ``schema=``: ``<table>_tq``.

    Raises:
        TypeError, ValueError: as `check_names`.
    """
    check_names(table, schema)
    return _qualified(table + _TICKETS_SUFFIX, schema)


def owner_index(table: str = DEFAULT_TABLE) -> str:
    """The name of the ticket table's index by owner and ticket, ``<table>_tqo``: the index
    lives in its table's schema, so the name is not qualified.

    Raises:
        TypeError, ValueError: as `check_names`.
    """
    check_names(table, None)
    return table + _OWNER_INDEX_SUFFIX


def _sequence_sql(name: sql.Identifier) -> sql.Composed:
    return sql.SQL("CREATE SEQUENCE IF NOT EXISTS {}").format(name)


def _ticket_table_sql(name: sql.Identifier) -> sql.Composed:
    # UNLOGGED: tickets live for seconds, and a process whose tickets a crash took
    # registers them again (see _early); no write-ahead log is spent on them.
    return sql.SQL(
        "CREATE UNLOGGED TABLE IF NOT EXISTS {} (\n"
        "    lock bigint NOT NULL,\n"
        "    ticket bigint NOT NULL,\n"
        "    owner bigint NOT NULL,\n"
        "    seen timestamptz NOT NULL,\n"
        "    PRIMARY KEY (lock, ticket)\n"
        ")"
    ).format(name)


def _owner_index_sql(name: sql.Identifier, index: str) -> sql.Composed:
    # A process finds its own tickets by owner and ticket (its verdicts, the tickets it gives
    # back, its heartbeat): through this index, not by reading every waiting call's row.
    return sql.SQL("CREATE INDEX IF NOT EXISTS {}\n    ON {} (owner, ticket)").format(
        sql.Identifier(index), name
    )


def _grants_sql(table: str, schema: str | None, role: str) -> list[sql.Composed]:
    """What ``role`` needs granted on the queue's objects (see `setup_sql`)."""
    return [
        sql.SQL("GRANT USAGE ON SEQUENCE {} TO {}").format(
            sequence(table, schema), sql.Identifier(role)
        ),
        sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON {} TO {}").format(
            ticket_table(table, schema), sql.Identifier(role)
        ),
    ]


def _qualified(name: str, schema: str | None) -> sql.Identifier:
    """``name`` in ``schema``, or as the search path finds it."""
    return sql.Identifier(name) if schema is None else sql.Identifier(schema, name)


def setup_sql(
    *,
    table: str = DEFAULT_TABLE,
    schema: str | None = None,
    grant_to: str | None = None,
    streams: bool = False,
) -> str:
    """The SQL that makes a queue's fence sequence and ticket table, for a migration tool.

    With ``streams=True``, it also makes the tables of keyed streams on PostgreSQL
    (``KeyedStream`` with a pool; in the search path's schema).

    Run it once, as a role that may create objects in the schema, with the same ``table``
    and ``schema`` the queue is given. ``grant_to`` names the application's role, which then
    needs no ``CREATE`` privilege. The ticket table serves queues with ``fair=True``; it
    stays empty otherwise.

    Example:
        ```pycon
        >>> print(setup_sql(grant_to="app"))
        CREATE SEQUENCE IF NOT EXISTS "keyserial_fences_seq";
        CREATE UNLOGGED TABLE IF NOT EXISTS "keyserial_fences_tq" (
            lock bigint NOT NULL,
            ticket bigint NOT NULL,
            owner bigint NOT NULL,
            seen timestamptz NOT NULL,
            PRIMARY KEY (lock, ticket)
        );
        CREATE INDEX IF NOT EXISTS "keyserial_fences_tqo"
            ON "keyserial_fences_tq" (owner, ticket);
        GRANT USAGE ON SEQUENCE "keyserial_fences_seq" TO "app";
        GRANT SELECT, INSERT, UPDATE, DELETE ON "keyserial_fences_tq" TO "app";

        ```
    """
    lines = [
        _sequence_sql(sequence(table, schema)),
        _ticket_table_sql(ticket_table(table, schema)),
        _owner_index_sql(ticket_table(table, schema), owner_index(table)),
    ]
    if grant_to is not None:
        lines.extend(_grants_sql(table, schema, grant_to))
    text = "\n".join(line.as_string(None) + ";" for line in lines)
    return text + "\n" + stream_tables_sql(grant_to) if streams else text


async def ensure_sequence(connection: AsyncConnection[Any], table: str, schema: str | None) -> None:
    """Make the fence sequence if it is missing (by whichever process is first).

    Fences continue above those of the fence table an earlier version kept, if there is one.

    Raises:
        SetupRequired: the sequence is missing and this role may not create it.
    """
    name = sequence(table, schema)
    async with connection.transaction():
        if not await _create(connection, name, _sequence_sql(name), "the fence sequence"):
            return
        old_table = _qualified(table, schema)
        if await _exists(connection, old_table):
            await connection.execute(
                sql.SQL(
                    "SELECT setval({seq}, max(fence)) FROM {table} "
                    "HAVING max(fence) > (SELECT last_value FROM {name})"
                ).format(seq=sql.Literal(name.as_string(connection)), table=old_table, name=name)
            )


async def ensure_ticket_table(
    connection: AsyncConnection[Any], table: str, schema: str | None
) -> None:
    """Make a fair queue's ticket table and its owner index if missing (by whichever
    process is first).

    A ticket table made by an earlier version has no owner index: it is added where this
    role may; elsewhere fair mode works without it, reading every ticket's row where the
    index would find the process's own, and a warning says to run the setup again.

    Raises:
        SetupRequired: the table is missing and this role may not create it.
    """
    name = ticket_table(table, schema)
    index = owner_index(table)
    async with connection.transaction():
        if await _create(connection, name, _ticket_table_sql(name), "fair mode's ticket table"):
            await connection.execute(_owner_index_sql(name, index))
            return
        if await _exists(connection, _qualified(index, schema)):
            return
        try:
            async with connection.transaction():  # a savepoint: refused, the rest holds
                await connection.execute("SELECT pg_advisory_xact_lock(%s)", (SETUP_LOCK,))
                await connection.execute(_owner_index_sql(name, index))
        except psycopg.errors.InsufficientPrivilege:
            where = name.as_string(connection)
            info = connection.info
            warned = (info.host, info.port, info.dbname, where)
            if warned in _WARNED_NO_INDEX:
                return  # said once per process: the ticket connection opens again and again
            _WARNED_NO_INDEX.add(warned)
            logger.warning(
                "fair mode's ticket table %s has no index %s, and this role may not add it: "
                "run 'python -m keyserial.postgres setup' or the SQL of setup_sql() again, as "
                "a role that may; until then each process's statements read every ticket",
                where,
                index,
            )


async def _create(
    connection: AsyncConnection[Any], name: sql.Identifier, create: sql.Composed, what: str
) -> bool:
    """Run ``create`` in the open transaction unless ``name`` exists; whether it ran.

    The setup lock makes processes that start together create it one at a time.

    Raises:
        SetupRequired: ``name`` is missing and this role may not create it.
    """
    if await _exists(connection, name):
        return False
    await connection.execute("SELECT pg_advisory_xact_lock(%s)", (SETUP_LOCK,))
    try:
        await connection.execute(create)
    except psycopg.errors.InsufficientPrivilege as exc:
        raise SetupRequired(
            f"{what} {name.as_string(connection)} does not exist, and this role may not "
            "create it: run 'python -m keyserial.postgres setup <dsn> --grant <role>' or the "
            "SQL of keyserial.postgres.setup_sql() once, as a role that may"
        ) from exc
    return True


async def _exists(connection: AsyncConnection[Any], name: sql.Identifier) -> bool:
    found = await connection.execute("SELECT to_regclass(%s)", (name.as_string(connection),))
    row = await found.fetchone()
    return row is not None and row[0] is not None


async def schema_of(connection: AsyncConnection[Any], table: str) -> str:
    """The schema where ``connection``'s search path finds the ticket table of a fair queue
    made with ``table=`` and no ``schema=``.

    Raises:
        SetupRequired: no schema on the search path holds it.
    """
    name = ticket_table(table, None)
    found = await connection.execute(
        "SELECT nspname FROM pg_namespace WHERE oid = "
        "(SELECT relnamespace FROM pg_class WHERE oid = to_regclass(%s))",
        (name.as_string(connection),),
    )
    row = await found.fetchone()
    if row is None:
        raise SetupRequired(
            f"fair mode's ticket table {name.as_string(connection)} is on no schema of the "
            "search path: run the setup step, or make the queue with schema="
        )
    return str(row[0])


async def setup(
    conninfo: str,
    *,
    table: str = DEFAULT_TABLE,
    schema: str | None = None,
    grant_to: str | None = None,
) -> None:
    """Make the fence sequence, the ticket table and the keyed stream tables on the database
    at ``conninfo``, and grant their use.

    Raises:
        SetupRequired: the role of ``conninfo`` may not create the sequence.
        psycopg.OperationalError: the database could not be reached.
    """
    async with await AsyncConnection.connect(conninfo) as connection:
        await ensure_sequence(connection, table, schema)
        await ensure_ticket_table(connection, table, schema)
        await ensure_stream_tables(connection)
        if grant_to is not None:
            for grant in _grants_sql(table, schema, grant_to):
                await connection.execute(grant)
            await grant_stream_tables(connection, grant_to)
        await connection.commit()


def main(argv: list[str] | None = None) -> None:
    """``python -m keyserial.postgres setup DSN [--table T] [--schema S] [--grant ROLE]``."""
    parser = argparse.ArgumentParser(
        prog="python -m keyserial.postgres",
        description="Make the fence sequence and ticket table a PostgresKeyedQueue needs, "
        "and the tables of keyed streams (once, as a role that may create objects).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("setup", help="create the queue's objects and grant their use")
    command.add_argument("dsn", help="a connection string, e.g. postgresql://admin@db/app")
    command.add_argument("--table", default=DEFAULT_TABLE, help="the queue's table= argument")
    command.add_argument("--schema", default=None, help="the queue's schema= argument")
    command.add_argument("--grant", default=None, metavar="ROLE", help="the application's role")
    command.add_argument("--print", action="store_true", help="print the SQL instead of running it")
    args = parser.parse_args(argv)
    if args.print:
        print(setup_sql(table=args.table, schema=args.schema, grant_to=args.grant, streams=True))
        return
    asyncio.run(setup(args.dsn, table=args.table, schema=args.schema, grant_to=args.grant))
    print(
        f"the fence sequence {args.table}_seq, the ticket table {args.table}_tq and the "
        "keyed stream tables are ready"
    )
