"""The package's shape: no import cycles, small modules, no class doing too many jobs.

Imports are read from the source with ``ast`` (including imports inside functions, but not
those under ``if TYPE_CHECKING:``, which never run), resolved to keyserial's own modules,
and searched for a cycle.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "keyserial"

#: A module of more lines of code than this (docstrings, comments and blank lines
#: excluded) needs splitting.
MAX_MODULE_CODE_LINES = 500
#: A class of more lines of code than this, counting the private classes it derives from
#: (a mixin chain is one class spread over several), does too many jobs.
MAX_CLASS_CODE_LINES = 300


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


def imports_of(name: str, path: Path, known: set[str], type_checking: bool = False) -> set[str]:
    """The keyserial modules that ``name`` imports when it runs (``type_checking``: and
    those it imports only for the type checkers)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_checking:
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
    # Imports made only for the type checkers count too: a circle of them is still two
    # modules that cannot be understood one without the other.
    found = modules()
    graph = {name: imports_of(name, path, set(found), True) for name, path in found.items()}
    assert graph["keyserial._queue"] >= {"keyserial._multikey", "keyserial._loops"}  # sanity
    assert graph["keyserial._locks"] >= {"keyserial._share"}  # sanity: a TYPE_CHECKING import
    assert find_cycle(graph) is None


def test_leaf_modules_import_nothing_of_keyserial() -> None:
    found = modules()
    for leaf in ("_records", "_errors", "_keylock", "_turns", "_asyncio_internals", "_clock"):
        name = f"keyserial.{leaf}"
        assert imports_of(name, found[name], set(found)) == set(), name


def test_the_deadlock_check_imports_only_leaves() -> None:
    found = modules()
    name = "keyserial._deadlock"
    assert imports_of(name, found[name], set(found)) <= {
        "keyserial._records",
        "keyserial._turns",
        "keyserial._asyncio_internals",
        "keyserial._errors",
    }


#: The longest chain of imports allowed in the in-process core, counted in modules from the
#: decorator (the entry of the core) down to a leaf.
MAX_CORE_DEPTH = 6


def longest_chain(graph: dict[str, set[str]], start: str, within: set[str]) -> list[str]:
    """The longest import chain from ``start`` through modules of ``within`` (no cycles)."""
    best = [start]
    for target in sorted(graph[start] & within):
        chain = [start, *longest_chain(graph, target, within)]
        if len(chain) > len(best):
            best = chain
    return best


def test_the_checker_measures_a_chain() -> None:
    graph: dict[str, set[str]] = {"a": {"b", "c"}, "b": {"c"}, "c": set()}
    assert longest_chain(graph, "a", {"a", "b", "c"}) == ["a", "b", "c"]
    assert longest_chain(graph, "a", {"a", "c"}) == ["a", "c"]


def test_the_in_process_core_is_at_most_six_modules_deep() -> None:
    found = modules()
    graph = {name: imports_of(name, path, set(found)) for name, path in found.items()}
    core = {name for name in graph if name.startswith("keyserial._") and name.count(".") == 1}
    chains = [longest_chain(graph, name, core) for name in sorted(core)]
    deepest = max(chains, key=len)
    assert len(deepest) <= MAX_CORE_DEPTH, " -> ".join(deepest)
    assert deepest[0] == "keyserial._decorator"  # sanity: the entry of the core is deepest


