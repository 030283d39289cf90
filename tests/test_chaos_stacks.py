"""The chaos runs' stack requests answer with each task's await chain."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .chaos_stacks import stacks_of

ROOT = Path(__file__).resolve().parent.parent

STUCK = """
import asyncio
from tests.chaos_stacks import answer_stack_requests

async def stuck_here() -> None:
    await asyncio.Event().wait()

async def main() -> None:
    answer_stack_requests()
    print("ready", flush=True)
    await stuck_here()

asyncio.run(main())
"""


def test_a_stuck_process_says_where_each_task_waits(tmp_path: Path) -> None:
    errors = tmp_path / "stderr"
    with errors.open("wb") as written:
        process = subprocess.Popen(
            [sys.executable, "-c", STUCK], cwd=ROOT, stdout=subprocess.PIPE, stderr=written
        )
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == b"ready"
        stacks = stacks_of(process, errors)
    finally:
        process.kill()
        process.wait()
        assert process.stdout is not None
        process.stdout.close()
    assert f"--- tasks of process {process.pid} ---" in stacks
    assert "stuck_here" in stacks  # the innermost coroutine of the main task's chain
