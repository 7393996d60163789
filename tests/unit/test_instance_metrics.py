"""Pure parts of a database's metrics and of storage autoscaling: the range a series is served at,
rates across counter resets, the CLI's sparklines, and the autoscaling decision with injected
samples and time."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from controlplane.cli.render import show_metrics, sparkline
from controlplane.core import dbmetrics
from controlplane.core.dbmetrics import GIB, BadRange, Retention, series_request
from reconciler import planning
from reconciler.planning import GrowStorage, InstanceView, StorageRule, StorageView, WarnStorageFull
from tests.unit.test_reconciler_planning import view

NOW = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)
KEPT = Retention()


def test_a_range_is_served_from_the_finest_resolution_kept_in_bounded_points() -> None:
    hour = series_request(NOW - timedelta(hours=1), NOW, None, NOW, KEPT)
    assert (hour.resolution_s, hour.step_s) == (10, 10)
    day = series_request(NOW - timedelta(days=1), NOW, None, NOW, KEPT)
    assert day.resolution_s == 10 and 86_400 / day.step_s <= dbmetrics.MAX_POINTS
    old = series_request(NOW - timedelta(days=3), NOW - timedelta(days=2), None, NOW, KEPT)
    assert (old.resolution_s, old.step_s % 300) == (300, 0)
    assert series_request(NOW - timedelta(hours=1), NOW, 600, NOW, KEPT).resolution_s == 300
    for start, end in ((NOW, NOW - timedelta(hours=1)), (NOW - timedelta(days=31), NOW)):
        with pytest.raises(BadRange):
            series_request(start, end, None, NOW, KEPT)


def test_rates_are_none_across_a_reset_or_a_gap() -> None:
    assert dbmetrics.rate(110, 100, 10) == 1.0
    assert dbmetrics.rate(5, 100, 10) is None and dbmetrics.rate(5, None, 10) is None
    assert dbmetrics.hit_ratio_of_rates(0, 0) is None and dbmetrics.hit_ratio_of_rates(3, 1) == 0.75


def test_the_cli_shows_each_metric_with_a_sparkline(capsys: pytest.CaptureFixture[str]) -> None:
    assert sparkline([0, 1, None, 7]) == "▁▂ █"
    point = dict.fromkeys(
        ("connections", "transactions_per_s", "rows_read_per_s", "rows_written_per_s", "cache_hit_ratio"), 1.0
    )
    series = {"from": "a", "to": "b", "step_s": 10, "plan": "dev", "max_connections": 20}
    show_metrics(
        {**series, "points": [{**point, "size_bytes": 2**20}, {**point, "size_bytes": 2**21}]}, "table"
    )
    out = capsys.readouterr().out
    assert "plan dev allows 20 connections" in out and "database size" in out and "MiB" in out and "▁█" in out


def _view(
    used: list[tuple[int, float]], allocated: int = 10, maximum: int = 20, **storage: object
) -> InstanceView:
    samples = [(NOW - timedelta(seconds=ago), int(gib * GIB)) for ago, gib in used]
    return view("ready", storage=StorageView(allocated, maximum, samples, **storage))  # type: ignore[arg-type]


FULL_5_MIN = [(ago, 9.5) for ago in range(300, -10, -10)]


def test_storage_grows_after_five_minutes_at_most_ten_percent_free() -> None:
    rule = StorageRule()
    (grow,) = planning.plan_storage(_view(FULL_5_MIN), NOW, rule)
    assert isinstance(grow, GrowStorage) and grow.to_gb == 11
    assert "95% of 10 GB used for 5 min" in grow.reason
    # A sample with more free space in the window: not yet.
    broken = [*FULL_5_MIN[:10], (200, 8.0), *FULL_5_MIN[11:]]
    assert planning.plan_storage(_view(broken), NOW, rule) == []
    assert planning.plan_storage(_view(FULL_5_MIN[1:]), NOW, rule) == []  # 4 min 50 s
    assert planning.plan_storage(_view(FULL_5_MIN), NOW, StorageRule(enabled=False)) == []


def test_storage_growth_waits_out_its_cooldown_and_stops_at_the_maximum_with_a_warning() -> None:
    rule = StorageRule()
    recent = NOW - timedelta(hours=5)
    assert planning.plan_storage(_view(FULL_5_MIN, grown_at=recent), NOW, rule) == []
    (grow,) = planning.plan_storage(_view(FULL_5_MIN, maximum=11), NOW, rule)
    assert isinstance(grow, GrowStorage) and grow.to_gb == 11
    big = [(ago, 95.0) for ago, _ in FULL_5_MIN]
    (capped,) = planning.plan_storage(_view(big, allocated=100, maximum=105), NOW, rule)
    assert isinstance(capped, GrowStorage) and capped.to_gb == 105  # 10 % would be 110
    (warn,) = planning.plan_storage(_view(FULL_5_MIN, maximum=10), NOW, rule)
    assert isinstance(warn, WarnStorageFull) and "maximum" in warn.reason
    warned = NOW - timedelta(hours=1)
    assert planning.plan_storage(_view(FULL_5_MIN, maximum=10, warned_at=warned), NOW, rule) == []


def _held(used: list[tuple[int, float]]) -> InstanceView:
    """Suspended (read-only) for outgrowing its allocation."""
    seen = replace(_view(used).observed, read_only=True)  # type: ignore[type-var]
    return replace(_view(used), state="suspended", failure_code="storage_full", observed=seen)


def test_a_database_beyond_its_allocation_is_suspended_and_resumed_once_the_allocation_holds_it() -> None:
    rule = StorageRule(enabled=False)
    beyond = [(0, 10.2)]
    (held,) = planning.plan(_view(beyond), NOW, 3, rule)
    assert held == planning.Enqueue("suspend", held.reason, code="storage_full")
    assert held.reason.startswith("storage full: 102% of 10 GB used")
    assert planning.plan(_view([(0, 9.9)]), NOW, 3, rule) == []  # full is not beyond
    # Not under a job, nor over a billing hold (which suspends it anyway), nor while being deleted.
    for changes in ({"live_jobs": ("backup",)}, {"billing_hold": True}, {"deletion_requested": True}):
        assert all(a != held for a in planning.plan(replace(_view(beyond), **changes), NOW, 3, rule))
    suspended = _held(beyond)
    assert planning.plan(suspended, NOW, 3, rule) == []  # still beyond: held
    grown = replace(_held([(0, 10.2)]), storage=StorageView(11, 20, [(NOW, int(10.2 * GIB))]))
    (resume,) = planning.plan(grown, NOW, 3, rule)
    assert resume == planning.Enqueue("resume", "storage allocation holds the data again: 93% of 11 GB used")
    # A suspension for another reason is not released by the allocation.
    by_billing = replace(grown, failure_code=None, suspended_by_billing=True, billing_hold=True)
    assert planning.plan(by_billing, NOW, 3, rule) == []


def test_autoscaling_grows_a_held_database_and_the_allocation_is_counted_in_the_views_unit() -> None:
    beyond = [(ago, 10.5) for ago, _ in FULL_5_MIN]
    held = _held(beyond)
    (grow,) = planning.plan(held, NOW, 3, StorageRule())
    assert isinstance(grow, GrowStorage) and grow.to_gb == 11  # which holds its 10.5 GB
    # A smaller unit (as a test sets): 1 GB of 1 MiB, 1.5 MiB used.
    small = view("ready", storage=StorageView(1, 10, [(NOW, 3 * 2**19)], gb_bytes=2**20))
    (suspend,) = planning.plan(small, NOW, 3, StorageRule(enabled=False))
    assert suspend == planning.Enqueue("suspend", suspend.reason, code="storage_full")
