"""Where a process of a chaos run is stuck: its tasks' await chains, else its thread.

A chaos process calls ``answer_stack_requests()`` in its event loop; the parent then calls
``stacks_of(process, errors)``, where ``errors`` is the file the process's stderr goes to.
"""

from __future__ import annotations

import asyncio
import faulthandler
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def dump_tasks() -> None:
    """Each task and the chain of coroutines it awaits, innermost last, to stderr."""
    print(f"--- tasks of process {os.getpid()} ---", file=sys.stderr)
    for task in asyncio.all_tasks():
        print(f"{task!r}", file=sys.stderr)
        awaited: Any = task.get_coro()
        while awaited is not None:
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "ag_frame", None)
            if frame is None:
                print(f"    awaits {awaited!r}", file=sys.stderr)
                break
            code = frame.f_code
            print(f"    {code.co_filename}:{frame.f_lineno} {code.co_name}", file=sys.stderr)
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "ag_await", None)
    sys.stderr.flush()


def answer_stack_requests() -> None:
    """SIGUSR1: print where each task waits; SIGUSR2: where the thread is (loop stuck)."""
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump_tasks)
    faulthandler.register(signal.SIGUSR2)


def stacks_of(process: subprocess.Popen[bytes], errors: Path) -> str:
    """Ask ``process`` where it is stuck; what it wrote to ``errors`` in answer."""
    before = errors.stat().st_size
    process.send_signal(signal.SIGUSR1)
    time.sleep(1.0)
    if errors.stat().st_size == before:  # the loop itself is stuck
        process.send_signal(signal.SIGUSR2)
        time.sleep(1.0)
    with errors.open("rb") as written:
        written.seek(before)
        return written.read().decode(errors="replace")
