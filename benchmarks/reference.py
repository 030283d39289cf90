"""``KeyedSerialQueue.run`` minus the ``except`` clause that counts failures, from its source.

The benchmark runs it beside the real ``run`` to price, in the same process, what stats()
counting costs the uncontended path of a queue that does not count calls. It is derived
mechanically: the real method's source, parsed, with that one clause removed, and compiled
in the queue module's namespace, so it can never drift from the real method.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

from keyserial import (
    KeyedSerialQueue,
    _queue,  # pyright: ignore[reportPrivateUsage]  # run()'s own module
)

COUNTING_CLAUSE = "share.counts.failure(exc)"


class _WithoutCounting(ast.NodeTransformer):
    def visit_Try(self, node: ast.Try) -> ast.AST:
        self.generic_visit(node)
        node.handlers = [h for h in node.handlers if COUNTING_CLAUSE not in ast.unparse(h)]
        return node


def uncounted_run_source() -> str:
    """The source of ``run`` with the failure-counting ``except`` clause removed."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(KeyedSerialQueue.run)))
    function = tree.body[0]
    assert isinstance(function, ast.AsyncFunctionDef)
    before = ast.unparse(function)
    function = _WithoutCounting().visit(function)
    if ast.unparse(function) == before:
        raise RuntimeError(f"KeyedSerialQueue.run no longer contains {COUNTING_CLAUSE!r}")
    return ast.unparse(ast.fix_missing_locations(tree))


def _compile_run() -> Any:
    namespace: dict[str, Any] = dict(vars(_queue))
    exec(compile(uncounted_run_source(), _queue.__file__, "exec"), namespace)
    return namespace["run"]


class UncountedQueue(KeyedSerialQueue):
    """A queue whose ``run`` does not count failures: the reference of the observability row."""

    __slots__ = ()

    run = _compile_run()
