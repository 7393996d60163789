"""Usage from the event log (pure): billable time per instance, plan and billing class, exactly.

Each instance event starts a segment in the state it moved to, which lasts until the instance's
next event (or `now`); its billing class is the state's (`lifecycle.INSTANCE.state_info`), or the
one the state gives the failure code of the event (`detail.code`: a degradation for lost data is
storage only), and its plan the one in effect (the creation's spec, then each applied update's
plan). Usage over a window is the segments clipped to it, summed. Nothing is kept between calls,
so a restart of the control plane changes nothing: the same log gives the same usage.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

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


@dataclass(frozen=True)
class Segment:
    instance_id: uuid.UUID
    org_id: uuid.UUID
    plan: str
    state: str
    billing: Billing
    start: datetime
    end: datetime


def segments(events: Iterable[UsageEvent], until: datetime) -> list[Segment]:
    """Every instance's time in each state, from its events (any order), the last open until `until`."""
    by_instance: dict[uuid.UUID, list[UsageEvent]] = defaultdict(list)
    for event in events:
        by_instance[event.instance_id].append(event)
    found: list[Segment] = []
    for history in by_instance.values():
        history.sort(key=lambda e: e.seq)
        plan = "unknown"
        for event, following in zip(history, [*history[1:], None], strict=True):
            plan = plan_set_by(event.detail) or plan
            end = following.at if following is not None else max(until, event.at)
            if event.to_state in INSTANCE.terminal:
                continue
            billing = INSTANCE.state_info[event.to_state].billing_for(failure_code_of(event.detail))
            found.append(
                Segment(event.instance_id, event.org_id, plan, event.to_state, billing, event.at, end)
            )
    return found


@dataclass(frozen=True)
class UsageLine:
    """Time of one instance on one plan in one billing class within a window."""

    instance_id: uuid.UUID
    org_id: uuid.UUID
    plan: str
    billing: Billing
    seconds: float


def usage(events: Iterable[UsageEvent], start: datetime, end: datetime, now: datetime) -> list[UsageLine]:
    """The usage over [start, end) as of `now` (time after `now` has not happened yet)."""
    if end <= start:
        raise ValueError("the window must end after it starts")
    stop = min(end, now)
    totals: dict[tuple[uuid.UUID, uuid.UUID, str, Billing], timedelta] = defaultdict(timedelta)
    for segment in segments(events, now):
        overlap = min(segment.end, stop) - max(segment.start, start)
        if overlap > timedelta(0):
            totals[(segment.instance_id, segment.org_id, segment.plan, segment.billing)] += overlap
    lines = [
        UsageLine(instance_id, org_id, plan, billing, spent.total_seconds())
        for (instance_id, org_id, plan, billing), spent in totals.items()
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


def meter_identifier(period_start: datetime, line: UsageLine) -> str:
    """The meter event's idempotency identifier: one per instance, plan, class and period (< 100 chars)."""
    return f"u-{int(period_start.timestamp())}-{line.instance_id}-{line.billing}-{line.plan}"[:100]


def totals_by(lines: Sequence[UsageLine], *keys: str) -> dict[tuple[Any, ...], float]:
    """Seconds summed by the named fields of the lines."""
    summed: dict[tuple[Any, ...], float] = defaultdict(float)
    for line in lines:
        summed[tuple(getattr(line, key) for key in keys)] += line.seconds
    return dict(summed)
