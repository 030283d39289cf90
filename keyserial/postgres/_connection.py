"""``connection()``: the connection whose transaction holds the calling code's turn, or the
transaction a PostgreSQL ``KeyedStream`` runs its handler in."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from psycopg import AsyncConnection

from .._fence import innermost_turn
from .._turns import OWNER, BlockTurn, TurnRecord
from ._turn import PgTurn


def _turn_of(record: TurnRecord) -> PgTurn | None:
    """The PostgreSQL turn a record stands for (a turn's own, or a block's), if any."""
    owner = record[OWNER]
    if type(owner) is BlockTurn:
        owner = owner.turn
    return owner if type(owner) is PgTurn else None


#: The connection of the stream handler's transaction the calling code runs in: set by a
#: ``KeyedStream`` on PostgreSQL around each attempt of its handler, and only there.
stream_transaction: ContextVar[AsyncConnection[Any] | None] = ContextVar(
    "keyserial.postgres.stream_transaction", default=None
)


def connection() -> AsyncConnection[Any]:
    """The connection whose open transaction holds the turn the calling code runs in.

    Statements run on it commit together with the end of the turn (the function
    returns, the ``lock()`` block exits) and roll back when the call raises or is
    cancelled. In the handler of a ``KeyedStream`` on PostgreSQL, it is the
    transaction that acknowledges the message: the handler's statements commit
    with the acknowledgement, or not at all. A task or a thread that the turn's
    holder awaits (``gather``, ``TaskGroup``, ...) gets the same connection, as
    for [current_fence][keyserial.current_fence]; its statements join the turn's
    transaction (psycopg runs one statement of a connection at a time).

    Raises:
        RuntimeError: not called inside a turn of a ``PostgresKeyedQueue`` nor in
            the handler of a ``KeyedStream`` on PostgreSQL.

    Example:
        ```python
        @serialized(key="seg_id", queue=queue)
        async def finalize(seg_id: str, text: str) -> None:
            await connection().execute(
                "UPDATE segment SET text = %s WHERE id = %s", (text, seg_id)
            )
        ```
    """
    turn = innermost_turn(_turn_of)
    if turn is not None:
        return turn.connection
    stream = stream_transaction.get()
    if stream is None:
        raise RuntimeError(
            "connection() must be called inside a PostgresKeyedQueue turn or the handler "
            "of a KeyedStream on PostgreSQL"
        )
    return stream
