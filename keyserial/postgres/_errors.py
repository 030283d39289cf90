"""The errors of the PostgreSQL backend: what became of the turn, and what to do next.

Every error of its own derives from ``PostgresError`` and from the built-in exception it is a
case of, so ``except ConnectionError`` or ``except TimeoutError`` keeps working:

- ``PostgresUnavailable`` (``ConnectionError``): the server could not be reached, or the
  turn's session ended before its commit. Nothing of the turn was kept: safe to retry.
  - ``LeaseExpired``: the server ended the turn's session because its transaction sat
    idle longer than the lease (the process stalled). Nothing of the turn was kept.
- ``CommitInDoubt`` (``ConnectionError``): the connection broke while ``COMMIT`` was on
  its way; the turn's writes may or may not have been kept.
- ``TurnRolledBack`` (``RuntimeError``): the function returned, but its transaction had
  already failed; nothing was kept.
- ``PoolExhausted`` (``TimeoutError``): no connection of the pool came free within the
  pool's own timeout.

A turn that did not come within the call's ``timeout`` raises the built-in ``TimeoutError``,
and a cycle of waits that PostgreSQL broke raises ``keyserial.DeadlockError``, as on every
queue; both name the caller's keys.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

from .._errors import safe_repr


class PostgresError(Exception):
    """The base of the errors the PostgreSQL backend raises of its own.

    Example:
        ```pycon
        >>> issubclass(PostgresUnavailable, PostgresError)
        True

        ```
    """


class PostgresUnavailable(PostgresError, ConnectionError):
    """PostgreSQL could not be reached, or the turn's session ended before its commit.

    Nothing of the call's transaction was committed, so the call can be retried. Once the
    server is back, the queue works again without being recreated.

    Example:
        ```pycon
        >>> issubclass(PostgresUnavailable, ConnectionError)
        True

        ```
    """


class LeaseExpired(PostgresUnavailable):
    """The server ended the turn's session: its transaction sat idle longer than the lease.

    This is how a process that stalled (a pause, a debugger, swap) loses its turn: the key
    went to the next caller, and nothing the stalled turn wrote was kept.

    Example:
        ```pycon
        >>> issubclass(LeaseExpired, PostgresUnavailable)
        True

        ```
    """


class CommitInDoubt(PostgresError, ConnectionError):
    """The connection broke while the turn's ``COMMIT`` was on its way: it may have committed.

    The server may have committed the transaction and lost only its reply, or never have
    received the ``COMMIT``; the client cannot tell which. Don't retry blindly: read back
    what the turn wrote (in a new turn of the same key), or make the write idempotent, for
    example keyed by a request id with ``ON CONFLICT DO NOTHING``.

    Example:
        ```pycon
        >>> issubclass(CommitInDoubt, PostgresUnavailable)
        False

        ```
    """


class TurnRolledBack(PostgresError, RuntimeError):
    """The function returned, but its transaction had already failed: nothing was kept.

    A database error inside the turn aborts its transaction; a function that catches the
    error and returns normally would otherwise have its writes rolled back in silence.
    The turn's transaction was rolled back, and the function's result is not returned.
    Use a savepoint (``async with connection().transaction():``) around a statement whose
    error you mean to handle.

    Example:
        ```pycon
        >>> issubclass(TurnRolledBack, RuntimeError)
        True

        ```
    """


class PoolExhausted(PostgresError, TimeoutError):
    """Every connection of the pool stayed in use for the pool's whole ``timeout``.

    A process holds one connection per key it is running or waiting for in the database:
    raise the pool's ``max_size`` to the number of keys busy at once in the process, plus
    what the application uses outside turns.

    Example:
        ```pycon
        >>> issubclass(PoolExhausted, TimeoutError)
        True

        ```
    """


class SetupRequired(PostgresError, RuntimeError):
    """The fence sequence does not exist, and the application's role may not create it.

    Make it once, as a role that may create objects in the schema:
    ``python -m keyserial.postgres setup <dsn> --grant <app role>``, or the SQL of
    [setup_sql][keyserial.postgres.setup_sql] in a migration.

    Example:
        ```pycon
        >>> issubclass(SetupRequired, PostgresError)
        True

        ```
    """


def naming(keys: Mapping[int, Hashable]) -> str:
    """``key 'a'`` or ``keys ['a', 'b']``: the caller's keys, as errors name them."""
    names = list(keys.values())
    if len(names) == 1:
        return f"key {safe_repr(names[0])}"
    return f"keys {safe_repr(names)}"
