"""@serialized on functions, methods, classmethods and staticmethods."""

from __future__ import annotations

import asyncio
import gc
import inspect
import pickle
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from keyserial import KeyedSerialQueue, WaitOptions, default_queue, serialized

from . import serialized_targets as targets
from .scheduling import settle

pytestmark = pytest.mark.asyncio


async def test_same_key_calls_of_different_functions_are_mutually_ordered() -> None:
    log: list[str] = []
    gate = asyncio.Event()

    @serialized(key="seg_id")
    async def save_partial(seg_id: str, text: str) -> None:
        log.append(f"partial {seg_id} {text}")
        await gate.wait()

    @serialized(key=lambda seg_id, *a, **k: seg_id)
    async def finalize(seg_id: str) -> None:
        log.append(f"final {seg_id}")

    tasks = [
        asyncio.create_task(save_partial("a", "x")),
        asyncio.create_task(finalize("a")),
        asyncio.create_task(finalize("b")),
    ]
    await settle()
    assert log == ["partial a x", "final b"]
    assert default_queue().pending("a") == 2
    gate.set()
    await asyncio.gather(*tasks)
    assert log == ["partial a x", "final b", "final a"]
    assert len(default_queue()) == 0


async def test_key_by_name_from_positional_keyword_and_default() -> None:
    queue = KeyedSerialQueue()
    seen: list[object] = []

    class SpyQueue:
        def run(self, key: object, fn: Callable[..., Awaitable[Any]], /, *a: Any, **k: Any) -> Any:
            seen.append(key)
            return queue.run(key, fn, *a, **k)

        def with_options(self, *, timeout: float | None = None) -> WaitOptions:
            raise AssertionError("@serialized without options routes through run()")

    @serialized(key="seg", queue=SpyQueue())
    async def handler(prefix: str, seg: str = "default-seg", *, flag: bool = False) -> str:
        return f"{prefix}{seg}{flag}"

    assert await handler("p", "pos") == "pposFalse"
    assert await handler("p", seg="kw") == "pkwFalse"
    assert await handler("p") == "pdefault-segFalse"
    assert await handler(prefix="p", seg="both", flag=True) == "pbothTrue"
    assert seen == ["pos", "kw", "default-seg", "both"]


async def test_key_by_keyword_only_and_positional_only_parameters() -> None:
    @serialized(key="seg")
    async def kwonly(*, seg: str) -> str:
        return seg

    @serialized(key="seg")
    async def posonly(seg: str, /) -> str:
        return seg

    assert await kwonly(seg="a") == "a"
    assert await posonly("b") == "b"


async def test_key_none_shares_one_key_per_function() -> None:
    log: list[str] = []
    gate = asyncio.Event()

    @serialized
    async def one(name: str) -> None:
        log.append(f"start {name}")
        await gate.wait()

    @serialized()
    async def other(name: str) -> None:
        log.append(f"other {name}")

    tasks = [asyncio.create_task(one("a")), asyncio.create_task(one("b"))]
    tasks.append(asyncio.create_task(other("c")))
    await settle()
    assert log == ["start a", "other c"]
    gate.set()
    await asyncio.gather(*tasks)
    assert log == ["start a", "other c", "start b"]


async def test_methods_classmethods_and_staticmethods() -> None:
    service = targets.Service("svc")
    assert await service.method("s1") == "svc:s1"
    assert await targets.Service.method(service, "s2") == "svc:s2"
    for name in ("class_above", "class_below"):
        assert await getattr(targets.Service, name)("s") == "Service:s"
        assert await getattr(service, name)("s") == "Service:s"
    for name in ("static_above", "static_below"):
        assert await getattr(targets.Service, name)("s") == "static:s"
        assert await getattr(service, name)("s") == "static:s"
    assert len(targets.QUEUE) == 0


