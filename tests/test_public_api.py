"""The public API: the names the project promises, each documented."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import keyserial
import keyserial.streams

from .public_api import public_api


def test_public_names() -> None:
    assert set(keyserial.__all__) >= {
        "KeyedSerialQueue",
        "serialized",
        "default_queue",
        "QueueFull",
        "QueueClosed",
    }
    for name in keyserial.__all__:
        assert hasattr(keyserial, name), name


def _public_members(obj: object) -> list[tuple[str, object]]:
    if not inspect.isclass(obj):
        return []
    return [
        (name, member)
        for name, member in vars(obj).items()
        if not name.startswith("_") and (callable(member) or isinstance(member, property))
    ]


def test_every_public_name_and_method_has_a_docstring() -> None:
    missing = []
    for module, name in [(keyserial, name) for name in keyserial.__all__] + [
        (keyserial.streams, name) for name in keyserial.streams.__all__
    ]:
        obj = getattr(module, name)
        if not (inspect.getdoc(obj) or "").strip():
            missing.append(name)
        for member_name, member in _public_members(obj):
            if not (inspect.getdoc(member) or "").strip():
                missing.append(f"{name}.{member_name}")
    assert missing == []


def test_callables_document_what_they_raise() -> None:
    # Every public callable that can fail on bad input says so in a "Raises:" section.
    queue_methods = ["run", "with_options", "submit", "lock"]
    documented = [keyserial.serialized, keyserial.KeyedSerialQueue] + [
        getattr(keyserial.KeyedSerialQueue, name) for name in queue_methods
    ]
    for obj in documented:
        assert "Raises:" in (inspect.getdoc(obj) or ""), obj


def test_the_public_api_is_what_it_was_before_the_redesign() -> None:
    # Names in keyserial.__all__ and keyserial.redis.__all__, and the signatures of every
    # public function and method (tests/public_api.py says how the snapshot is made).
    snapshot = json.loads((Path(__file__).parent / "public_api.json").read_text())
    assert public_api() == snapshot
