"""Worker processes of the distributed tests: started together, each expected to say done."""

from __future__ import annotations

import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_until_done(commands: Iterable[Sequence[str]], timeout: float = 120) -> None:
    """Run one process per command (in the project's root) at once and wait for all of them.

    Each must exit 0 having printed ``done``; on any failure or timeout, every process still
    running is killed before the assertion's error goes on.
    """
    workers = [
        subprocess.Popen(list(command), cwd=ROOT, stdout=subprocess.PIPE, text=True)
        for command in commands
    ]
    try:
        for worker in workers:
            out, _ = worker.communicate(timeout=timeout)
            assert worker.returncode == 0 and out.strip() == "done", out
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
