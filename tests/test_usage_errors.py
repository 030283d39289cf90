"""The decorator's own shape on methods, the usual mistakes' errors, and one form of wait options.

Each test goes through the public API only.
"""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import warnings
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import pytest

from keyserial import KeyedSerialQueue, QueueObserver, serialized
from keyserial.postgres import PostgresKeyedQueue
from keyserial.redis import RedisKeyedQueue

from .conftest import Pools
from .redis_helpers import Clients
from .scheduling import settle

pytestmark = pytest.mark.asyncio


# -- 1. the lambda form on methods ---------------------------------------------------------


async def test_the_lambda_form_on_a_method_keys_by_the_callers_argument_not_self() -> None:
    queue = KeyedSerialQueue()
    gate = asyncio.Event()
    log: list[str] = []

    class TranscriptService:
        def __init__(self, name: str) -> None:
            self.name = name

        @serialized(key=lambda seg_id, *args, **kwargs: seg_id, queue=queue)
        async def save(self, seg_id: str, text: str) -> None:
            log.append(f"{self.name} {seg_id} {text}")
            if text == "partial":
                await gate.wait()

    first, second = TranscriptService("first"), TranscriptService("second")
    a = asyncio.create_task(first.save("s1", "partial"))
    await settle()
    # Another instance saving the same segment waits; called with keywords, it still binds.
    b = asyncio.create_task(second.save(seg_id="s1", text="final"))
    other = asyncio.create_task(second.save("s2", text="other"))
    await settle()
    assert log == ["first s1 partial", "second s2 other"]
    assert queue.pending("s1") == 2
    gate.set()
    await asyncio.gather(a, b, other)
    assert log[-1] == "second s1 final"
    assert len(queue) == 0


async def test_a_key_function_naming_self_or_cls_first_receives_the_instance_or_class() -> None:
    queue = KeyedSerialQueue()
    gate = asyncio.Event()

    class Tenanted:
        def __init__(self, tenant: str) -> None:
            self.tenant = tenant

        @serialized(key=lambda self, seg_id, *a, **k: (self.tenant, seg_id), queue=queue)
        async def save(self, seg_id: str) -> None:
            await gate.wait()

        @serialized(key=lambda cls, seg_id, *a, **k: (cls.__name__, seg_id), queue=queue)
        @classmethod
        async def by_class(cls, seg_id: str) -> None:
            await gate.wait()

    tasks = [
        asyncio.create_task(Tenanted("t1").save("s1")),
        asyncio.create_task(Tenanted("t2").save(seg_id="s1")),
        asyncio.create_task(Tenanted.by_class("s1")),
    ]
    await settle()
    assert queue.locked(("t1", "s1")) and queue.locked(("t2", "s1"))
    assert queue.locked(("Tenanted", "s1"))
    gate.set()
    await asyncio.gather(*tasks)


async def test_classmethods_and_staticmethods_receive_the_callers_arguments() -> None:
    queue = KeyedSerialQueue()
    seen: list[tuple[str, object]] = []

    def key_of(where: str) -> Callable[..., object]:
        def key(seg_id: str, *args: object, **kwargs: object) -> str:
            seen.append((where, seg_id))
            return seg_id

        return key

    class Service:
        @serialized(key=key_of("class above"), queue=queue)
        @classmethod
        async def class_above(cls, seg_id: str, text: str = "") -> str:
            return f"{cls.__name__}:{seg_id}"

        @classmethod
        @serialized(key=key_of("class below"), queue=queue)
        async def class_below(cls, seg_id: str, text: str = "") -> str:
            return f"{cls.__name__}:{seg_id}"

        @serialized(key=key_of("static above"), queue=queue)
        @staticmethod
        async def static_above(seg_id: str, text: str = "") -> str:
            return f"static:{seg_id}"

        @staticmethod
        @serialized(key=key_of("static below"), queue=queue)
        async def static_below(seg_id: str, text: str = "") -> str:
            return f"static:{seg_id}"

    assert await Service.class_above("a", text="x") == "Service:a"
    assert await Service().class_below(seg_id="b") == "Service:b"
    assert await Service.static_above("c") == "static:c"
    assert await Service().static_below(seg_id="d", text="x") == "static:d"
    assert seen == [("class above", "a"), ("class below", "b"), ("static above", "c"),
                    ("static below", "d")]  # fmt: skip


async def test_multi_key_lambdas_on_methods_get_the_callers_arguments() -> None:
    queue = KeyedSerialQueue()

    class Accounts:
        @serialized(keys=lambda src, dst, *a, **k: [src, dst], queue=queue)
        async def transfer(self, src: str, dst: str, amount: int) -> list[bool]:
            return [queue.locked(src), queue.locked(dst)]

    assert await Accounts().transfer("a", dst="b", amount=1) == [True, True]


