"""The benchmarks' reference copy of run() must stay the real run() minus the failure count."""

from __future__ import annotations

import ast
import inspect
import textwrap

from benchmarks.reference import UncountedQueue
from keyserial import KeyedSerialQueue


def _statements(method: object) -> list[str]:
    """The method's code, normalised (no docstring, no comments, one formatting)."""
    function = ast.parse(textwrap.dedent(inspect.getsource(method))).body[0]  # type: ignore[arg-type]
    assert isinstance(function, ast.AsyncFunctionDef)
    if ast.get_docstring(function) is not None:
        function.body = function.body[1:]
    return ast.unparse(function).splitlines()


def test_reference_run_is_run_without_the_counting_lines() -> None:
    real, reference = _statements(KeyedSerialQueue.run), _statements(UncountedQueue.run)
    counting = [
        "    except BaseException as exc:",
        "        part.count_failure(exc)",
        "        raise",
    ]
    start = real.index(counting[0])
    assert real[start : start + 3] == counting
    assert real[:start] + real[start + 3 :] == reference
