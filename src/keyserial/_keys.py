"""Turning a decorated call's arguments into its queue key.

Each extractor takes ``(instance, args, kwargs)`` as wrapt passes them and
returns the key, hashed once so that a key that cannot be hashed is a ``TypeError``
naming the function as soon as it is called. The call's full positional arguments
are ``args`` when ``instance`` is None, else ``(instance, *args)``; extractors index
into that without building the tuple, because they run on every call.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable
from typing import Any

KeyExtractor = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]

_MISSING = object()


class ArgumentMismatch(TypeError):
    """A call whose arguments do not fit the decorated function: raised as Python would."""


class FunctionKey:
    """A token of one decorated function: the key its calls share when ``key=None``,
    or the group its calls coalesce in when ``coalesce=True``."""

    __slots__ = ("qualname",)

    def __init__(self, qualname: str) -> None:
        self.qualname = qualname

    def __repr__(self) -> str:
        return f"<all calls of {self.qualname}>"


def unhashable_key(qualname: str, error: Exception) -> TypeError:
    """The error for a call whose key could not be computed or hashed."""
    return TypeError(f"{qualname}: could not get a hashable queue key: {error}")


def constant_key(key: Hashable) -> KeyExtractor:
    def extract(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return key

    return extract


def key_from_function(
    key_fn: Callable[..., Any], func: Callable[..., Any], qualname: str, hashed: bool = True
) -> KeyExtractor:
    """Call ``key_fn`` with each call's arguments, once it is known to accept them.

    With ``hashed=False`` (a collection of keys), what it returns is not hashed here.

    Raises:
        TypeError: ``key_fn`` cannot take the arguments ``func`` is called with.
    """
    check_arity(key_fn, func, qualname)

    def extract(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            key = key_fn(*args, **kwargs) if instance is None else key_fn(instance, *args, **kwargs)
            if hashed:
                hash(key)
        except Exception as exc:
            raise unhashable_key(qualname, exc) from exc
        return key

    return extract


def _sample_calls(func: Callable[..., Any]) -> list[tuple[list[str], dict[str, str]]]:
    """The calls ``func`` accepts at both ends: every parameter given, and only required ones."""
    parameters = inspect.signature(func).parameters.values()
    full: tuple[list[str], dict[str, str]] = ([], {})
    required: tuple[list[str], dict[str, str]] = ([], {})
    for parameter in parameters:
        needed = parameter.default is parameter.empty
        if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
            full[0].append(parameter.name)
            if needed:
                required[0].append(parameter.name)
        elif parameter.kind is parameter.KEYWORD_ONLY:
            full[1][parameter.name] = parameter.name
            if needed:
                required[1][parameter.name] = parameter.name
    return [full, required]


def check_arity(key_fn: Callable[..., Any], func: Callable[..., Any], qualname: str) -> None:
    """Refuse, at decoration, a key function that cannot take the decorated function's calls.

    Raises:
        TypeError: naming both signatures, when binding them fails.
    """
    try:
        key_signature = inspect.signature(key_fn)
        calls = _sample_calls(func)
    except (TypeError, ValueError):
        return  # a signature Python cannot read: nothing to check
    for args, kwargs in calls:
        try:
            key_signature.bind(*args, **kwargs)
        except TypeError as exc:
            name = getattr(key_fn, "__qualname__", repr(key_fn))
            raise TypeError(
                f"@serialized on {qualname}: the key function {name}{key_signature} cannot "
                f"take the arguments of {qualname}{inspect.signature(func)} ({exc}); give it "
                "the same parameters, self or cls included for a method, or *args/**kwargs"
            ) from None


def key_from_parameter(
    func: Callable[..., Any], name: str, qualname: str, hashed: bool = True
) -> KeyExtractor:
    """Read parameter ``name`` of ``func`` from a call; its position is found here, once.

    With ``hashed=False`` (a collection of keys), the value is not hashed here.

    Raises:
        ValueError: ``func`` has no parameter ``name``, or it is ``*args``/``**kwargs``.
    """
    position, positional_only, default = _parameter(func, name, qualname)

    def extract(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # One function (no separate hashing step): it runs on every decorated call.
        index = position if instance is None else position - 1
        if position < 0:
            key = _by_name(kwargs)
        elif index < 0:
            key = instance  # keyed by ``self``/``cls`` itself
        elif index < len(args):
            key = args[index]
        else:
            key = _by_name(kwargs)
        if hashed:
            try:
                hash(key)
            except Exception as exc:
                raise unhashable_key(qualname, exc) from exc
        return key

    def _by_name(kwargs: dict[str, Any]) -> Any:
        if not positional_only and name in kwargs:
            return kwargs[name]
        if default is _MISSING:
            raise ArgumentMismatch(f"{qualname}() missing required argument: {name!r}")
        return default

    return extract


def parameter_position(func: Callable[..., Any], name: str, qualname: str) -> int:
    """Where parameter ``name`` of ``func`` sits among a call's positional arguments (``self``
    counted), or -1 if it can only be passed by keyword.

    Raises:
        ValueError: as ``key_from_parameter``.
    """
    return _parameter(func, name, qualname)[0]


def _parameter(func: Callable[..., Any], name: str, qualname: str) -> tuple[int, bool, Any]:
    """Parameter ``name`` of ``func``: its position (-1: keyword only), whether it is
    positional-only, and its default (``_MISSING`` if none)."""
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
    return position, positional_only, default
