"""The ``@serialized`` decorator: route every call of an async function through a keyed queue."""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import types
from collections.abc import Callable, Coroutine, Hashable, Iterable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, cast, overload

import wrapt

from ._keys import (
    FunctionKey,
    KeyExtractor,
    constant_key,
    has_receiver,
    key_from_function,
    key_from_parameter,
    parameter_position,
    unhashable_key,
)
from ._protocols import MultiKeySerialQueue, SerialQueue
from ._queue import KeyedSerialQueue, default_queue

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

AsyncFunction = Callable[P, Coroutine[Any, Any, R]]


def _import_qualified(module: str, qualname: str) -> Any:
    target: Any = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


if TYPE_CHECKING:
    _FunctionWrapper = wrapt.FunctionWrapper[..., Any]
    _BoundFunctionWrapper = wrapt.BoundFunctionWrapper[..., Any]
else:  # older wrapt releases cannot be subscripted at run time
    _FunctionWrapper = wrapt.FunctionWrapper
    _BoundFunctionWrapper = wrapt.BoundFunctionWrapper


class _BoundSerializedFunction(_BoundFunctionWrapper):
    """A serialized method bound to its instance or class."""

    __slots__ = ()  # made on every attribute access: no per-instance __dict__ to allocate

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        owner = self._self_instance if self._self_instance is not None else self._self_owner
        return getattr, (owner, self.__name__)


class _SerializedFunction(_FunctionWrapper):
    """A function whose calls run through a keyed queue."""

    __bound_function_wrapper__ = _BoundSerializedFunction

    # Subclassed once per decorated function by _serialize, which supplies __call__: called
    # unbound, the wrapped object is a plain function (or one that got ``cls`` in ``args``),
    # so wrapt's per-call search for a ``__self__`` to bind to (an AttributeError each time)
    # is not needed.

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return _import_qualified, (self.__module__, self.__qualname__)


