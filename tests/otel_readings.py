"""Reading OpenTelemetry metrics in tests: the SDK's in-memory reader, on the process's
global MeterProvider (``reader`` fixture in conftest.py: it can be set once per process),
and the figures before and after what a test did (the sums are cumulative)."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader

Key = tuple[str, tuple[tuple[str, Any], ...]]


def figures(reader: InMemoryMetricReader) -> dict[Key, Any]:
    """Every data point now: a sum or gauge's value, a histogram's (count, sum, max)."""
    found: dict[Key, Any] = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    key = (metric.name, tuple(sorted(point.attributes.items())))
                    if isinstance(point, HistogramDataPoint):
                        found[key] = (point.count, point.sum, point.max)
                    else:
                        found[key] = point.value
    return found


def grew(before: dict[Key, Any], after: dict[Key, Any], name: str, **attrs: str) -> float:
    """How much a counter (or up-down counter) moved between two readings."""
    key = (name, tuple(sorted(attrs.items())))
    return float(after.get(key, 0)) - float(before.get(key, 0))


def histogram(before: dict[Key, Any], after: dict[Key, Any], name: str) -> tuple[int, float]:
    """A histogram's new records between two readings: (count, the largest one ever)."""
    count, _, worst = after.get((name, ()), (0, 0.0, 0.0))
    return count - before.get((name, ()), (0, 0.0, 0.0))[0], worst
