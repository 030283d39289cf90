"""The public API as data: names, and the signatures of public callables and methods.

``tests/public_api.json`` holds it as it was before the redesign; ``test_public_api``
checks that the package still offers exactly that. Regenerate it on purpose only::

    python -m tests.public_api > tests/public_api.json
"""

from __future__ import annotations

import inspect
import json
from types import ModuleType
from typing import Any

import keyserial
import keyserial.redis

#: Dunder methods that are part of what users call.
_PUBLIC_DUNDERS = {"__init__", "__len__", "__contains__", "__aenter__", "__aexit__", "__repr__"}


def _members(cls: type) -> dict[str, str]:
    members: dict[str, str] = {}
    for name in sorted(dir(cls)):
        if name.startswith("_") and name not in _PUBLIC_DUNDERS:
            continue
        static = inspect.getattr_static(cls, name)
        if isinstance(static, property):
            members[name] = "property"
        elif inspect.isfunction(static) or isinstance(static, (staticmethod, classmethod)):
            members[name] = str(inspect.signature(getattr(cls, name)))
    return members


def describe(module: ModuleType) -> dict[str, Any]:
    described: dict[str, Any] = {}
    for name in sorted(module.__all__):
        obj = getattr(module, name)
        if inspect.isclass(obj):
            described[name] = _members(obj)
        elif callable(obj):
            described[name] = {"()": str(inspect.signature(obj))}
        else:
            described[name] = {"value": repr(obj)}
    return described


def public_api() -> dict[str, Any]:
    return {"keyserial": describe(keyserial), "keyserial.redis": describe(keyserial.redis)}


if __name__ == "__main__":
    print(json.dumps(public_api(), indent=1, sort_keys=True))
