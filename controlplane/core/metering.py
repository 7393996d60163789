"""Usage from the event log (pure): billable time per instance, plan and billing class, exactly.

Each instance event starts a segment in the state it moved to, which lasts until the instance's
next event (or `now`); its billing class is the state's (`lifecycle.INSTANCE.state_info`), or the
one the state gives the failure code of the event (`detail.code`: a degradation for lost data is
storage only), its plan the one in effect (the creation's spec, then each applied update's
plan) and its allocated storage the one in effect (the creation's spec, then each applied
update's `storage_gb`; at least the plan's volume). Usage over a window is the segments clipped
to it, summed: seconds, and GB-seconds of allocated storage in the classes that cost something.
Nothing is kept between calls, so a restart of the control plane changes nothing: the same log
gives the same usage.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from controlplane.core import plans
from controlplane.core.lifecycle import INSTANCE, Billing

BILLING_ORDER: tuple[Billing, ...] = ("billed", "storage_only", "not_billed")
# What is reported to Stripe: time that costs the customer something.
REPORTED: tuple[Billing, ...] = ("billed", "storage_only")


@dataclass(frozen=True)
class UsageEvent:
    """The parts of an instance event that usage reads."""

    instance_id: uuid.UUID
    org_id: uuid.UUID
    seq: int
    to_state: str
    at: datetime
    detail: Mapping[str, Any]

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> UsageEvent:
        return cls(**{name: row[name] for name in cls.__dataclass_fields__})


def failure_code_of(detail: Mapping[str, Any]) -> str | None:
    """The failure code an event records (`detail.code` of a `fail` or a `degrade`), if any."""
    code = detail.get("code")
    return code if isinstance(code, str) else None


def plan_set_by(detail: Mapping[str, Any]) -> str | None:
    """The plan an event puts in effect: the creation's spec, or an applied update's plan."""
    spec = detail.get("spec")
    if isinstance(spec, Mapping) and isinstance(spec.get("plan"), str):
        return str(spec["plan"])
    plan = detail.get("plan")
    return plan if isinstance(plan, str) else None


def storage_set_by(detail: Mapping[str, Any]) -> int | None:
    """The allocation (GB) an event puts in effect: the creation's spec's `storage_gb`, or an
    applied update's (an event that puts a plan in effect); None: it leaves the allocation as it was."""
    spec = detail.get("spec")
    if isinstance(spec, Mapping):
        value = spec.get("storage_gb")
    elif isinstance(detail.get("plan"), str):
        value = detail.get("storage_gb")
    else:
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def allocated_gb(plan: str, recorded: int | None) -> int:
    """The storage allocated on `plan` (GB): what was recorded, at least the plan's volume (0 for a
    plan this version does not know and nothing recorded)."""
    shape = plans.SHAPES.get(plan)
    return max(recorded or 0, shape.storage_gb if shape is not None else 0)


@dataclass(frozen=True)
class Segment:
    instance_id: uuid.UUID
    org_id: uuid.UUID
    plan: str
    state: str
    billing: Billing
    start: datetime
    end: datetime
    # The storage allocated during the segment (GB).
    storage_gb: int = 0


def segments(events: Iterable[UsageEvent], until: datetime) -> list[Segment]:
    """Every instance's time in each state, from its events (any order), the last open until `until`."""
    by_instance: dict[uuid.UUID, list[UsageEvent]] = defaultdict(list)
    for event in events:
        by_instance[event.instance_id].append(event)
    found: list[Segment] = []
    for history in by_instance.values():
        history.sort(key=lambda e: e.seq)
        plan = "unknown"
        storage: int | None = None
        for event, following in zip(history, [*history[1:], None], strict=True):
            plan = plan_set_by(event.detail) or plan
            storage = storage_set_by(event.detail) or storage
            end = following.at if following is not None else max(until, event.at)
            if event.to_state in INSTANCE.terminal:
                continue
            billing = INSTANCE.state_info[event.to_state].billing_for(failure_code_of(event.detail))
            found.append(
                Segment(
                    event.instance_id,
                    event.org_id,
                    plan,
                    event.to_state,
                    billing,
                    event.at,
                    end,
                    allocated_gb(plan, storage),
                )
            )
    return found


@dataclass(frozen=True)
class UsageLine:
    """Time of one instance on one plan in one billing class within a window, and its allocated
    storage over that time (GB-seconds; 0 in a class that costs nothing)."""

    instance_id: uuid.UUID
    org_id: uuid.UUID
    plan: str
    billing: Billing
    seconds: float
    gb_seconds: float = 0.0


def usage(events: Iterable[UsageEvent], start: datetime, end: datetime, now: datetime) -> list[UsageLine]:
    """The usage over [start, end) as of `now` (time after `now` has not happened yet)."""
    if end <= start:
        raise ValueError("the window must end after it starts")
    stop = min(end, now)
    totals: dict[tuple[uuid.UUID, uuid.UUID, str, Billing], timedelta] = defaultdict(timedelta)
    # GB x microseconds, summed as integers: exact, whatever the number of segments.
    storage: dict[tuple[uuid.UUID, uuid.UUID, str, Billing], int] = defaultdict(int)
    for segment in segments(events, now):
        overlap = min(segment.end, stop) - max(segment.start, start)
        if overlap > timedelta(0):
            key = (segment.instance_id, segment.org_id, segment.plan, segment.billing)
            totals[key] += overlap
            if segment.billing in REPORTED:
                storage[key] += segment.storage_gb * (overlap // timedelta(microseconds=1))
    lines = [
        UsageLine(*key, spent.total_seconds(), storage[key] / 1_000_000) for key, spent in totals.items()
    ]
    return sorted(
        lines, key=lambda u: (str(u.org_id), str(u.instance_id), u.plan, BILLING_ORDER.index(u.billing))
    )


def periods(first_start: datetime, interval: timedelta, now: datetime, settle: timedelta) -> list[datetime]:
    """The starts of the whole periods from `first_start` that ended at least `settle` before `now`."""
    starts: list[datetime] = []
    start = first_start
    while start + interval + settle <= now:
        starts.append(start)
        start += interval
    return starts


def period_floor(moment: datetime, interval: timedelta) -> datetime:
    """The start of the period containing `moment` (periods are aligned on the Unix epoch)."""
    epoch = datetime(1970, 1, 1, tzinfo=moment.tzinfo)
    return epoch + (moment - epoch) // interval * interval


def meter_identifier(period_start: datetime, line: UsageLine, *, storage: bool = False) -> str:
    """The meter event's idempotency identifier: one per instance, plan, class and period, and
    one more for the storage of each (< 100 chars)."""
    what = f"{line.billing}-gb" if storage else line.billing
    return f"u-{int(period_start.timestamp())}-{line.instance_id}-{what}-{line.plan}"[:100]


def totals_by(lines: Sequence[UsageLine], *keys: str, field: str = "seconds") -> dict[tuple[Any, ...], float]:
    """`field` (seconds, or `gb_seconds`) summed by the named fields of the lines."""
    summed: dict[tuple[Any, ...], float] = defaultdict(float)
    for line in lines:
        summed[tuple(getattr(line, key) for key in keys)] += getattr(line, field)
    return dict(summed)