async def test_a_key_function_that_cannot_bind_a_call_names_both_signatures() -> None:
    class Service:
        @serialized(key=lambda seg_id: seg_id)
        async def save(self, seg_id: str, *texts: str) -> None:
            raise AssertionError("must not run")

    with pytest.raises(TypeError) as info:
        _ = Service().save("s1", "extra")
    message = str(info.value)
    assert "<lambda>(seg_id)" in message
    assert "Service.save(self, seg_id: 'str', *texts: 'str')" in message
    assert "too many positional arguments" in message


async def test_a_key_function_whose_names_differ_fails_a_keyword_call_naming_both_signatures() -> (
    None
):
    class Service:
        @serialized(key=lambda seg: seg)
        async def save(self, seg_id: str) -> str:
            return seg_id

    assert await Service().save("s1") == "s1"  # by position, the names do not matter
    with pytest.raises(TypeError, match=r"<lambda>\(seg\) cannot take the arguments of .*save"):
        _ = Service().save(seg_id="s1")


# -- 2. clear errors for the usual mistakes ----------------------------------------------


@contextmanager
def no_runtime_warning() -> Generator[None, None, None]:
    """Fail if a coroutine is left never awaited (the warning comes when it is collected)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
        gc.collect()
    assert [str(w.message) for w in caught if w.category is RuntimeWarning] == []


async def save(seg_id: str) -> str:
    return seg_id


def plain_save(seg_id: str) -> str:
    return seg_id


@asynccontextmanager
async def in_process(clients: Clients, pools: Pools) -> AsyncGenerator[list[Any], None]:
    """One queue of each backend."""
    redis_queue = RedisKeyedQueue(clients(), namespace="usage", lease=5.0)
    postgres_queue = PostgresKeyedQueue(await pools(), namespace="usage")
    try:
        yield [KeyedSerialQueue(), redis_queue, postgres_queue]
    finally:
        await redis_queue.aclose()
        await postgres_queue.aclose()


TakesATurn = Callable[[Any, Any], Awaitable[Any]]

WAYS: dict[str, TakesATurn] = {
    "run": lambda q, fn: q.run("k", fn, "k"),
    "submit": lambda q, fn: q.submit("k", fn, "k"),
    "timed run": lambda q, fn: q.with_options(timeout=5).run("k", fn, "k"),
    "timed submit": lambda q, fn: q.with_options(timeout=5).submit("k", fn, "k"),
}


async def test_a_coroutine_object_instead_of_a_function_is_refused_at_once(
    clients: Clients, pools: Pools
) -> None:
    async with in_process(clients, pools) as queues:
        for queue in queues:
            for way, take in WAYS.items():
                with no_runtime_warning(), pytest.raises(TypeError) as info:
                    await take(queue, save("k"))
                message = str(info.value)
                assert "not a coroutine" in message, (queue, way, message)
                assert "(key, save, arg, ...) instead of" in message, (queue, way, message)
            assert len(getattr(queue, "_local", queue)) == 0
            assert await queue.run("k", save, "next") == "next"


async def test_a_function_whose_result_cannot_be_awaited_names_it_and_leaves_the_key_usable(
    clients: Clients, pools: Pools
) -> None:
    async with in_process(clients, pools) as queues:
        for queue in queues:
            for way, take in WAYS.items():
                with pytest.raises(TypeError) as info:
                    await take(queue, plain_save)
                message = str(info.value)
                assert "plain_save returned str 'k', which cannot be awaited" in message, way
                assert "async def" in message and "queue.lock(key)" in message
                assert await queue.run("k", save, "next") == "next"


async def test_a_run_all_of_a_plain_function_names_it() -> None:
    queue = KeyedSerialQueue()
    with pytest.raises(TypeError, match="plain_save returned str 'a'"):
        await queue.run_all(["a", "b"], plain_save, "a")  # type: ignore[arg-type]
    with no_runtime_warning(), pytest.raises(TypeError, match="not a coroutine"):
        await queue.run_all(["a", "b"], save("a"))  # type: ignore[arg-type]
    assert len(queue) == 0


async def test_a_key_function_that_raises_propagates_its_own_exception() -> None:
    queue = KeyedSerialQueue()

    @serialized(key=lambda d: d["missing"], queue=queue)
    async def one(d: dict[str, str]) -> None:
        raise AssertionError("must not run")

    @serialized(keys=lambda d: [d["missing"]], queue=queue)
    async def several(d: dict[str, str]) -> None:
        raise AssertionError("must not run")

    class Broken:
        def __hash__(self) -> int:
            raise ValueError("no hash today")

    @serialized(key=lambda k: k, queue=queue)
    async def by_broken(k: object) -> None:
        raise AssertionError("must not run")

    with pytest.raises(KeyError, match="missing") as info:
        _ = one({})
    assert info.value.__cause__ is None
    with pytest.raises(KeyError, match="missing"):
        _ = several({})
    with pytest.raises(ValueError, match="no hash today"):
        _ = by_broken(Broken())
    with pytest.raises(TypeError, match=r"several: its queue key must be hashable, got list"):
        _ = several({"missing": ["unhashable"]})  # type: ignore[dict-item]
    assert len(queue) == 0


async def test_a_missing_argument_is_a_plain_type_error_naming_the_function() -> None:
    @serialized(key="seg_id")
    async def needs_seg(seg_id: str) -> None:
        raise AssertionError("must not run")

    with pytest.raises(TypeError) as info:
        _ = needs_seg()  # type: ignore[call-arg]
    assert type(info.value) is TypeError  # no private subclass in the traceback
    assert "needs_seg() missing required argument: 'seg_id'" in str(info.value)


async def test_a_try_never_reports_a_deadlock_and_leaves_the_queue_as_it_was() -> None:
    queue = KeyedSerialQueue()
    outcomes: list[str] = []

    async def child() -> None:
        # The parent holds "k" and awaits this task: a wait would close a cycle, a try
        # does not wait.
        attempts: list[Callable[[], Any]] = [
            lambda: queue.lock("k", timeout=0),
            lambda: queue.lock_all(["k", "free"], timeout=0),
            lambda: queue.with_options(timeout=0).lock("k"),
        ]
        for attempt in attempts:
            try:
                async with attempt():
                    outcomes.append("entered")
            except TimeoutError:
                outcomes.append("busy")
        try:
            await queue.with_options(timeout=0).run("k", save, "k")
        except TimeoutError:
            outcomes.append("busy")

    async def parent() -> None:
        await asyncio.create_task(child())

    await asyncio.wait_for(queue.run("k", parent), timeout=5)
    assert outcomes == ["busy"] * 4
    assert len(queue) == 0
    async with queue.lock("k", timeout=0):  # free: a try takes it
        assert queue.locked("k")


@pytest.mark.parametrize(
    ("statement", "missing", "extra"),
    [
        ("import keyserial.redis", "redis", "redis"),
        # keyserial.streams itself needs neither driver: a stream on PostgreSQL needs no redis.
        ("import keyserial.streams; keyserial.streams.RedisStreamSource", "redis", "redis"),
        ("from keyserial.streams import acl_rules", "redis", "redis"),
        ("import keyserial.postgres", "psycopg", "postgres"),
        ("import keyserial.postgres", "psycopg_pool", "postgres"),
        ("import keyserial.otel", "opentelemetry", "otel"),
    ],
)
async def test_a_backend_without_its_driver_names_the_extra_to_install(
    statement: str, missing: str, extra: str
) -> None:
    program = (
        "import sys\n"
        f"sys.modules[{missing!r}] = None  # as if it were not installed\n"
        "try:\n"
        f"    {statement}\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", program, stdout=subprocess.PIPE
    )
    output = (await asyncio.wait_for(process.communicate(), timeout=60))[0].decode()
    assert process.returncode == 0
    assert f"pip install 'keyserial[{extra}]'" in output
    assert f"needs the {missing!r} package" in output


# -- 3. one form of wait options -----------------------------------------------------------


async def test_every_way_of_taking_a_turn_takes_the_same_timeout_and_leaves_the_queue_as_it_was(
    clients: Clients, pools: Pools
) -> None:
    async with in_process(clients, pools) as queues:
        for queue in queues:
            await _check_timeouts(queue)


async def _check_timeouts(queue: Any) -> None:
    started: list[str] = []

    async def work(name: str, *, note: str = "") -> str:
        started.append(name + note)
        return name

    timed = queue.with_options(timeout=0.05)
    release, held = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        async with queue.lock("k"):
            held.set()
            await release.wait()

    holder = asyncio.create_task(hold())
    await held.wait()
    waits: list[Callable[[], Awaitable[Any]]] = [
        lambda: timed.run("k", work, "run", note="!"),
        lambda: timed.submit("k", work, "submit"),
        lambda: _enter(timed.lock("k")),
    ]
    if hasattr(timed, "run_all"):
        waits += [
            lambda: timed.run_all(["k", "j"], work, "run_all"),
            lambda: _enter(timed.lock_all(["k", "j"])),
        ]
    for wait in waits:
        with pytest.raises(TimeoutError):
            await wait()
    release.set()
    await holder
    assert started == []
    # Keyword arguments still reach the function, and the key is free again.
    assert await timed.run("k", work, "after", note="!") == "after"
    assert started == ["after!"]
    assert len(getattr(queue, "_local", queue)) == 0
    with pytest.raises(ValueError, match="timeout must be None or a number"):
        queue.with_options(timeout=-1)


async def _enter(lock: Any) -> None:
    async with lock:
        raise AssertionError("must not enter")


async def test_the_decorator_takes_the_same_timeout() -> None:
    queue = KeyedSerialQueue()

    @serialized(key="k", queue=queue, timeout=0)
    async def try_once(k: str) -> str:
        return k

    async with queue.lock("k"):
        with pytest.raises(TimeoutError):
            await asyncio.create_task(try_once("k"))
    assert await try_once("k") == "k"


async def test_the_queues_public_methods_are_defined_on_its_own_class() -> None:
    # Type checkers name the class a method is defined on ('"run_all" of "KeyedSerialQueue"'):
    # a private base class would show up in users' error messages. CI also checks mypy's
    # and pyright's messages from outside the checkout.
    public = [name for name in dir(KeyedSerialQueue) if not name.startswith("_")]
    assert public and [name for name in public if name not in vars(KeyedSerialQueue)] == []
    assert [base.__name__ for base in KeyedSerialQueue.__mro__] == ["KeyedSerialQueue", "object"]


@pytest.mark.parametrize("observed", [False, True], ids=["plain", "observed"])
async def test_a_plain_function_gets_the_same_clear_error_with_and_without_an_observer(
    observed: bool,
) -> None:
    # An observed queue runs each call through the same entry points as a plain one; its
    # watch must not await the function's result before the plain path has checked it.
    queue = KeyedSerialQueue(observer=QueueObserver()) if observed else KeyedSerialQueue()
    ways: dict[str, Callable[[], Awaitable[object]]] = {
        "run": lambda: queue.run("k", plain_save, "k"),  # type: ignore[arg-type]
        "submit": lambda: queue.submit("k", plain_save, "k"),  # type: ignore[arg-type]
        "run_all": lambda: queue.run_all(["k", "j"], plain_save, "k"),  # type: ignore[arg-type]
        "timed run": lambda: queue.with_options(timeout=5).run("k", plain_save, "k"),  # type: ignore[arg-type]
    }
    for way, take in ways.items():
        with pytest.raises(TypeError) as info:
            await take()
        message = str(info.value)
        assert "plain_save returned str 'k', which cannot be awaited" in message, (way, message)
        assert "async def" in message, (way, message)
    assert len(queue) == 0
    assert await queue.run("k", save, "next") == "next"


async def test_a_key_function_that_cannot_take_a_keyword_call_says_the_keyword_was_the_cause() -> (
    None
):
    @serialized(key=lambda s, *args, **kwargs: s)
    async def save(seg_id: str, text: str) -> None: ...

    with pytest.raises(TypeError) as info:
        save(seg_id="seg-1", text="hello")  # type: ignore[unused-coroutine]
    message = str(info.value)
    assert "This call passed 'seg_id', 'text' by keyword" in message
    assert 'key by parameter name (key="<parameter>")' in message
    save("seg-1", "hello").close()  # by position the same function is fine


async def test_a_wait_option_given_to_run_points_to_with_options() -> None:
    queue = KeyedSerialQueue()

    async def save(seg_id: str) -> None: ...

    ways: dict[str, Callable[[], Awaitable[object]]] = {
        "run": lambda: queue.run("k", save, "k", timeout=1),  # type: ignore[call-arg]
        "submit": lambda: queue.submit("k", save, "k", timeout=1),  # type: ignore[call-arg]
        "run_all": lambda: queue.run_all(["k"], save, "k", timeout=1),  # type: ignore[call-arg]
        "group": lambda: queue.run("k", save, "k", group="g"),  # type: ignore[call-arg]
    }
    for way, take in ways.items():
        with pytest.raises(TypeError) as info:
            await take()
        message = str(info.value)
        assert "unexpected keyword argument" in message, way
        assert "use queue.with_options(" in message, (way, message)
        assert isinstance(info.value.__cause__, TypeError), way  # fn's own error, kept
    assert len(queue) == 0

    async def takes_timeout(seg_id: str, timeout: float) -> float:
        return timeout

    assert await queue.run("k", takes_timeout, "k", timeout=2) == 2  # fn's own keyword
