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


class FunctionKey:
    """A token of one decorated function: the key its calls share when ``key=None``,
    or the group its calls coalesce in when ``coalesce=True``."""

    __slots__ = ("qualname",)

    def __init__(self, qualname: str) -> None:
        self.qualname = qualname

    def __repr__(self) -> str:
        return f"<all calls of {self.qualname}>"


def unhashable_key(qualname: str, key: object, error: Exception) -> TypeError:
    """The error for a call whose key cannot be hashed."""
    return TypeError(
        f"{qualname}: its queue key must be hashable, got {type(key).__name__} {key!r} ({error})"
    )


def constant_key(key: Hashable) -> KeyExtractor:
    def extract(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return key

    return extract


RECEIVER_NAMES = ("self", "cls")
"""The first parameter names that make a decorated function a method, and that make a key
function ask for the method's instance or class."""


def has_receiver(fn: Any) -> bool:
    """Whether ``fn``, as given to ``@serialized``, is called with an instance or class first.

    A ``classmethod`` object is; a ``staticmethod`` object is not; a plain function is when
    its first parameter is named ``self`` or ``cls``, as Python's convention names them (the
    decorator may sit under ``@classmethod``, where it sees a plain function).
    """
    if isinstance(fn, classmethod):
        return True
    if isinstance(fn, staticmethod):
        return False
    return _first_parameter(fn) in RECEIVER_NAMES


def _first_parameter(fn: Callable[..., Any]) -> str | None:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    for parameter in parameters:
        if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
            return parameter.name
        return None
    return None


def key_from_function(
    key_fn: Callable[..., Any],
    func: Callable[..., Any],
    qualname: str,
    receiver: bool,
    hashed: bool = True,
) -> KeyExtractor:
    """Call ``key_fn`` with each call's arguments as the caller wrote them.

    On a method (``receiver``), the instance or class is passed to ``key_fn`` only when
    ``key_fn``'s own first parameter is named ``self`` or ``cls``. Whatever ``key_fn``
    raises propagates as itself. With ``hashed=False`` (a collection of keys), what it
    returns is not hashed here.

    Raises:
        TypeError: at decoration, ``key_fn`` cannot take the arguments ``func`` is called
            with (the message names both signatures).
    """
    drop = receiver and _first_parameter(key_fn) not in RECEIVER_NAMES
    check_arity(key_fn, func, qualname, drop)

    def extract(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # The call's positional arguments are ``args`` when ``instance`` is None (a plain
        # function, or a method bound as Python binds one), else ``(instance, *args)``.
        if drop:
            given = args[1:] if instance is None else args
        else:
            given = args if instance is None else (instance, *args)
        try:
            key = key_fn(*given, **kwargs)
        except TypeError:
            _raise_if_unbindable(key_fn, func, qualname, given, kwargs, drop, at_call=True)
            raise  # the key function's own TypeError
        if hashed:
            try:
                hash(key)
            except TypeError as exc:
                raise unhashable_key(qualname, key, exc) from exc
        return key

    return extract


def _raise_if_unbindable(
    key_fn: Callable[..., Any],
    func: Callable[..., Any],
    qualname: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dropped_receiver: bool,
    at_call: bool = False,
) -> None:
    """Raise the error naming both signatures if ``key_fn`` cannot take this call at all
    (``at_call``: a real call, whose keyword arguments the error names)."""
    try:
        key_signature = inspect.signature(key_fn)
    except (TypeError, ValueError):
        return
    try:
        key_signature.bind(*args, **kwargs)
    except TypeError as exc:
        error = _mismatch(key_fn, key_signature, func, qualname, exc, dropped_receiver)
        if at_call and kwargs:
            error = _by_keyword(error, key_fn, kwargs)
        raise error from None


def _mismatch(
    key_fn: Callable[..., Any],
    key_signature: inspect.Signature,
    func: Callable[..., Any],
    qualname: str,
    error: TypeError,
    dropped_receiver: bool,
) -> TypeError:
    name = getattr(key_fn, "__qualname__", repr(key_fn))
    rule = (
        "on a method it receives the arguments after self or cls, unless its own first "
        "parameter is named self or cls"
        if dropped_receiver
        else "it receives the call's arguments as the caller wrote them"
    )
    return TypeError(
        f"@serialized on {qualname}: the key function {name}{key_signature} cannot take "
        f"the arguments of {qualname}{inspect.signature(func)} ({error}); {rule}. Give it "
        "the same parameters, or end it with *args, **kwargs"
    )


def _by_keyword(error: TypeError, key_fn: Callable[..., Any], kwargs: dict[str, Any]) -> TypeError:
    """``error``, saying that the call passed ``kwargs`` by keyword, and what to do."""
    names = ", ".join(repr(name) for name in kwargs)
    return TypeError(
        f"{error}. This call passed {names} by keyword, and the key function gets the "
        "arguments as the caller wrote them, so it got them by keyword too: name its "
        "parameters as the decorated function names them, or key by parameter name "
        '(key="<parameter>"), which reads the key however it is passed'
    )


def _sample_calls(
    func: Callable[..., Any], drop_first: bool
) -> list[tuple[list[str], dict[str, str]]]:
    """The calls ``func`` accepts at both ends: every parameter given, and only required ones."""
    parameters = list(inspect.signature(func).parameters.values())
    if drop_first and _first_parameter(func) is not None:
        parameters = parameters[1:]  # the receiver, which the key function does not get
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


def check_arity(
    key_fn: Callable[..., Any], func: Callable[..., Any], qualname: str, drop_receiver: bool
) -> None:
    """Refuse, at decoration, a key function that cannot take the decorated function's calls.

    Raises:
        TypeError: naming both signatures, when binding them fails.
    """
    try:
        calls = _sample_calls(func, drop_receiver)
    except (TypeError, ValueError):
        return  # a signature Python cannot read: nothing to check
    for args, kwargs in calls:
        _raise_if_unbindable(key_fn, func, qualname, tuple(args), kwargs, drop_receiver)


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
            except TypeError as exc:
                raise unhashable_key(qualname, key, exc) from exc
        return key

    def _by_name(kwargs: dict[str, Any]) -> Any:
        if not positional_only and name in kwargs:
            return kwargs[name]
        if default is _MISSING:
            raise TypeError(f"{qualname}() missing required argument: {name!r}")
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