async def test_method_key_function_receives_the_callers_arguments() -> None:
    seen: list[tuple[object, ...]] = []

    def spy_key(*args: object, **kwargs: object) -> str:
        seen.append(args)
        return "k"

    def spy_key_with_self(self: object, *args: object, **kwargs: object) -> str:
        seen.append((self, *args))
        return "k"

    class Thing:
        @serialized(key=spy_key)
        async def act(self, x: int) -> int:
            return x

        @serialized(key=spy_key_with_self)
        async def act_keyed_by_self(self, x: int) -> int:
            return x

    thing = Thing()
    assert await thing.act(1) == 1
    assert await Thing.act(thing, 2) == 2
    assert await thing.act_keyed_by_self(3) == 3
    assert await Thing.act_keyed_by_self(thing, 4) == 4
    assert seen == [(1,), (2,), (thing, 3), (thing, 4)]


async def test_method_reentry_through_another_serialized_method() -> None:
    log: list[str] = []

    class Transcripts:
        @serialized(key="seg_id")
        async def apply_revision(self, seg_id: str) -> None:
            log.append("revision")

        @serialized(key="seg_id")
        async def finalize(self, seg_id: str) -> None:
            await self.apply_revision(seg_id)  # same task, same key: runs inline
            log.append("final")

    await asyncio.wait_for(Transcripts().finalize("s"), timeout=5)
    assert log == ["revision", "final"]


async def test_metadata_is_preserved() -> None:
    assert inspect.iscoroutinefunction(targets.save)
    assert inspect.iscoroutinefunction(targets.Service.method)
    assert inspect.iscoroutinefunction(targets.Service("x").method)
    for name in ("class_above", "class_below", "static_above", "static_below"):
        assert inspect.iscoroutinefunction(getattr(targets.Service, name)), name
    assert targets.save.__name__ == "save"
    assert targets.save.__qualname__ == "save"
    assert targets.save.__doc__ == "Save a segment."
    assert str(inspect.signature(targets.save)) == "(seg_id: 'str', text: 'str' = '') -> 'str'"
    assert inspect.unwrap(targets.save) is not targets.save
    assert getattr(targets.save, "__wrapped__").__name__ == "save"  # noqa: B009
    assert targets.Service.method.__qualname__ == "Service.method"


async def test_decorated_functions_and_methods_pickle_by_reference() -> None:
    assert pickle.loads(pickle.dumps(targets.save)) is targets.save
    service = targets.Service("p")
    bound = pickle.loads(pickle.dumps(service.method))
    assert await bound("s") == "p:s"
    assert await pickle.loads(pickle.dumps(targets.Service.class_below))("s") == "Service:s"


async def test_sync_and_async_generator_functions_are_rejected_at_decoration() -> None:
    def sync(seg_id: str) -> None:
        return None

    async def agen(seg_id: str) -> Any:
        yield seg_id

    with pytest.raises(TypeError, match="async def"):
        serialized(key="seg_id")(sync)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="async generator"):
        serialized(key="seg_id")(agen)
    with pytest.raises(TypeError, match="async def"):
        serialized(staticmethod(sync))  # type: ignore[arg-type]


async def test_bad_key_specifications_fail_at_decoration() -> None:
    async def fn(seg_id: str, *rest: str, **extra: str) -> None:
        return None

    with pytest.raises(ValueError, match=r"no parameter 'segment'.*seg_id"):
        serialized(key="segment")(fn)
    with pytest.raises(ValueError, match="variadic"):
        serialized(key="rest")(fn)
    with pytest.raises(TypeError, match="key must be"):
        serialized(key=42)(fn)  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="timeout"):
        serialized(key="seg_id", timeout=-1)(fn)
    with pytest.raises(TypeError, match=r"by keyword: write @serialized\(key='seg_id'\)"):
        serialized("seg_id")  # type: ignore[call-overload]


