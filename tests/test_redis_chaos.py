"""A small chaos run of the Redis backend (the full-size one: python -m tests.redis_chaos)."""

from __future__ import annotations

from .redis_chaos import Chaos


def test_chaos_no_overlap_no_lost_write_no_hung_call() -> None:
    report = Chaos(workers=3, seconds=10, seed=7, lease=0.5, keys=3).run()
    assert report.problems() == [], report.summary()
    # The run did what it is for: calls went through, and faults of every kind happened.
    assert report.outcomes["ok"] > 100, report.summary()
    assert report.turns > 100
    assert sum(report.faults.values()) >= 8