def _named_after(method: Any, qualname: str) -> Any:
    """``method``, made to name the coroutines it returns ``qualname``.

    A coroutine takes its ``__qualname__`` from the function that made it: a copy of the
    queue's method under the decorated function's name makes every call's coroutine show
    that name (in ``repr``, in tasks, in "coroutine ... was never awaited") at no cost
    per call. The code object is shared, so tracebacks still show the queue's method.
    """
    function = getattr(method, "__func__", None)
    owner = getattr(method, "__self__", None)
    if not isinstance(function, types.FunctionType) or owner is None:
        return method  # not a plain Python method: use it as it is
    renamed = types.FunctionType(
        function.__code__,
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    renamed.__kwdefaults__ = function.__kwdefaults__
    renamed.__qualname__ = qualname
    return types.MethodType(renamed, owner)


def _renaming(
    run: Callable[..., Coroutine[Any, Any, Any]], qualname: str
) -> Callable[..., Coroutine[Any, Any, Any]]:
    """``run``, its coroutines renamed ``qualname`` (``_named_after`` cannot: such a ``run``
    makes its coroutine in another method)."""

    def renamed(key: Hashable, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        coroutine = run(key, fn, *args, **kwargs)
        # Another queue's run may return an awaitable that is not a coroutine: keep its name.
        with contextlib.suppress(AttributeError, TypeError):
            coroutine.__qualname__ = qualname  # type: ignore[attr-defined]
        return coroutine

    return renamed


def _bind_plain_method(self: Any, instance: Any, owner: type | None = None) -> Any:
    """Bind a serialized plain function to ``instance`` as Python binds any function.

    wrapt binds by building a proxy object on every attribute access and then calling the
    wrapper through it, which made a serialized method call cost a multiple of a plain
    queue call (benchmarks: the decorated rows). A plain function needs none of that: a
    bound method over the wrapper passes ``instance`` as the first argument, which is where
    the unbound call path expects ``self``. Introspection goes through the method object to
    the wrapper and on to the function (name, signature, ``__wrapped__``,
    coroutine-function status), and it pickles as ``getattr(instance, name)``. Accessed on
    the class, it is wrapt's as before.
    """
    if instance is None:
        return _FunctionWrapper.__get__(self, instance, owner)
    return types.MethodType(self, instance)


def _underlying_function(fn: Any) -> Any:
    if isinstance(fn, (classmethod, staticmethod)):
        return cast("Any", fn).__func__
    return fn


def _check_async(fn: Any, qualname: str) -> None:
    func = _underlying_function(fn)
    if inspect.isasyncgenfunction(func):
        raise TypeError(f"@serialized cannot wrap async generator function {qualname}")
    if not inspect.iscoroutinefunction(func):
        raise TypeError(f"@serialized needs an async def function; {qualname} is not one")


def _make_extractor(
    key: str | Callable[..., Any] | None, fn: Any, qualname: str, hashed: bool = True
) -> KeyExtractor:
    if key is None:
        return constant_key(FunctionKey(qualname))
    if isinstance(key, str):
        return key_from_parameter(_underlying_function(fn), key, qualname, hashed)
    if callable(key):
        return key_from_function(key, _underlying_function(fn), qualname, has_receiver(fn), hashed)
    raise TypeError(f"@serialized key must be a parameter name, a callable or None, got {key!r}")


def _serialize(
    fn: Any,
    key: str | Callable[..., Hashable] | None,
    queue: SerialQueue | None,
    timeout: float | None,
    keys: str | Callable[..., Iterable[Hashable]] | None = None,
    coalesce: bool = False,
) -> Any:
    qualname = getattr(_underlying_function(fn), "__qualname__", repr(fn))
    _check_async(fn, qualname)
    if timeout is not None and not timeout >= 0:
        raise ValueError(f"@serialized timeout must be None or a number >= 0, got {timeout!r}")
    target: SerialQueue = default_queue() if queue is None else queue
    if keys is not None:
        if key is not None:
            raise TypeError(f"@serialized on {qualname}: give key= or keys=, not both")
        if coalesce:
            raise TypeError(f"@serialized on {qualname}: coalesce=True works with key=, not keys=")
        return _serialize_multi(fn, keys, target, timeout, qualname)
    extract = _make_extractor(key, fn, qualname)

    # Every call takes its turn through the queue's own run(), or the run() of a view with
    # the decorator's options, each made once here and renamed after the decorated function.
    run: Callable[..., Coroutine[Any, Any, Any]]
    if coalesce:
        if not isinstance(target, KeyedSerialQueue):
            raise TypeError(
                f"@serialized on {qualname}: coalesce=True needs an in-process "
                f"KeyedSerialQueue; {type(target).__name__} does not coalesce"
            )
        # Calls of this function supersede each other's waiting calls, and no one else's.
        options = target.with_options(timeout=timeout, group=FunctionKey(qualname))
        run = _renaming(options.run, qualname)
    elif timeout is not None:
        run = _renaming(target.with_options(timeout=timeout).run, qualname)
    elif isinstance(target, KeyedSerialQueue):
        run = _named_after(target.run, qualname)
    else:
        run = _renaming(target.run, qualname)

    def route(
        wrapped: Callable[..., Coroutine[Any, Any, Any]],
        instance: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Coroutine[Any, Any, Any]:
        return run(extract(instance, args, kwargs), wrapped, *args, **kwargs)

    # Where the key sits among a call's positional arguments, when it can be passed so.
    position = (
        parameter_position(_underlying_function(fn), key, qualname) if isinstance(key, str) else -1
    )

    class SerializedFunction(_SerializedFunction):
        # A class per decorated function lets the unbound call path read what it needs from
        # this closure: attribute lookups on a wrapt proxy are slow.
        if position >= 0:
            # The key passed by position, read here rather than by ``extract``: a call
            # frame less on every decorated call (benchmarks: function ÷ run). ``extract``
            # reads a key passed by name or defaulted.
            def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
                if len(args) > position:
                    call_key = args[position]
                    try:
                        hash(call_key)
                    except TypeError as exc:
                        raise unhashable_key(qualname, call_key, exc) from exc
                else:
                    call_key = extract(None, args, kwargs)
                return run(call_key, fn, *args, **kwargs)

        else:

            def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
                return run(extract(None, args, kwargs), fn, *args, **kwargs)

        if isinstance(fn, types.FunctionType):
            __get__ = _bind_plain_method

    SerializedFunction.__qualname__ = SerializedFunction.__name__ = f"serialized[{qualname}]"
    return SerializedFunction(fn, route)


def _serialize_multi(
    fn: Any,
    keys: str | Callable[..., Iterable[Hashable]],
    target: SerialQueue,
    timeout: float | None,
    qualname: str,
) -> Any:
    if not isinstance(target, MultiKeySerialQueue):
        raise TypeError(f"@serialized on {qualname}: keys= needs a queue with lock_all()")
    lock_all = target.lock_all
    extract = _make_extractor(keys, fn, qualname, hashed=False)

    def keys_of(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Hashable]:
        # What the key function or parameter gives must be an iterable of hashable keys;
        # an exception of the key function's own propagates as it is.
        given = extract(instance, args, kwargs)
        if isinstance(given, (str, bytes)) or not isinstance(given, Iterable):
            raise TypeError(
                f"{qualname}: keys= must give an iterable of keys (a list or a tuple), "
                f"got {type(given).__name__} {given!r}"
            )
        call_keys: list[Hashable] = list(cast("Iterable[Hashable]", given))
        for call_key in call_keys:
            try:
                hash(call_key)
            except TypeError as exc:
                raise unhashable_key(qualname, call_key, exc) from exc
        return call_keys

    async def run_holding_all(
        call_keys: list[Hashable],
        wrapped: Callable[..., Coroutine[Any, Any, Any]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        async with lock_all(call_keys, timeout):
            return await wrapped(*args, **kwargs)

    run_holding_all.__qualname__ = qualname  # its coroutines show the decorated function

    def route(
        wrapped: Callable[..., Coroutine[Any, Any, Any]],
        instance: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Coroutine[Any, Any, Any]:
        return run_holding_all(keys_of(instance, args, kwargs), wrapped, args, kwargs)

    class SerializedFunction(_SerializedFunction):
        def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
            return run_holding_all(keys_of(None, args, kwargs), fn, args, kwargs)

    SerializedFunction.__qualname__ = SerializedFunction.__name__ = f"serialized[{qualname}]"
    return SerializedFunction(fn, route)


@overload
def serialized(fn: AsyncFunction[P, R], /) -> AsyncFunction[P, R]: ...


@overload
def serialized(
    *,
    key: str | Callable[..., Hashable] | None = None,
    queue: SerialQueue | None = None,
    timeout: float | None = None,
    keys: str | Callable[..., Iterable[Hashable]] | None = None,
    coalesce: bool = False,
) -> Callable[[AsyncFunction[P, R]], AsyncFunction[P, R]]: ...


def serialized(
    fn: Any = None,
    /,
    *,
    key: str | Callable[..., Hashable] | None = None,
    queue: SerialQueue | None = None,
    timeout: float | None = None,
    keys: str | Callable[..., Iterable[Hashable]] | None = None,
    coalesce: bool = False,
) -> Any:
    """Decorate an ``async def`` function so that its calls run one at a time per key.

    Each call is routed through ``queue`` (the process-wide [default_queue][keyserial.default_queue]
    when ``None``), so different functions decorated with equal keys on one
    queue are ordered with each other. The decorated function keeps its
    signature, name, docstring, ``__wrapped__`` and coroutine-function status;
    it works on functions, methods, classmethods and staticmethods, and
    module-level functions and methods pickle by reference.

    Args:
        key: how to get a call's key: a parameter name (read from positional,
            keyword or default values; its position is found once, here); a
            callable that receives the call's arguments as the caller wrote
            them; or ``None``, so that all calls share one key. On a method
            (a function whose first parameter is named ``self`` or ``cls``, or
            a ``classmethod``) the callable does not receive the instance or
            class, unless its own first parameter is named ``self`` or ``cls``:
            ``key=lambda seg_id, *a, **k: seg_id`` keys by the segment, and
            ``key=lambda self, seg_id, *a, **k: (self.tenant, seg_id)`` by
            the instance's tenant too. A ``staticmethod`` receives its arguments.
        keys: instead of ``key``, how to get the several keys a call must hold
            at once (a parameter name or a callable, as for ``key``, giving an
            iterable of keys); see [KeyedSerialQueue.run_all][keyserial.KeyedSerialQueue.run_all].
        queue: the queue to route calls through.
        timeout: bound, in seconds, on the wait for the turn only; on expiry the
            call raises the built-in `TimeoutError` and never starts.
        coalesce: latest wins: a call that has to wait supersedes this
            function's call for the same key that is still waiting, which then
            raises [Superseded][keyserial.Superseded] and never starts. A started call is never
            interrupted; calls of other functions keep their places.

    Raises:
        TypeError: at decoration, ``fn`` is not an ``async def`` function (a sync
            function or an async generator function), or ``key`` is of the
            wrong type, or both ``key`` and ``keys`` are given, or the key
            function cannot take the decorated function's arguments (the
            message names both signatures). At call time, the key is not
            hashable (the message names the decorated function); nothing is
            registered then. An exception raised by the key function itself
            propagates unchanged.
        ValueError: at decoration, ``key`` names no parameter of ``fn`` (or a
            ``*args``/``**kwargs`` one), or ``timeout`` is negative.

    Example:
        ```pycon
        >>> import asyncio
        >>> from keyserial import serialized
        >>> log: list[str] = []
        >>> @serialized(key=lambda seg_id, *args, **kwargs: seg_id)
        ... async def save(seg_id: str, text: str) -> None:
        ...     await asyncio.sleep(0)
        ...     log.append(f"{seg_id}:{text}")
        >>> class Transcripts:
        ...     @serialized(key=lambda seg_id, *args, **kwargs: seg_id)
        ...     async def finalize(self, seg_id: str, text: str) -> None:
        ...         log.append(f"{seg_id}:final {text}")
        >>> async def main() -> None:
        ...     await asyncio.gather(
        ...         save("a", "partial"), save("a", "revised"),
        ...         Transcripts().finalize(seg_id="a", text="done"),
        ...     )
        >>> asyncio.run(main())
        >>> log
        ['a:partial', 'a:revised', 'a:final done']

        ```
    """
    if isinstance(fn, str):
        raise TypeError(
            f"@serialized takes the key by keyword: write @serialized(key={fn!r}), "
            f"not @serialized({fn!r})"
        )
    if fn is not None:
        return _serialize(fn, key, queue, timeout, keys, coalesce)
    return functools.partial(
        _serialize, key=key, queue=queue, timeout=timeout, keys=keys, coalesce=coalesce
    )
