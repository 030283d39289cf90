"""SQL put together as text, for the statements a turn sends each time, and their rows.

They are sent on every turn, so they are put together as plain text, from integers and from
names and literals that psycopg rendered once (`rendered`), rather than composed with
``psycopg.sql`` each time.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import psycopg
from psycopg import sql


def rendered(composable: sql.Composable) -> str:
    """``composable`` (a name or a literal) as SQL text, rendered without a connection."""
    return composable.as_string(None)


def bigints(values: Iterable[int]) -> str:
    """``values`` as an SQL array of bigints."""
    return f"ARRAY[{', '.join(map(str, values))}]::bigint[]"


def query(statements: Iterable[str]) -> sql.SQL:
    """``statements`` as one query of several statements.

    Each is text made only of this package's fixed SQL, integers, and names and literals
    that `rendered` made: nothing a caller passes as a string reaches it unquoted.
    """
    # psycopg types the text of sql.SQL as a LiteralString, which this text is made of.
    return sql.SQL("; ".join(statements))  # pyright: ignore[reportArgumentType]


async def every_result(cursor: psycopg.AsyncCursor[Any]) -> list[list[Any]]:
    """The rows of every statement of a `query` of several statements, in order (none for
    those without rows)."""
    results: list[list[Any]] = []
    while True:
        results.append(list(await cursor.fetchall()) if cursor.description else [])
        if not cursor.nextset():
            return results
