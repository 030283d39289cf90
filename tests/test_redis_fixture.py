"""The redis-server fixture: a missing server fails under CI=true and skips elsewhere."""

from __future__ import annotations

import pytest


def test_missing_redis_server_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    from . import redis_server as module

    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="redis-server is not installed"):
        module.redis_server_binary()
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception):
        module.redis_server_binary()
