"""The usage use cases: an organisation's usage over a window, and a period's report to Stripe.

Usage is computed from the event log each time (`controlplane.core.metering`), so it is exact across
plan changes and restarts. A period is reported once: the reconciler records it and enqueues its
`report_usage` job in one transaction; the job sends one meter event per instance, plan and
billing class with an identifier made of those (Stripe refuses a second event with the same
identifier), and one more of each with its allocated storage in GB-seconds; it records each one
Stripe acknowledged, so a retry after an outage or a crash sends only what is missing and never
bills twice.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from controlplane.core import metering
from controlplane.core.metering import UsageLine
from controlplane.core.refusals import InvalidRequest
from controlplane.db import connection as db
from controlplane.db import job_rows as jobs
from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.db.transitions import Actor

log = logging.getLogger(__name__)

REPORT_USAGE = "report_usage"
# The key of the storage meter among a report's event names (the others are billing classes).
STORAGE_METER = "storage_gb"
# The longest window one usage request may cover (a year and a day).
MAX_WINDOW = timedelta(days=366)


def check_window(start: datetime, end: datetime) -> None:
    if start.tzinfo is None or end.tzinfo is None:
        raise InvalidRequest(
            "from", "from and to must carry a time zone (RFC 3339, e.g. 2026-05-01T00:00:00Z)"
        )
    if end <= start:
        raise InvalidRequest("to", "to must be after from")
    if end - start > MAX_WINDOW:
        raise InvalidRequest("to", "the window may cover at most 366 days")


async def usage_of_org(
    conn: AsyncConn, org_id: uuid.UUID, start: datetime, end: datetime, now: datetime | None = None
) -> list[UsageLine]:
    """The organisation's usage over [start, end), per instance, plan and billing class."""
    check_window(start, end)
    cursor = await conn.execute(sql.USAGE_EVENTS_OF_ORG, {"org": org_id, "start": start, "end": end})
    events = [metering.UsageEvent.from_row(row) for row in await cursor.fetchall()]
    return metering.usage(events, start, end, now or await db_now(conn))


async def db_now(conn: AsyncConn) -> datetime:
    cursor = await conn.execute(sql.DATABASE_NOW)
    row = await cursor.fetchone()
    assert row is not None
    value: datetime = row["now"]
    return value


# ---- reports to Stripe -------------------------------------------------------------------------------


async def enqueue_due_reports(
    conn: AsyncConn, now: datetime, interval: timedelta, settle: timedelta, actor: Actor, max_attempts: int
) -> list[datetime]:
    """Record and enqueue the report of every whole period that has settled and has none yet."""
    cursor = await conn.execute(sql.LAST_USAGE_REPORT)
    row = await cursor.fetchone()
    last = row["period_start"] if row is not None else None
    # The first report covers the last settled period: usage before metering began is not sent.
    first = last + interval if last is not None else metering.period_floor(now - settle, interval) - interval
    enqueued: list[datetime] = []
    for start in metering.periods(first, interval, now, settle):
        async with db.transaction(conn):
            cursor = await conn.execute(sql.RECORD_USAGE_REPORT, {"start": start, "end": start + interval})
            if await cursor.fetchone() is None:
                continue
            payload = {"period_start": start.isoformat(), "period_end": (start + interval).isoformat()}
            job = await jobs.enqueue(
                conn, jobs.NewJob(REPORT_USAGE, None, payload=payload, max_attempts=max_attempts), actor
            )
            await conn.execute(sql.SET_USAGE_REPORT_JOB, {"job": job.job["id"], "start": start})
        enqueued.append(start)
    return enqueued


@dataclass(frozen=True)
class MeterEvent:
    """One meter event as the Billing Meter Events API takes it."""

    identifier: str
    event_name: str
    customer: str
    value: int
    timestamp: int
    line: UsageLine
    # What the value counts: seconds, or GB-seconds of allocated storage.
    storage: bool = False

    def params(self) -> dict[str, Any]:
        return {
            "event_name": self.event_name,
            "identifier": self.identifier,
            "timestamp": self.timestamp,
            "payload": {
                "stripe_customer_id": self.customer,
                "value": str(self.value),
                "instance_id": str(self.line.instance_id),
                "plan": self.line.plan,
            },
        }


def meter_events(
    lines: list[UsageLine],
    customers: Mapping[uuid.UUID, str],
    period_start: datetime,
    event_names: Mapping[str, str],
) -> list[MeterEvent]:
    """The meter events of a period: whole seconds of billed and storage-only time, per line, and
    whole GB-seconds of the storage allocated meanwhile."""
    found = []
    for line in lines:
        if line.billing not in metering.REPORTED or line.org_id not in customers:
            continue
        for storage, value, name in (
            (False, round(line.seconds), event_names[line.billing]),
            (True, round(line.gb_seconds), event_names[STORAGE_METER]),
        ):
            if value <= 0:
                continue
            found.append(
                MeterEvent(
                    metering.meter_identifier(period_start, line, storage=storage),
                    name,
                    customers[line.org_id],
                    value,
                    int(period_start.timestamp()),
                    line,
                    storage,
                )
            )
    return found


async def period_events(
    conn: AsyncConn, period_start: datetime, period_end: datetime, event_names: Mapping[str, str]
) -> list[MeterEvent]:
    """Recompute a period's meter events from the log (the report, and its reconciliation)."""
    cursor = await conn.execute(sql.USAGE_EVENTS_BILLED, {"start": period_start, "end": period_end})
    events = [metering.UsageEvent.from_row(row) for row in await cursor.fetchall()]
    lines = metering.usage(events, period_start, period_end, period_end)
    cursor = await conn.execute(sql.STRIPE_CUSTOMERS)
    customers = {row["id"]: row["stripe_customer_id"] for row in await cursor.fetchall()}
    return meter_events(lines, customers, period_start, event_names)


async def report_period(
    conn: AsyncConn,
    period_start: datetime,
    period_end: datetime,
    event_names: Mapping[str, str],
    send: Callable[[MeterEvent], Awaitable[None]],
) -> int:
    """Send the period's meter events not acknowledged yet; `send` raises when Stripe refuses.

    Each acknowledged event is recorded at once, so an error part-way leaves the rest to the retry."""
    planned = await period_events(conn, period_start, period_end, event_names)
    cursor = await conn.execute(sql.METER_EVENTS_SENT_IN, {"start": period_start})
    done = {row["identifier"] for row in await cursor.fetchall()}
    for event in planned:
        if event.identifier in done:
            continue
        await send(event)
        await conn.execute(
            sql.RECORD_METER_EVENT,
            {
                "identifier": event.identifier,
                "start": period_start,
                "org": event.line.org_id,
                "instance": event.line.instance_id,
                "plan": event.line.plan,
                "billing": event.line.billing,
                "event_name": event.event_name,
                "value": event.value,
            },
        )
    await conn.execute(sql.FINISH_USAGE_REPORT, {"start": period_start, "count": len(planned)})
    return len(planned)
