"""``connection()``: the connection whose transaction holds the calling code's turn."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from contextvars import ContextVar, Token
from types import CodeType, FrameType
from typing import Any

from psycopg import AsyncConnection

from .._fence import innermost_turn
from ._turn import PgTurn

#: Code objects of the functions that run a turn, with a reader of their frame's turn.
_readers: dict[CodeType, Callable[[Mapping[str, Any]], PgTurn | None]] = {}
_blocks: ContextVar[tuple[tuple[FrameType, PgTurn], ...]] = ContextVar(
    "keyserial_postgres_blocks", default=()
)


def register_connection_code(code: CodeType) -> None:
    """Declare that a frame running ``code`` holds a turn in its local ``turn``."""

    def read(frame: Mapping[str, Any]) -> PgTurn | None:
        turn = frame.get("turn")
        return turn if isinstance(turn, PgTurn) else None

    _readers[code] = read


def enter_connection_block(owner: FrameType, turn: PgTurn) -> Token[Any]:
    """Mark the ``async with`` block of ``owner`` as holding ``turn``."""
    return _blocks.set((*_blocks.get(), (owner, turn)))


def exit_connection_block(token: Token[Any]) -> None:
    _blocks.reset(token)


def _giving(turn: PgTurn) -> Callable[[], PgTurn | None]:
    return lambda: turn


def connection() -> AsyncConnection[Any]:
    """The connection whose open transaction holds the turn the calling code runs in.

    Statements run on it commit together with the end of the turn (the function
    returns, the ``lock()`` block exits) and roll back when the call raises or is
    cancelled. A task or a thread that the turn's holder awaits (``gather``,
    ``TaskGroup``, ...) gets the same connection, as for
    [current_fence][keyserial.current_fence]; its statements join the turn's
    transaction (psycopg runs one statement of a connection at a time).

    Raises:
        RuntimeError: not called inside a turn of a ``PostgresKeyedQueue``.

    Example:
        ```python
        @serialized(key="seg_id", queue=queue)
        async def finalize(seg_id: str, text: str) -> None:
            await connection().execute(
                "UPDATE segment SET text = %s WHERE id = %s", (text, seg_id)
            )
        ```
    """
    blocks = {id(frame): _giving(turn) for frame, turn in _blocks.get()}
    turn = innermost_turn(_readers, blocks, sys._getframe(1))  # pyright: ignore[reportPrivateUsage]
    if turn is None:
        raise RuntimeError("connection() must be called inside a PostgresKeyedQueue turn")
    return turn.connection
