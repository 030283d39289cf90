"""A small chaos run of KeyedStream (the full size: python -m tests.stream_chaos)."""

from __future__ import annotations

from .redis_server import RedisServer
from .stream_chaos import Chaos


def test_chaos_per_key_order_nothing_lost_nothing_pending(redis_server: RedisServer) -> None:
    chaos = Chaos(
        2000, 100, consumers=4, partitions=8, lease=0.5, seed=3, killers=1, url=redis_server.url
    )
    report = chaos.run(seconds=50)
    assert report.problems == [], report.summary()
    # The run did what it is for: messages went through, and faults of every kind happened.
    assert report.completed + report.dead_lettered == report.published == 2000
    assert report.dead_lettered > 0
    faults = report.faults
    assert faults["killed"] + faults["paused"] + faults["paused past the lease"] >= 5
    assert faults["paused past the lease"] >= 1  # a partition changed owner during a pause
    assert report.faults["joined"] == 1
    # The killer ended a consumer at most once per delivery it was allowed (4), then was
    # dead-lettered with the poison, and nothing pending beside it was.
    assert 1 <= report.faults["killed by a message"] <= 4
