"""The database page's charts (pure): a metric series as an SVG polyline in a fixed view box, its
latest value, its range, and every point as text for the table beside the chart."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from controlplane.core import dbmetrics

# The view box every chart is drawn in; the page scales it to its width (readable at 390 px).
WIDTH, HEIGHT = 300, 60


# The charts, in the order shown.
METRICS = dbmetrics.SHOWN


@dataclass(frozen=True)
class Chart:
    key: str
    title: str
    points: str  # the polyline's "x,y x,y ..." in the view box; empty with fewer than two values
    latest: str
    low: str
    high: str
    rows: list[tuple[str, str]]  # (time, value) for every point, oldest first
    limit: str | None = None  # what the plan allows, where it says


def chart(metric: dbmetrics.Shown, points: Sequence[Any], *, limit: float | None = None) -> Chart:
    """`metric` over `points` (each with `at` and the metric's field), scaled between zero (or the
    lowest value, if below) and the highest of the values and the limit."""
    values = [(p.at, getattr(p, metric.field)) for p in points]
    known = [(at, float(v)) for at, v in values if v is not None]
    rows = [(_time(at), metric.write(v)) for at, v in known]
    if not known:
        return Chart(metric.key, metric.title, "", "no samples yet", "-", "-", rows)
    numbers = [v for _, v in known]
    low = min(0.0, *numbers)
    high = max(*numbers, limit if limit is not None else numbers[0])
    span = (high - low) or 1.0
    first, last = known[0][0], known[-1][0]
    seconds = (last - first).total_seconds() or 1.0
    drawn = " ".join(
        f"{(at - first).total_seconds() / seconds * WIDTH:.1f},{HEIGHT - (v - low) / span * HEIGHT:.1f}"
        for at, v in known
    )
    return Chart(
        metric.key,
        metric.title,
        drawn if len(known) > 1 else "",
        metric.write(numbers[-1]),
        metric.write(min(numbers)),
        metric.write(max(numbers)),
        rows,
        None if limit is None else metric.write(limit),
    )


def charts(series: Any) -> list[Chart]:
    """The page's charts of a `controlplane.services.metrics.Series`."""
    limits = {"connections": series.max_connections}
    return [chart(m, series.points, limit=limits.get(m.field)) for m in METRICS]


def _time(at: datetime) -> str:
    return at.strftime("%H:%M:%S")
