"""The first round trip of a turn: one query of several statements (see ``_turns``)."""

from __future__ import annotations

from psycopg import sql

from ._sql_text import rendered
from ._tickets import OTHERS_WAITING, ticket_lock

#: The first server version with ``client_connection_check_interval`` (PostgreSQL 14).
_CHECKS_CLIENT = 140000
_OTHERS = rendered(sql.Literal(OTHERS_WAITING))
#: The timeouts a turn sets while it waits for its locks: the call's own ``lock_timeout``
#: bounds the wait, and no ``statement_timeout`` (one the connection carries for the
#: application's statements would end the wait as if the server had gone). The turn keeps
#: the connection's values of both (`_KEEP`) and gives them back to the function's
#: statements (`_GIVE_BACK`), whether they came from the server's configuration or from a
#: ``SET`` on the session.
_TIMEOUTS = ("lock_timeout", "statement_timeout")
_KEEP = "SELECT " + ", ".join(
    f"set_config('keyserial.{name}', current_setting('{name}'), true)" for name in _TIMEOUTS
)
_GIVE_BACK = "SELECT " + ", ".join(
    f"set_config('{name}', current_setting('keyserial.{name}'), true)" for name in _TIMEOUTS
)


def milliseconds(seconds: float) -> str:
    """``seconds`` as a setting's value in whole milliseconds, at least one."""
    return f"{max(1, int(seconds * 1000))}ms"


def _set(name: str, value: str) -> str:
    """``set_config(name, value, true)``: a setting of the turn's transaction only (``name``
    and ``value`` are this package's own: no quotes in them)."""
    return f"set_config('{name}', '{value}', true)"


#: The first statement of a ticket's commit: the give-back after the function's statements
#: waits for its line's registration lock (see `TicketSql.registering`) and for its rows,
#: held only by this package's short statements. A ``lock_timeout`` or ``statement_timeout``
#: that the function set for the rest of its transaction must not end that wait: the commit
#: would fail, and the function's writes with it.
UNBOUNDED = f"SELECT {_set('lock_timeout', '0')}, {_set('statement_timeout', '0')}"


class TurnSql:
    """The statements that begin the turns of one queue: its fence sequence and lease."""

    def __init__(self, sequence: sql.Composable, lease: float) -> None:
        self.lease = lease
        #: How often a statement running in a turn checks that its client is still there.
        self.check_interval = min(1.0, lease / 3)
        self.fence = f"nextval({rendered(sql.Literal(sequence.as_string(None)))})"
        self.next_fence = f"SELECT {self.fence}"
        self.idle = _set("idle_in_transaction_session_timeout", milliseconds(lease))
        # A holder killed inside a long statement closes its socket; the server notices
        # within this interval and ends the turn, instead of when the statement ends.
        self.checks = _set("client_connection_check_interval", milliseconds(self.check_interval))

    def first(
        self,
        locks: list[int],
        lock_timeout: str,
        server_version: int,
        begin: bool,
        ticket: int | None,
        others_waiting: str | None,
    ) -> list[str]:
        """The statements of BEGIN (if ``begin``), the turn's settings, the locks of
        ``locks`` (ascending), the fence: the last statement's row holds the fence. The
        locks are waited for with the call's ``lock_timeout`` and no ``statement_timeout``;
        the function's statements get the connection's values of both back (`_TIMEOUTS`).

        A fair-mode ``ticket``'s try-lock comes before the keys' locks (see _early). With
        ``others_waiting`` (a direct turn), that statement runs first, the locks are taken
        only if it found no other process's call waiting with a ticket, and the fence's row
        also holds its answer, ``'false'`` if the locks were taken.

        Sent as one simple query of several statements, not in pipeline mode: the server
        arms its idle-in-transaction timer after a simple query, but not after the Sync
        that ends a pipeline, and without that timer a holder stopped before its first
        statement would keep the key for as long as it stays stopped.
        """
        waiting = [_set("lock_timeout", lock_timeout), _set("statement_timeout", "0")]
        settings = [*self._settings(server_version), *waiting] if begin else waiting
        statements = ["BEGIN", _KEEP] if begin else [_KEEP]
        statements.append(f"SELECT {', '.join(settings)}")
        if ticket is not None:
            statements.append(
                "SELECT pg_try_advisory_xact_lock({}, {})".format(*ticket_lock(ticket))
            )
        fence = self.next_fence
        if others_waiting is not None:
            statements.append(others_waiting)
            statements += [
                f"SELECT pg_advisory_xact_lock({lock}) WHERE current_setting({_OTHERS}) = 'false'"
                for lock in locks
            ]
            fence = f"{fence}, current_setting({_OTHERS})"
        else:
            statements += [f"SELECT pg_advisory_xact_lock({lock})" for lock in locks]
        statements.append(_GIVE_BACK)
        statements.append(fence)  # after the locks: ordered
        return statements

    def tried(self, locks: list[int], server_version: int, ticket: int) -> list[str]:
        """The statements of a ticket's turn that the commit of the turn ahead begins (see
        ``EarlyTurns.hand_over``): BEGIN, then one statement that makes the turn's settings,
        tries (does not wait for) the ticket's lock and those of ``locks`` and, only if it
        took them all, draws the fence. Its row's last column holds the fence, or NULL."""
        high, low = ticket_lock(ticket)
        tries = " AND ".join(
            [f"pg_try_advisory_xact_lock({high}, {low})"]
            + [f"pg_try_advisory_xact_lock({lock})" for lock in locks]
        )
        settings = ", ".join(self._settings(server_version))
        return ["BEGIN", f"SELECT {settings}, CASE WHEN {tries} THEN {self.fence} END"]

    def _settings(self, server_version: int) -> list[str]:
        """The settings of a turn's transaction."""
        return [self.idle, self.checks] if server_version >= _CHECKS_CLIENT else [self.idle]
