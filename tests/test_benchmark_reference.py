"""The benchmarks' reference copy of run() must stay the real run() minus the failure count."""

from __future__ import annotations

import ast
import asyncio
import inspect
import sys
import textwrap
from types import FrameType
from typing import Any

from benchmarks.reference import UncountedQueue, uncounted_run_source
from keyserial import KeyedSerialQueue


def test_reference_run_is_run_without_the_counting_lines() -> None:
    source = textwrap.dedent(inspect.getsource(KeyedSerialQueue.run))
    real = ast.unparse(ast.parse(source)).splitlines()
    reference = uncounted_run_source().splitlines()
    start = (
        next(i for i, line in enumerate(real) if line.strip() == "share.counts.failure(exc)") - 1
    )
    expected = [
        "except BaseException as exc:",
        "share.counts.failure(exc)",
        "if type(exc) is TypeError and result is not UNCALLED and (not isawaitable(result)):",
        "raise not_awaitable(fn, result) from None",
        "if type(exc) is TypeError and result is UNCALLED and kwargs:",
        "error = call_error(fn, exc, kwargs)",
        "if error is not exc:",
        "raise error from exc",
        "raise",
    ]
    clause = [line.strip() for line in real[start : start + len(expected)]]
    assert clause == expected
    assert real[:start] + real[start + len(expected) :] == reference


def _instructions_run(queue: KeyedSerialQueue) -> int:
    """How many bytecode instructions ``queue.run`` executes for one uncontended call."""
    code = type(queue).run.__code__
    executed = 0

    def count(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal executed
        if event == "opcode":
            executed += 1
        return count

    def calls(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code is not code:
            return None
        frame.f_trace_opcodes = True
        return count

    async def nothing() -> None:
        pass

    async def main() -> None:
        nonlocal executed
        sys.settrace(calls)
        try:
            executed = 0
            await queue.run("k", nothing)
        finally:
            sys.settrace(None)

    # The first traced run may count nothing: 3.12 instruments code for opcode events
    # lazily, once per code object. The second is counted.
    asyncio.run(main())
    asyncio.run(main())
    return executed


def test_counting_failures_adds_no_instruction_to_the_uncontended_path() -> None:
    # The ``except`` clause that counts failures is zero-cost from Python 3.11 on; on 3.10
    # it sets up one more block (SETUP_FINALLY, POP_BLOCK). So a timing difference between
    # the two in the benchmark is noise, not cost.
    real, reference = _instructions_run(KeyedSerialQueue()), _instructions_run(UncountedQueue())
    assert reference > 20
    extra = 0 if sys.version_info >= (3, 11) else 2
    assert real == reference + extra
