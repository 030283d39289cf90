"""Turning a decorated call's arguments into its queue key.

Each extractor takes ``(instance, args, kwargs)`` as wrapt passes them and
returns the key. The call's full positional arguments are ``args`` when
``instance`` is None, else ``(instance, *args)``; extractors index into that
without building the tuple, because they run on every call.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable
from typing import Any

KeyExtractor = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]

_MISSING = object()


class FunctionKey:
    """A token of one decorated function: the key its calls share when ``key=None``,
    or the group its calls coalesce in when ``coalesce=True``."""

    __slots__ = ("qualname",)

    def __init__(self, qualname: str) -> None:
        self.qualname = qualname

    def __repr__(self) -> str:
        return f"<all calls of {self.qualname}>"


def constant_key(key: Hashable) -> KeyExtractor:
    def extract(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return key

    return extract


def key_from_function(key_fn: Callable[..., Hashable]) -> KeyExtractor:
    def extract(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if instance is None:
            return key_fn(*args, **kwargs)
        return key_fn(instance, *args, **kwargs)

    return extract


def key_from_parameter(func: Callable[..., Any], name: str, qualname: str) -> KeyExtractor:
    """Read parameter ``name`` of ``func`` from a call; its position is found here, once.

    Raises:
        ValueError: ``func`` has no parameter ``name``, or it is ``*args``/``**kwargs``.
    """
    try:
        parameters = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError) as exc:
        raise ValueError(f"cannot read the signature of {qualname} to find {name!r}") from exc
    found = [(i, p) for i, p in enumerate(parameters) if p.name == name]
    if not found:
        names = ", ".join(p.name for p in parameters) or "none"
        raise ValueError(f"{qualname} has no parameter {name!r} to key by (parameters: {names})")
    position, parameter = found[0]
    if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
        raise ValueError(f"{qualname}: cannot key by variadic parameter {name!r}")
    if parameter.kind is parameter.KEYWORD_ONLY:
        position = -1
    elif any(p.kind is p.VAR_POSITIONAL for p in parameters[:position]):
        position = -1  # after *args it can only be passed by keyword
    positional_only = parameter.kind is parameter.POSITIONAL_ONLY
    default = _MISSING if parameter.default is parameter.empty else parameter.default

    def extract(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if position >= 0:
            index = position if instance is None else position - 1
            if index < 0:
                return instance  # keyed by ``self``/``cls`` itself
            if index < len(args):
                return args[index]
        if not positional_only and name in kwargs:
            return kwargs[name]
        if default is _MISSING:
            raise TypeError(f"missing argument {name!r}")
        return default

    return extract
