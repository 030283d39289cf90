"""The first round trip of a turn: one query of several statements (see ``_turns``)."""

from __future__ import annotations

from psycopg import sql

from ._tickets import OTHERS_WAITING, ticket_lock

#: The first server version with ``client_connection_check_interval`` (PostgreSQL 14).
_CHECKS_CLIENT = 140000
_OTHERS = sql.Literal(OTHERS_WAITING)


def milliseconds(seconds: float) -> str:
    """``seconds`` as a setting's value in whole milliseconds, at least one."""
    return f"{max(1, int(seconds * 1000))}ms"


def _setting(name: str, seconds: float) -> sql.Composed:
    """``SELECT set_config(name, '...ms', true)``: a setting of the turn's transaction only."""
    return sql.SQL("SELECT set_config({}, {}, true)").format(
        sql.Literal(name), sql.Literal(milliseconds(seconds))
    )


class TurnSql:
    """The statements that begin the turns of one queue: its fence sequence and lease."""

    def __init__(self, sequence: sql.Composable, lease: float) -> None:
        self.lease = lease
        #: How often a statement running in a turn checks that its client is still there.
        self.check_interval = min(1.0, lease / 3)
        self.next_fence = sql.SQL("SELECT nextval({})").format(
            sql.Literal(sequence.as_string(None))
        )

    def first(
        self,
        locks: list[int],
        lock_timeout: str,
        server_version: int,
        begin: bool,
        ticket: int | None,
        others_waiting: sql.Composable | None,
    ) -> sql.Composed:
        """BEGIN (if ``begin``), the turn's settings, the locks of ``locks`` (ascending), the
        fence: the last statement's row holds the fence.

        A fair-mode ``ticket``'s try-lock comes before the keys' locks (see _early). With
        ``others_waiting`` (a direct turn), that statement runs first, the locks are taken
        only if it found no other process's call waiting with a ticket, and the fence's row
        also holds its answer, ``'false'`` if the locks were taken.

        Sent as one simple query of several statements, not in pipeline mode: the server
        arms its idle-in-transaction timer after a simple query, but not after the Sync
        that ends a pipeline, and without that timer a holder stopped before its first
        statement would keep the key for as long as it stays stopped.
        """
        statements: list[sql.Composable] = []
        if begin:
            statements.append(sql.SQL("BEGIN"))
            statements.append(_setting("idle_in_transaction_session_timeout", self.lease))
            if server_version >= _CHECKS_CLIENT:
                # A holder killed inside a long statement closes its socket; the server
                # notices within this interval and ends the turn, instead of when the
                # statement ends.
                statements.append(_setting("client_connection_check_interval", self.check_interval))
        statements.append(
            sql.SQL("SELECT set_config('lock_timeout', {}, true)").format(sql.Literal(lock_timeout))
        )
        if ticket is not None:
            statements.append(
                sql.SQL("SELECT pg_try_advisory_xact_lock({}, {})").format(
                    *map(sql.Literal, ticket_lock(ticket))
                )
            )
        condition: sql.Composable = sql.SQL("")
        fence: sql.Composable = self.next_fence
        if others_waiting is not None:
            statements.append(others_waiting)
            condition = sql.SQL(" WHERE current_setting({}) = 'false'").format(_OTHERS)
            fence = sql.SQL("{}, current_setting({})").format(self.next_fence, _OTHERS)
        statements.extend(
            sql.SQL("SELECT pg_advisory_xact_lock({}){}").format(sql.Literal(lock), condition)
            for lock in locks
        )
        statements.append(sql.SQL("SET LOCAL lock_timeout TO DEFAULT"))
        statements.append(fence)  # after the locks: ordered
        return sql.SQL("; ").join(statements)
