"""The package's shape: no import cycles, small modules, no class doing too many jobs.

Imports are read from the source with ``ast`` (including imports inside functions, but not
those under ``if TYPE_CHECKING:``, which never run), resolved to keyserial's own modules,
and searched for a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "keyserial"

#: A module of more lines than this needs splitting (or a reason at its top).
MAX_MODULE_LINES = 400
#: A class of more lines of code than this (docstrings excluded) does too many jobs.
MAX_CLASS_CODE_LINES = 250


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The keyserial modules that ``name`` imports when it runs."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for branch in node.orelse:
                visit(branch)
            return
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [target] + [f"{target}.{alias.name}" for alias in node.names]
            found.update(c for c in candidates if c in known)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    found.discard(name)
    # Importing a submodule runs its package's __init__ first; that is not an edge of ours.
    return {target for target in found if not name.startswith(target + ".")}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    visiting: list[str] = []
    done: set[str] = set()

    def visit(node: str) -> list[str] | None:
        if node in visiting:
            return [*visiting[visiting.index(node) :], node]
        if node in done:
            return None
        visiting.append(node)
        for target in sorted(graph[node]):
            cycle = visit(target)
            if cycle is not None:
                return cycle
        visiting.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        cycle = visit(node)
        if cycle is not None:
            return cycle
    return None


def test_the_checker_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_inside_keyserial() -> None:
    found = modules()
    graph = {name: imports_of(name, path, set(found)) for name, path in found.items()}
    assert graph["keyserial._queue"] >= {"keyserial._multikey", "keyserial._loops"}  # sanity
    assert find_cycle(graph) is None


def test_leaf_modules_import_nothing_of_keyserial() -> None:
    found = modules()
    for leaf in ("_records", "_errors", "_protocols", "_observer", "_awaits", "_clock"):
        name = f"keyserial.{leaf}"
        assert imports_of(name, found[name], set(found)) == set(), name


def test_the_deadlock_walk_imports_only_records_and_helpers() -> None:
    found = modules()
    name = "keyserial._deadlock"
    assert imports_of(name, found[name], set(found)) <= {
        "keyserial._records",
        "keyserial._awaits",
        "keyserial._errors",
        "keyserial._reach",
        "keyserial._waiting",
    }
    reach = "keyserial._reach"
    assert imports_of(reach, found[reach], set(found)) <= {"keyserial._awaits"}
    waiting = "keyserial._waiting"
    assert imports_of(waiting, found[waiting], set(found)) <= {
        "keyserial._awaits",
        "keyserial._records",
    }


def _code_lines(node: ast.ClassDef, source: list[str]) -> int:
    """Lines of the class that are neither docstrings, comments nor blank."""
    docstrings: set[int] = set()
    for child in ast.walk(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = child.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                first = body[0]
                docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    end = node.end_lineno or node.lineno
    return sum(
        1
        for number in range(node.lineno, end + 1)
        if number not in docstrings
        and source[number - 1].strip()
        and not source[number - 1].strip().startswith("#")
    )


def test_modules_and_classes_stay_small() -> None:
    too_big = []
    for name, path in modules().items():
        source = path.read_text().splitlines()
        if len(source) > MAX_MODULE_LINES:
            too_big.append(f"{name}: {len(source)} lines")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                lines = _code_lines(node, source)
                first = source[node.body[0].lineno - 1].strip() if node.body else ""
                explained = first.startswith("# Long:")
                if lines > MAX_CLASS_CODE_LINES and not explained:
                    too_big.append(f"{name}.{node.name}: {lines} lines of code")
    assert too_big == []
