"""The database page's charts (pure): the polyline in the view box, the range, the numbers."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from controlplane.api.console import charts

T0 = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)


@dataclass(frozen=True)
class P:
    at: datetime
    connections: float | None


CONNECTIONS = charts.METRICS[0]


def test_a_chart_spans_the_view_box_from_zero_to_its_highest_value_or_limit() -> None:
    points = [P(T0, 0.0), P(T0 + timedelta(seconds=10), 5.0), P(T0 + timedelta(seconds=20), 10.0)]
    drawn = charts.chart(CONNECTIONS, points)
    assert drawn.points == f"0.0,{charts.HEIGHT:.1f} 150.0,30.0 300.0,0.0"
    assert (drawn.latest, drawn.low, drawn.high, drawn.limit) == ("10.0", "0.0", "10.0", None)
    assert drawn.rows == [("10:00:00", "0.0"), ("10:00:10", "5.0"), ("10:00:20", "10.0")]
    limited = charts.chart(CONNECTIONS, points, limit=20)
    assert limited.points.endswith("300.0,30.0") and limited.limit == "20.0"  # half the plan's limit


def test_missing_values_are_left_out_and_one_value_draws_no_line() -> None:
    assert charts.chart(CONNECTIONS, []).latest == "no samples yet"
    one = charts.chart(CONNECTIONS, [P(T0, None), P(T0 + timedelta(seconds=10), 4.0)])
    assert (one.points, one.latest, one.rows) == ("", "4.0", [("10:00:10", "4.0")])
