"""The PostgreSQL fixtures name the real cause when they cannot connect."""

from __future__ import annotations

import psycopg
import pytest

from .postgres_server import cannot_connect, private_database

pytestmark = pytest.mark.timeout(60)

DSN = "postgresql://postgres@127.0.0.1:5432/postgres"


def test_too_many_clients_is_named_as_such_not_as_a_missing_server() -> None:
    error = psycopg.OperationalError(
        'connection failed: connection to server at "127.0.0.1", port 5432 failed: '
        "FATAL:  sorry, too many clients already"
    )
    message = cannot_connect(DSN, error)
    assert "is up but refused a connection: too many clients" in message
    assert "no PostgreSQL server" not in message


def test_a_server_that_does_not_answer_is_named_as_missing() -> None:
    error = psycopg.OperationalError(
        'connection failed: connection to server at "127.0.0.1", port 1 failed: Connection refused'
    )
    assert cannot_connect(DSN, error).startswith("no PostgreSQL server answers at")


def test_the_fixture_reports_the_cause_it_met(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise psycopg.OperationalError("FATAL:  sorry, too many clients already")

    monkeypatch.setattr(psycopg, "connect", refuse)
    monkeypatch.setenv("CI", "true")  # under CI the fixture fails; elsewhere it skips
    with pytest.raises(pytest.fail.Exception, match="too many clients"), private_database():
        raise AssertionError("unreachable")
