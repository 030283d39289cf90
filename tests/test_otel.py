"""The OpenTelemetry observer, read back through the SDK's in-memory metric reader."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from keyserial import KeyedSerialQueue
from keyserial.otel import OpenTelemetryObserver

from .scheduling import settle

pytestmark = pytest.mark.asyncio


def read_points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    data = reader.get_metrics_data()
    assert data is not None
    points: dict[str, list[Any]] = {}
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                points[metric.name] = list(metric.data.data_points)
    return points


async def test_metrics_by_function_and_outcome_without_the_key() -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    queue = KeyedSerialQueue(
        max_pending=2, observer=OpenTelemetryObserver(provider.get_meter("test"))
    )
    gate = asyncio.Event()

    async def hold() -> None:
        await gate.wait()

    async def fail() -> None:
        raise ValueError("x")

    holder = asyncio.create_task(queue.run("secret-key", hold))
    await settle()
    waiter = asyncio.create_task(queue.run("secret-key", fail))
    await settle()
    with pytest.raises(Exception, match="max_pending"):
        await queue.run("secret-key", hold)

    waiting = {
        p.attributes["function"].rsplit(".", 1)[-1]: p.value
        for p in read_points(reader)["keyserial.waiting_calls"]
    }
    assert waiting == {"hold": 0, "fail": 1}

    gate.set()
    await holder
    with pytest.raises(ValueError):
        await waiter
    points = read_points(reader)
    outcomes = {
        (p.attributes["function"].rsplit(".", 1)[-1], p.attributes["outcome"]): p.value
        for p in points["keyserial.calls"]
    }
    assert outcomes == {("hold", "rejected"): 1, ("hold", "completed"): 1, ("fail", "failed"): 1}
    assert {
        p.attributes["function"].rsplit(".", 1)[-1]: p.count for p in points["keyserial.wait_time"]
    } == {"hold": 1, "fail": 1}
    assert sum(p.count for p in points["keyserial.run_time"]) == 2
    assert all(p.value == 0 for p in points["keyserial.waiting_calls"])
    for name, metric_points in points.items():
        for point in metric_points:
            assert "secret-key" not in str(dict(point.attributes)), name
    provider.shutdown()