async def test_a_key_function_that_cannot_take_the_calls_arguments_is_refused_at_decoration() -> (
    None
):
    class Service:
        async def finalize(self, seg_id: str, text: str = "") -> None:
            return None

    with pytest.raises(TypeError, match=r"key function .*\(seg_id\) cannot take the arguments"):
        serialized(key=lambda seg_id: seg_id)(Service.finalize)  # forgot self
    with pytest.raises(TypeError, match="missing a required argument: 'text'"):
        serialized(key=lambda self, seg_id, text: seg_id)(Service.finalize)  # text has a default
    # These fit every call.
    serialized(key=lambda self, seg_id, *rest, **named: seg_id)(Service.finalize)
    serialized(key=lambda self, seg_id, text="": seg_id)(Service.finalize)


async def test_key_failures_raise_from_the_call_naming_the_function() -> None:
    def unhashable(seg_id: str) -> Any:
        return {"unhashable": seg_id}

    @serialized(key=unhashable)
    async def unhashable_key(seg_id: str) -> None:
        raise AssertionError("must not run")

    @serialized(key=lambda seg_id: seg_id["missing"])
    async def failing_key(seg_id: dict[str, str]) -> None:
        raise AssertionError("must not run")

    @serialized(key="seg_id")
    async def needs_seg(seg_id: str) -> None:
        raise AssertionError("must not run")

    with pytest.raises(TypeError, match=r"unhashable_key: its queue key must be hashable"):
        _ = unhashable_key("a")
    with pytest.raises(KeyError, match="missing"):
        _ = failing_key({})
    with pytest.raises(TypeError, match=r"needs_seg\(\) missing required argument: 'seg_id'"):
        _ = needs_seg()  # type: ignore[call-arg]
    # A key read from a parameter that cannot be hashed, passed by position or by name.
    with pytest.raises(TypeError, match=r"needs_seg: its queue key must be hashable, got list"):
        _ = needs_seg(["not", "hashable"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"needs_seg: its queue key must be hashable, got list"):
        _ = needs_seg(seg_id=["not", "hashable"])  # type: ignore[arg-type]

    class Service:
        @serialized(key="seg_id")
        async def handle(self, seg_id: str) -> None:
            raise AssertionError("must not run")

    with pytest.raises(TypeError, match=r"Service.handle: its queue key must be hashable"):
        _ = Service().handle(["not", "hashable"])  # type: ignore[arg-type]
    assert len(default_queue()) == 0


async def test_decorator_timeout_bounds_the_wait_only() -> None:
    gate = asyncio.Event()
    log: list[str] = []

    @serialized(key="k", timeout=0)
    async def quick_to_give_up(k: str, name: str) -> None:
        log.append(name)
        await gate.wait()

    first = asyncio.create_task(quick_to_give_up("a", "first"))
    await settle()
    with pytest.raises(TimeoutError):
        await quick_to_give_up("a", "second")
    gate.set()
    await first
    await quick_to_give_up("a", "third")
    assert log == ["first", "third"]


async def test_calling_registers_only_when_awaited() -> None:
    @serialized(key="k")
    async def work(k: str) -> str:
        return k

    coro = work("a")
    assert len(default_queue()) == 0
    assert await coro == "a"
    unawaited = work("b")
    unawaited.close()
    assert len(default_queue()) == 0


async def test_coroutines_and_tasks_carry_the_users_function_name() -> None:
    queue = KeyedSerialQueue()

    @serialized(key="seg_id", queue=queue)
    async def save_partial(seg_id: str) -> None:
        return None

    @serialized(key="seg_id", queue=queue, timeout=5)
    async def save_timed(seg_id: str) -> None:
        return None

    @serialized(key="seg_id", queue=queue, coalesce=True)
    async def save_latest(seg_id: str) -> None:
        return None

    named = [(save_partial, "save_partial"), (save_timed, "save_timed")]
    for function, name in [*named, (save_latest, "save_latest")]:
        pending = function("a")
        assert name in repr(pending)
        assert getattr(pending, "__qualname__").endswith(name)  # noqa: B009
        pending.close()
    gate = asyncio.Event()

    async def finalize_later(seg_id: str) -> None:
        await gate.wait()

    task = queue.submit("a", finalize_later, "a")
    assert "finalize_later" in repr(task) and "execute" not in repr(task)
    gate.set()
    await task


async def test_a_never_awaited_call_names_the_decorated_function() -> None:
    @serialized(key="seg_id")
    async def save_partial(seg_id: str) -> None:
        return None

    with pytest.warns(RuntimeWarning, match=r"coroutine '.*save_partial' was never awaited"):
        save_partial("a")  # type: ignore[unused-coroutine]
        gc.collect()


class _Base:
    def __init__(self, name: str) -> None:
        self.name = name

    @serialized(key="seg_id")
    async def save(self, seg_id: str) -> str:
        return f"{self.name}:{seg_id}"


class _Child(_Base):
    async def save(self, seg_id: str) -> str:  # the override reaches the serialized one
        return "child+" + await super().save(seg_id)


class _Slotted:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    @serialized(key="seg_id")
    async def save(self, seg_id: str) -> str:
        return f"{self.name}:{seg_id}"


async def test_bound_methods_behave_as_python_methods() -> None:
    import copy

    service = targets.Service("b")
    bound = service.method
    assert getattr(bound, "__self__") is service  # noqa: B009
    assert bound == service.method
    assert bound.__name__ == "method"
    assert bound.__qualname__ == "Service.method"
    assert repr(bound).startswith("<bound method Service.method of ")
    assert str(inspect.signature(bound)) == "(seg_id: 'str') -> 'str'"
    assert inspect.iscoroutinefunction(bound)
    assert getattr(bound, "__wrapped__").__qualname__ == "Service.method"  # noqa: B009
    assert await copy.copy(bound)("c") == "b:c"
    assert await copy.deepcopy(bound)("d") == "b:d"
    assert await _Child("x").save("s") == "child+x:s"
    assert await _Slotted("y").save("s") == "y:s"
    assert await _Base.save(_Base("z"), "s") == "z:s"  # through the class, as wrapt binds


async def test_bound_methods_are_keyed_and_ordered_like_functions() -> None:
    queue = KeyedSerialQueue()
    log: list[str] = []
    gate = asyncio.Event()

    class Segments:
        @serialized(key="seg_id", queue=queue)
        async def save(self, seg_id: str, text: str) -> None:
            log.append(f"start {seg_id} {text}")
            if text == "partial":
                await gate.wait()
            log.append(f"end {seg_id} {text}")

    segments = Segments()
    first = asyncio.create_task(segments.save("a", "partial"))
    second = asyncio.create_task(segments.save(seg_id="a", text="final"))
    other = asyncio.create_task(Segments.save(segments, "b", "other"))
    await settle()
    assert log == ["start a partial", "start b other", "end b other"]
    assert queue.pending("a") == 2
    gate.set()
    await asyncio.gather(first, second, other)
    assert log[3:] == ["end a partial", "start a final", "end a final"]


class _SlottedAwaitable:
    """An awaitable that is not a coroutine and takes no new attributes."""

    __slots__ = ("_inner",)

    def __init__(self, inner: Awaitable[Any]) -> None:
        self._inner = inner

    def __await__(self) -> Any:
        return self._inner.__await__()


async def test_a_queue_whose_run_returns_another_awaitable_still_runs_the_call() -> None:
    inner = KeyedSerialQueue()

    class TaskQueue:
        def run(self, key: object, fn: Callable[..., Awaitable[Any]], /, *a: Any, **k: Any) -> Any:
            return _SlottedAwaitable(inner.run(key, fn, *a, **k))  # not a coroutine

        def with_options(self, *, timeout: float | None = None) -> WaitOptions:
            return inner.with_options(timeout=timeout)

    @serialized(key="seg", queue=TaskQueue())
    async def handler(seg: str) -> str:
        return seg

    assert await handler("a") == "a"
