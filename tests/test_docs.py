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