def _docstring_lines(tree: ast.AST) -> set[int]:
    docstrings: set[int] = set()
    for child in ast.walk(tree):
        if isinstance(child, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = child.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                first = body[0]
                docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return docstrings


def _code_lines(first: int, last: int, source: list[str], docstrings: set[int]) -> int:
    """Lines from ``first`` to ``last`` that are neither docstrings, comments nor blank."""
    return sum(
        1
        for number in range(first, last + 1)
        if number not in docstrings
        and source[number - 1].strip()
        and not source[number - 1].strip().startswith("#")
    )


def _classes() -> dict[str, tuple[ast.ClassDef, int]]:
    """Every class of the package by name, with its own lines of code."""
    found: dict[str, tuple[ast.ClassDef, int]] = {}
    for path in modules().values():
        tree = ast.parse(path.read_text())
        source, docstrings = path.read_text().splitlines(), _docstring_lines(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                end = node.end_lineno or node.lineno
                found[node.name] = (node, _code_lines(node.lineno, end, source, docstrings))
    return found


def _with_private_bases(name: str, classes: dict[str, tuple[ast.ClassDef, int]]) -> int:
    node, lines = classes[name]
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id.startswith("_") and base.id in classes:
            lines += _with_private_bases(base.id, classes)
    return lines


def test_modules_and_classes_stay_small() -> None:
    too_big = []
    for name, path in modules().items():
        tree = ast.parse(path.read_text())
        source = path.read_text().splitlines()
        lines = _code_lines(1, len(source), source, _docstring_lines(tree))
        if lines > MAX_MODULE_CODE_LINES:
            too_big.append(f"{name}: {lines} lines of code")
    classes = _classes()
    for name in classes:
        lines = _with_private_bases(name, classes)
        if lines > MAX_CLASS_CODE_LINES:
            too_big.append(f"class {name}: {lines} lines of code with its private bases")
    assert too_big == []


def test_the_size_check_counts_a_mixin_chain_as_one_class() -> None:
    tree = ast.parse("class _A:\n    x = 1\n    y = 2\n\n\nclass B(_A):\n    z = 3\n")
    classes = {
        node.name: (node, (node.end_lineno or node.lineno) - node.lineno + 1)
        for node in tree.body
        if isinstance(node, ast.ClassDef)
    }
    assert _with_private_bases("B", classes) == 5


#: What a measurement looks like in prose: a percentage, a duration below a millisecond, a
#: speed-up factor, an instruction count, a before -> after pair of figures.
MEASUREMENT = re.compile(
    r"\d+(\.\d+)? ?%|\d ?(ns|µs|us)\b|\d\.\d+ ?x\b|\d+x (faster|slower)|callgrind"
    r"|\d+ instructions|\d\.\d+ ?-> ?\d"
)


def _prose(path: Path) -> list[tuple[int, str]]:
    """The comments and docstrings of a module, with their line numbers."""
    source = path.read_text()
    found = [
        (token.start[0], token.string)
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node, clean=False)
            if docstring is not None:
                found.append((getattr(node, "lineno", 1), docstring))
    return found


def test_no_measurement_figures_in_comments_or_docstrings() -> None:
    # Figures go stale on the next machine or Python; they live in benchmarks/ and
    # docs/performance.md, where the run that produced them is given.
    stale = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {match.group()!r}"
        for path in modules().values()
        for line, text in _prose(path)
        for match in [MEASUREMENT.search(text)]
        if match is not None
    ]
    assert stale == [], stale


def _asyncio_private_names() -> set[str]:
    import asyncio

    owners: list[object] = [asyncio.Task, asyncio.Future, asyncio.BaseEventLoop, asyncio.tasks]
    task_group: object = getattr(asyncio, "TaskGroup", None)  # 3.11 and later
    owners += [task_group] if task_group is not None else []
    loop = asyncio.new_event_loop()  # instance fields too: _thread_id, _ready, _closed, ...
    try:
        owners.append(loop)
        names = {name for owner in owners for name in dir(owner) if name.startswith("_")}
    finally:
        loop.close()
    return {name for name in names if not name.startswith("__")}


def private_asyncio_reads(source: str, private: set[str]) -> set[str]:
    """asyncio's private names that ``source`` reads off objects other than ``self``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        own = isinstance(node, ast.Attribute) and (
            isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
        )
        if isinstance(node, ast.Attribute) and node.attr in private and not own:
            found.add(node.attr)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in private
        ):
            found.add(str(node.args[1].value))
    return found


def test_the_checker_finds_private_asyncio_reads() -> None:
    source = "x = loop._ready\ny = getattr(task, '_coro', None)\nz = self._ready\n"
    assert private_asyncio_reads(source, {"_ready", "_coro"}) == {"_ready", "_coro"}


def test_asyncio_internals_are_read_only_by_the_names_its_module_exports() -> None:
    private = _asyncio_private_names()
    assert {"_fut_waiter", "_thread_id", "_ready"} <= private  # sanity: instance fields too
    outside = {
        f"{name}: {field}"
        for name, path in modules().items()
        if name != "keyserial._asyncio_internals"
        for field in private_asyncio_reads(path.read_text(), private)
    }
    assert outside == set(), "read these through keyserial/_asyncio_internals.py"


#: What reading a frame or a coroutine's chain looks like in source.
_FRAME_READS = re.compile(
    r"_getframe|f_locals|f_back|f_code|cr_frame|cr_await|gi_frame|gi_yieldfrom"
)


def test_frames_are_read_only_in_the_asyncio_internals_module() -> None:
    # keyserial keeps its turns and waits in records (keyserial._turns); only asyncio's own
    # helpers are read off their frames and coroutines, in one module.
    found = [
        f"{name}:{number}: {line.strip()}"
        for name, path in modules().items()
        if name != "keyserial._asyncio_internals"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if _FRAME_READS.search(line)
    ]
    assert found == []


def test_the_frame_check_sees_a_frame_read() -> None:
    assert _FRAME_READS.search("frame = sys._getframe(1)")
    assert _FRAME_READS.search("names = frame.f_locals")
