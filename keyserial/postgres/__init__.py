"""A keyed serial queue on PostgreSQL: the turn and the function's writes commit together.

Extra: ``pip install "keyserial[postgres]"`` (psycopg 3 and psycopg_pool). See
[PostgresKeyedQueue][keyserial.postgres.PostgresKeyedQueue].

The modules: ``_queue`` (the queue), ``_turns`` (a turn as a transaction holding advisory
locks), ``_errors`` (the backend's errors), ``_turn`` (the turn record and the session
keeper), ``_lock`` (lock blocks), ``_connection`` (``connection()``), ``_ids`` (keys to
advisory-lock ids), ``_setup`` (the fence sequence and the setup command).
"""

from .._extras import require_extra

require_extra("keyserial.postgres", "postgres", "psycopg", "psycopg_pool")
from ._connection import connection
from ._errors import (
    CommitInDoubt,
    LeaseExpired,
    PoolExhausted,
    PostgresError,
    PostgresUnavailable,
    SetupRequired,
    TurnRolledBack,
)
from ._ids import lock_id
from ._queue import MIN_LEASE as MIN_LEASE
from ._queue import PostgresKeyedQueue
from ._setup import setup, setup_sql

__all__ = [
    "CommitInDoubt",
    "LeaseExpired",
    "PoolExhausted",
    "PostgresError",
    "PostgresKeyedQueue",
    "PostgresUnavailable",
    "SetupRequired",
    "TurnRolledBack",
    "connection",
    "lock_id",
    "setup",
    "setup_sql",
]
