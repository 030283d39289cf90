"""The quick start in README.md and docs/quickstart.md is examples/quickstart.py, and runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "examples" / "quickstart.py"
TYPED_KEYS = ROOT / "examples" / "typed_keys.py"


def python_blocks(page: Path) -> list[str]:
    """The ```python code blocks of a Markdown page, as their text."""
    blocks: list[str] = []
    current: list[str] | None = None
    for line in page.read_text().splitlines(keepends=True):
        if current is None and line.strip() == "```python":
            current = []
        elif current is not None and line.strip() == "```":
            blocks.append("".join(current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


@pytest.mark.parametrize("page", ["README.md", "docs/quickstart.md"])
def test_the_page_shows_the_quick_start_as_it_runs(page: str) -> None:
    assert QUICKSTART.read_text() in python_blocks(ROOT / page)


def test_the_quick_start_page_shows_the_typed_keys_example() -> None:
    assert TYPED_KEYS.read_text() in python_blocks(ROOT / "docs" / "quickstart.md")


def test_the_quick_start_prints_each_segment_in_call_order() -> None:
    result = subprocess.run(
        [sys.executable, str(QUICKSTART)], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.splitlines() == [
        "seg-1: partial",
        "seg-2: partial",
        "seg-1: revision",
        "seg-1: final done",
    ]
    assert "seg-1: final done" in (ROOT / "README.md").read_text()


def blocks_with_output(page: Path) -> list[tuple[str, str]]:
    """Each ```python block of ``page`` with the ```text block that follows it (its output)."""
    pairs: list[tuple[str, str]] = []
    fence: str | None = None
    lines: list[str] = []
    code: str | None = None
    for line in page.read_text().splitlines(keepends=True):
        stripped = line.strip()
        if fence is None and stripped in ("```python", "```text"):
            fence, lines = stripped, []
        elif fence is not None and stripped == "```":
            text = "".join(lines)
            if fence == "```python":
                code = text
            elif code is not None:
                pairs.append((code, text))
                code = None
            fence = None
        elif fence is not None:
            lines.append(line)
    return pairs


def test_every_python_block_of_the_readme_prints_the_output_it_shows(tmp_path: Path) -> None:
    pairs = blocks_with_output(ROOT / "README.md")
    python_block_count = len(python_blocks(ROOT / "README.md"))
    assert len(pairs) == python_block_count >= 2, "each python block needs its output below it"
    for number, (code, shown) in enumerate(pairs):
        script = tmp_path / f"block{number}.py"
        script.write_text(code)
        result = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=True
        )
        assert result.stdout == shown, f"README python block {number} printed something else"
