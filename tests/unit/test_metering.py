"""Usage from a scripted log (pure): exact seconds per instance, plan and billing class."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from controlplane.core import metering
from controlplane.core.metering import UsageEvent

ORG = uuid.uuid4()
T0 = datetime(2026, 5, 4, 0, 0, tzinfo=UTC)  # a Monday


def history(instance: uuid.UUID, *moves: tuple[float, str, dict[str, object]]) -> list[UsageEvent]:
    """Events at minutes after T0: (minute, state reached, detail)."""
    return [
        UsageEvent(instance, ORG, seq, state, T0 + timedelta(minutes=minute), detail)
        for seq, (minute, state, detail) in enumerate(moves)
    ]


def by_class(lines: list[metering.UsageLine]) -> dict[tuple[str, str], float]:
    return {(line.plan, line.billing): line.seconds for line in lines}


def test_ready_ninety_minutes_then_suspended_thirty_is_ninety_billed_and_thirty_storage_only() -> None:
    db = uuid.uuid4()
    events = history(
        db,
        (0, "pending", {"spec": {"plan": "standard"}}),
        (0, "provisioning", {}),
        (1, "ready", {}),
        (91, "suspended", {}),
        (121, "deprovisioning", {}),
        (122, "deleted", {}),
    )
    lines = metering.usage(events, T0, T0 + timedelta(days=1), T0 + timedelta(days=2))
    assert by_class(lines) == {
        ("standard", "not_billed"): 120.0,
        ("standard", "billed"): 90 * 60.0,
        ("standard", "storage_only"): 30 * 60.0,
    }


def test_a_plan_change_bills_the_old_plan_until_it_is_applied() -> None:
    db = uuid.uuid4()
    events = history(
        db,
        (0, "pending", {"spec": {"plan": "small"}}),
        (0, "provisioning", {}),
        (0, "ready", {}),
        (60, "updating", {}),
        (62, "ready", {"plan": "large"}),
    )
    now = T0 + timedelta(minutes=182)
    lines = metering.usage(events, T0, T0 + timedelta(hours=6), now)
    assert by_class(lines) == {("small", "billed"): 62 * 60.0, ("large", "billed"): 120 * 60.0}


def test_a_window_clips_the_segments_and_the_future_is_not_billed() -> None:
    db = uuid.uuid4()
    events = history(db, (0, "pending", {"spec": {"plan": "dev"}}), (0, "provisioning", {}), (0, "ready", {}))
    now = T0 + timedelta(minutes=90, seconds=30)
    hour = metering.usage(events, T0 + timedelta(hours=1), T0 + timedelta(hours=2), now)
    assert by_class(hour) == {("dev", "billed"): 30 * 60.0 + 30}
    assert metering.usage(events, T0 + timedelta(hours=2), T0 + timedelta(hours=3), now) == []


def test_hourly_periods_cover_the_time_once() -> None:
    db = uuid.uuid4()
    events = history(
        db,
        (0, "pending", {"spec": {"plan": "dev"}}),
        (0, "provisioning", {}),
        (7, "ready", {}),
        (400, "suspended", {}),
    )
    now = T0 + timedelta(days=1)
    hourly = [
        metering.usage(events, T0 + timedelta(hours=h), T0 + timedelta(hours=h + 1), now) for h in range(24)
    ]
    summed = metering.totals_by([line for hour in hourly for line in hour], "billing")
    whole = metering.totals_by(metering.usage(events, T0, now, now), "billing")
    assert (
        summed
        == whole
        == {("not_billed",): 7 * 60.0, ("billed",): 393 * 60.0, ("storage_only",): 1040 * 60.0}
    )


def test_time_degraded_for_lost_data_is_storage_only_and_a_degradation_still_serving_is_billed() -> None:
    db = uuid.uuid4()
    events = history(
        db,
        (0, "pending", {"spec": {"plan": "standard"}}),
        (0, "provisioning", {}),
        (0, "ready", {}),
        (60, "degraded", {"code": "unhealthy"}),
        (70, "ready", {}),
        (100, "degraded", {"code": "data_lost"}),  # no server while a restore, or a decision, is awaited
        (280, "ready", {"plan": "standard"}),
        (300, "degraded", {"code": "data_lost"}),
        (310, "failed", {"code": "data_lost"}),
    )
    lines = metering.usage(events, T0, T0 + timedelta(days=1), T0 + timedelta(days=1))
    assert by_class(lines) == {
        ("standard", "billed"): (60 + 10 + 30 + 20) * 60.0,
        ("standard", "storage_only"): (180 + 10) * 60.0,
    }


def test_periods_and_identifiers() -> None:
    hour = timedelta(hours=1)
    start = metering.period_floor(T0 + timedelta(minutes=75), hour)
    assert start == T0 + hour
    assert metering.periods(T0, hour, T0 + timedelta(hours=3, minutes=4), timedelta(minutes=5)) == [
        T0,
        T0 + hour,
    ]
    line = metering.UsageLine(uuid.uuid4(), ORG, "standard", "billed", 10.0)
    identifier = metering.meter_identifier(T0, line)
    assert len(identifier) <= 100 and identifier == metering.meter_identifier(T0, line)
    assert identifier != metering.meter_identifier(T0 + hour, line)


def test_allocated_storage_is_billed_at_the_old_size_until_a_growth_is_applied_and_the_new_after() -> None:
    db = uuid.uuid4()
    events = history(
        db,
        (0, "pending", {"spec": {"plan": "dev"}}),  # dev's volume: 1 GB
        (0, "provisioning", {}),
        (10, "ready", {}),
        (60, "updating", {"storage_gb": 3}),  # the growth asked for: not allocated yet
        (61, "ready", {"plan": "dev", "storage_gb": 3, "generation": 2}),
        (100, "suspended", {}),
    )
    now = T0 + timedelta(minutes=120)
    (billed, suspended, setup) = metering.usage(events, T0, T0 + timedelta(hours=2), now)
    assert (setup.billing, setup.gb_seconds) == ("not_billed", 0.0)  # nothing billed, storage neither
    assert billed.billing == "billed" and billed.seconds == 90 * 60.0
    assert billed.gb_seconds == 51 * 60 * 1 + 39 * 60 * 3
    assert suspended.billing == "storage_only" and suspended.gb_seconds == 20 * 60 * 3
    # Hour by hour, the growth falls in the period it happened in.
    first = metering.usage(events, T0, T0 + timedelta(hours=1), now)
    assert metering.totals_by(first, field="gb_seconds") == {(): 50 * 60.0}
    second = metering.usage(events, T0 + timedelta(hours=1), T0 + timedelta(hours=2), now)
    assert metering.totals_by(second, field="gb_seconds") == {(): 60.0 + 59 * 60 * 3}


def test_the_allocation_is_the_creations_storage_at_least_the_plans_volume() -> None:
    db = uuid.uuid4()
    events = history(
        db,
        (0, "pending", {"spec": {"plan": "small", "storage_gb": 25}}),
        (0, "ready", {}),
        (30, "updating", {}),
        (31, "ready", {"plan": "medium"}),  # an update recorded without storage_gb (older logs)
    )
    lines = metering.usage(events, T0, T0 + timedelta(hours=1), T0 + timedelta(hours=1))
    assert {line.plan: line.gb_seconds for line in lines} == {"small": 31 * 60 * 25, "medium": 29 * 60 * 50}
    unknown = history(uuid.uuid4(), (0, "pending", {"spec": {"plan": "standard"}}), (0, "ready", {}))
    (line,) = metering.usage(unknown, T0, T0 + timedelta(hours=1), T0 + timedelta(hours=1))
    assert line.seconds == 3600.0 and line.gb_seconds == 0.0
