"""A deliberate copy stays a copy: ``run()`` and the decorator's ``_run_packed()`` share one body.

The decorator holds a call's arguments as a tuple and a dict; passing them on to ``run`` by
unpacking and packing them again cost the decorated rows of the benchmark more than a copy
of ``run``'s body costs a reader (docs/performance.md gives the figure). The behaviour suites
(contract, cancellation, errors) run over both through the ``run_in_turn`` fixture; this
checks that the two texts are the same statement for statement.
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


def _packed() -> object:
    return KeyedSerialQueue._run_packed  # pyright: ignore[reportPrivateUsage]


def test_run_and_the_decorators_copy_have_the_same_body() -> None:
    run = [ast.dump(statement) for statement in _body(KeyedSerialQueue.run)]
    packed = [ast.dump(statement) for statement in _body(_packed())]
    assert run == packed


def test_the_check_sees_a_difference() -> None:
    changed = _body(_packed())
    changed[-1] = ast.Pass()
    run = [ast.dump(statement) for statement in _body(KeyedSerialQueue.run)]
    assert run != [ast.dump(statement) for statement in changed]
