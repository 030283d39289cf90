"""The examples run as documented and show what they claim."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_transcript_pipeline_shows_stale_segments_only_without_serialization() -> None:
    pipeline = load_example("transcript_pipeline")
    results = asyncio.run(pipeline.main(segments=200, seed=7))
    unserialized, serialized = results["unserialized"], results["@serialized"]
    assert len(pipeline.stale_segments(unserialized)) > 0
    assert pipeline.stale_segments(serialized) == []
    assert set(serialized.saved.values()) == {"final"}
    assert len(serialized.saved) == 200
    # Serialized per segment, yet segments were still saved concurrently.
    assert serialized.max_concurrent > 1


def test_transcript_pipeline_script_prints_its_table_deterministically() -> None:
    command = [sys.executable, str(EXAMPLES / "transcript_pipeline.py"), "--segments", "60"]
    first = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    second = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    assert first.stdout == second.stdout
    rows = {line.split()[0]: line.split() for line in first.stdout.splitlines() if line}
    assert int(rows["unserialized"][1]) > 0
    assert rows["@serialized"][1:3][0] == "0"
    assert rows["@serialized"][-1] == "-"
