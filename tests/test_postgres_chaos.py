"""A small chaos run of the PostgreSQL backend (full size: python -m tests.postgres_chaos)."""

from __future__ import annotations

import pytest

from .postgres_chaos import run


@pytest.mark.timeout(180)
def test_chaos_no_lost_write_no_overlap_fences_strictly_increase() -> None:
    report = run(workers=3, seconds=12, seed=5)
    # The run did what it is for: calls went through, and faults of every kind happened.
    assert report["ok"] > 100, report
    assert report["kill"] >= 1 and report["terminate"] >= 1 and report["restart"] >= 1, report
