"""Every ```python block of README.md and docs/ runs as it stands, in the order of its page.

A page's blocks run one after another in one namespace, on one event loop, as a reader
pasting them into ``python -m asyncio`` would run them: a block may use what an earlier
block of the same page defined, and may ``await`` at the top level. Each block is a test
item named by its page and line (``docs/quickstart.md:17``).

A block that is deliberately not runnable (an excerpt of a larger program) says so on the
page: its first line is a comment starting with ``# Excerpt``. It is collected, and checked
to compile, but not run.

Blocks that need a server read its address from ``REDIS_URL`` or ``DATABASE_URL``, with a
default for a reader's own machine; here they get the suite's private Redis server and a
database of their own on the test PostgreSQL server.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import io
import os
import re
from collections.abc import Generator
from dataclasses import dataclass, field
from inspect import CO_COROUTINE
from pathlib import Path
from typing import Any

import pytest

from .postgres_server import private_database
from .redis_server import RedisServer, redis_server_binary

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXCERPT = "# Excerpt"

_FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the checkout
    line: int  # of the opening fence
    source: str

    @property
    def excerpt(self) -> bool:
        return self.source.lstrip().startswith(EXCERPT)


def blocks_of(path: Path, root: Path = ROOT) -> list[Block]:
    """The ```python blocks of a Markdown page (not indented ones: those belong to lists)."""
    found: list[Block] = []
    lines = path.read_text().splitlines()
    number = 0
    while number < len(lines):
        opening = _FENCE.match(lines[number])
        if opening is None:
            number += 1
            continue
        end = number + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if opening.group(1) == "python":
            source = "\n".join(lines[number + 1 : end]) + "\n"
            found.append(Block(path.relative_to(root).as_posix(), number + 1, source))
        number = end + 1
    return found


ALL_BLOCKS = [block for page in PAGES for block in blocks_of(page)]


@dataclass
class PageRun:
    """One page's namespace and loop, and how far into its blocks it has run."""

    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    namespace: dict[str, Any] = field(default_factory=lambda: {"__name__": "__main__"})
    done: int = 0
    failed: str | None = None
    servers: dict[str, str] = field(default_factory=dict[str, str])  # what its blocks read
    cleanup: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)


_runs: dict[str, PageRun] = {}


def _servers_for(block: Block, run: PageRun) -> dict[str, str]:
    """The variables the page's blocks read a server's address from, made for this run."""
    text = (ROOT / block.page).read_text()
    variables: dict[str, str] = {}
    if "REDIS_URL" in text:
        server = RedisServer(redis_server_binary())
        server.start()
        run.cleanup.callback(server.close)
        variables["REDIS_URL"] = server.url
    if "DATABASE_URL" in text:
        variables["DATABASE_URL"] = run.cleanup.enter_context(private_database())
    return variables


def _execute(block: Block, run: PageRun) -> str:
    """Run one block in its page's namespace; what it printed."""
    code = compile(
        block.source, f"{block.page}:{block.line}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    )
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        if code.co_flags & CO_COROUTINE:
            run.loop.run_until_complete(eval(code, run.namespace))
        else:
            exec(code, run.namespace)
    return printed.getvalue()


@contextlib.contextmanager
def _environment(variables: dict[str, str]) -> Generator[None, None, None]:
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _finish(page: str) -> None:
    run = _runs.pop(page)
    with contextlib.suppress(Exception):
        pending = asyncio.all_tasks(run.loop)
        for task in pending:
            task.cancel()
        if pending:  # gather() of nothing, with no loop set, would make a loop of its own
            run.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        run.loop.run_until_complete(run.loop.shutdown_asyncgens())
    run.loop.close()
    run.cleanup.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "block",
    [
        pytest.param(
            block, id=f"{block.page}:{block.line}", marks=pytest.mark.xdist_group(block.page)
        )
        for block in ALL_BLOCKS
    ],
)
def test_the_block_runs_as_it_stands(block: Block) -> None:
    page_blocks = [b for b in ALL_BLOCKS if b.page == block.page]
    index = page_blocks.index(block)
    if block.excerpt:
        compile(block.source, block.page, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        return
    run = _runs.get(block.page)
    if run is not None and index < run.done:  # run again (a rerun of one item): start over
        _finish(block.page)
        run = None
    if run is None:
        run = _runs[block.page] = PageRun()
    if run.done == 0:
        run.servers = _servers_for(block, run)
    with _environment(run.servers):
        # The blocks before this one, in order, as a reader would have pasted them.
        while run.done < index:
            earlier = page_blocks[run.done]
            run.done += 1
            if earlier.excerpt or run.failed:
                continue
            try:
                _execute(earlier, run)
            except BaseException as exc:
                run.failed = f"{earlier.page}:{earlier.line} failed: {exc!r}"
        if run.failed:
            pytest.fail(f"an earlier block of the page failed first ({run.failed})")
        run.done += 1
        try:
            print(_execute(block, run), end="")  # shown with -s, or when the block fails
        finally:
            if run.done == len(page_blocks):
                _finish(block.page)


def test_most_blocks_run_and_excerpts_are_few() -> None:
    excerpts = [f"{b.page}:{b.line}" for b in ALL_BLOCKS if b.excerpt]
    assert len(ALL_BLOCKS) >= 20  # sanity: the collector finds the pages' blocks
    assert len(excerpts) <= 0.1 * len(ALL_BLOCKS), excerpts


def test_the_collector_finds_blocks_and_excerpts(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "text\n```python\nx = 1\n```\n\n```text\nnot code\n```\n"
        "```python\n# Excerpt of a larger program\nawait y\n```\n"
    )
    found = blocks_of(page, tmp_path)
    assert [(b.line, b.excerpt) for b in found] == [(2, False), (9, True)]
    assert found[0].source == "x = 1\n"
