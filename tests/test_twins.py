"""Deliberate copies stay copies: ``run()`` and ``call()`` share one body, written twice.

Each path must avoid a second coroutine (an extra frame costs about 50 ns per call and,
while waiting, about 200 bytes), so the body is written out in both. The behaviour suites
(contract, cancellation, errors) run against both through the ``run_in_turn`` fixture;
this checks that the two texts differ only where their signatures do.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

from keyserial import KeyedSerialQueue


def _body(method: object) -> list[ast.stmt]:
    """The method's statements, without its docstring."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(method)))  # type: ignore[arg-type]
    function = tree.body[0]
    assert isinstance(function, ast.AsyncFunctionDef)
    body = function.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return body


def _names_group(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "group"


def _is_none(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


class _AsRun(ast.NodeTransformer):
    """``call``'s body as ``run``'s: ``run`` has no ``timeout`` (it passes ``None`` where
    ``call`` passes it, and has no test ``timeout is not None``) and no ``group``."""

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.Constant(None) if node.id == "timeout" else node

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        node.args = [a for a in node.args if not _names_group(a)]
        return node

    def visit_BoolOp(self, node: ast.BoolOp) -> ast.AST:
        self.generic_visit(node)
        node.values = [
            v
            for v in node.values
            if not (isinstance(v, ast.Compare) and (_names_group(v.left) or _is_none(v.left)))
        ]
        return node


def test_run_and_call_bodies_are_the_same_but_for_timeout_and_group() -> None:
    run, call = _body(KeyedSerialQueue.run), _body(KeyedSerialQueue.call)
    # call checks the timeout it was given first; run has none.
    assert ast.unparse(call[0]) == "if timeout is not None:\n    check_timeout(timeout)"
    run_all = [ast.dump(statement) for statement in run]
    call_rest = [ast.dump(_AsRun().visit(statement)) for statement in call[1:]]
    assert run_all == call_rest


def test_the_check_sees_a_difference() -> None:
    changed = _body(KeyedSerialQueue.call)[1:]
    changed[-1] = ast.Pass()
    run_all = [ast.dump(statement) for statement in _body(KeyedSerialQueue.run)]
    assert run_all != [ast.dump(_AsRun().visit(statement)) for statement in changed]
