"""The interactive examples in the documentation pages run, and print what the pages say."""

from __future__ import annotations

import doctest
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES = sorted(page.name for page in DOCS.glob("*.md") if ">>> " in page.read_text())


@pytest.mark.parametrize("page", PAGES)
def test_examples_in_the_page_run(page: str) -> None:
    failures, tried = doctest.testfile(
        str(DOCS / page), module_relative=False, optionflags=doctest.ELLIPSIS, verbose=False
    )
    assert tried > 0 and failures == 0


def test_some_page_has_examples() -> None:
    assert "operations.md" in PAGES


PUBLIC_MODULES = (
    "keyserial",
    "keyserial.otel",
    "keyserial.redis",
    "keyserial.postgres",
    "keyserial.streams",
)


def test_every_public_name_is_on_one_api_reference_page() -> None:
    import importlib

    shown: dict[str, list[str]] = {}
    for page in sorted((DOCS / "api").glob("*.md")):
        for line in page.read_text().splitlines():
            if line.startswith("::: "):
                shown.setdefault(line.removeprefix("::: ").strip(), []).append(page.name)
    expected = {
        f"{module}.{name}"
        for module in PUBLIC_MODULES
        for name in importlib.import_module(module).__all__
    }
    assert sorted(expected - shown.keys()) == [], "public names missing from docs/api/"
    assert sorted(name for name, pages in shown.items() if len(pages) > 1) == []
    assert sorted(shown.keys() - expected) == [], "docs/api/ shows names that are not public"


def test_the_home_page_links_every_page() -> None:
    import re

    def linked(page: Path) -> set[str]:
        return set(re.findall(r"\]\(([\w/.-]+\.md)(?:#[\w-]+)?\)", page.read_text()))

    pages = {page.relative_to(DOCS).as_posix() for page in DOCS.rglob("*.md")}
    from_home = linked(DOCS / "index.md")
    from_api = {f"api/{name}" for name in linked(DOCS / "api" / "index.md")}
    assert sorted(pages - {"index.md"} - from_home - from_api) == []
    assert "api/index.md" in from_home


def test_the_readmes_docs_command_runs_in_the_venv_its_setup_command_makes() -> None:
    # Without an activated virtual environment, a bare "mkdocs" is not on the PATH.
    readme = (DOCS.parent / "README.md").read_text()
    setup = 'python3 -m venv .venv && .venv/bin/pip install -e ".[test]"'
    docs = '.venv/bin/pip install -e ".[docs]" && .venv/bin/mkdocs serve'
    assert setup in readme and docs in readme
    assert readme.index(setup) < readme.index(docs)
    pyproject = (DOCS.parent / "pyproject.toml").read_text()
    assert "\ndocs = [" in pyproject and '"mkdocs' in pyproject


def test_the_postgres_pages_setup_sql_is_what_setup_sql_returns() -> None:
    from keyserial.postgres import setup_sql

    page = (Path(__file__).resolve().parent.parent / "docs" / "postgres.md").read_text()
    shown = page.split("```sql\n", 1)[1].split("```", 1)[0]
    assert shown.strip() == setup_sql(grant_to="app")
