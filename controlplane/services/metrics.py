"""The metrics of a customer's database over a range: the use case behind
`GET /v1/instances/{id}/metrics`, the CLI's `instances metrics` and the console's charts.

Scoped to the caller's organisation (another's instance is not found); the range is bounded
(`dbmetrics.series_request`), and each point's rates are differences of the counters between it
and the point before (the range is read from one step earlier so the first point has them)."""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any

from controlplane.core import dbmetrics, plans
from controlplane.core.refusals import InvalidRequest
from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.runtime.settings import ReconcilerSettings
from controlplane.services import instances
from controlplane.services.usage import db_now


@dataclass(frozen=True)
class Point:
    """One step of the series: gauges over the step, rates between its counters and the step before."""

    at: datetime
    connections: float | None
    connections_max: int | None
    max_connections: int | None
    transactions_per_s: float | None
    rows_read_per_s: float | None
    rows_written_per_s: float | None
    cache_hit_ratio: float | None
    size_bytes: int | None
    allocated_bytes: int | None
    replication_lag_s: float | None
    archive_lag_s: float | None


@dataclass(frozen=True)
class Series:
    instance_id: uuid.UUID
    start: datetime
    end: datetime
    step_s: int
    resolution_s: int
    plan: str
    max_connections: int | None
    storage_max_bytes: int | None
    points: list[Point] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        shown = asdict(self)
        shown["from"], shown["to"] = shown.pop("start"), shown.pop("end")
        return shown


def retention(settings: ReconcilerSettings) -> dbmetrics.Retention:
    return dbmetrics.Retention(
        settings.metrics_sample_s,
        settings.metrics_sample_keep_s,
        settings.metrics_rollup_s,
        settings.metrics_rollup_keep_s,
    )


async def series(
    conn: AsyncConn,
    org_id: uuid.UUID | None,
    instance_id: uuid.UUID,
    start: datetime | None,
    end: datetime | None,
    step_s: int | None,
    kept: dbmetrics.Retention,
) -> Series:
    """The instance's metrics in [start, end) (default: the last hour); NotFound if it is not the
    caller's, InvalidRequest for a range that cannot be served."""
    inst = await instances.load(conn, org_id, instance_id)
    now = await db_now(conn)
    end = end or now
    start = start or end - timedelta(hours=1)
    try:
        asked = dbmetrics.series_request(start, end, step_s, now, kept)
    except dbmetrics.BadRange as exc:
        raise InvalidRequest("from", str(exc), location="query") from None
    step = timedelta(seconds=asked.step_s)
    cursor = await conn.execute(
        sql.METRICS_SERIES,
        {
            "instance_id": inst.id,
            "resolution_s": asked.resolution_s,
            "step_s": asked.step_s,
            "start": asked.start - step,
            "end": asked.end,
        },
    )
    rows = await cursor.fetchall()
    points = [_point(row, before) for before, row in zip([None, *rows], rows, strict=False)]
    plan = str(inst.spec.get("plan"))
    known = plans.is_plan(plan)
    return Series(
        inst.id,
        asked.start,
        asked.end,
        asked.step_s,
        asked.resolution_s,
        plan,
        int(plans.get_plan(plan)["max_connections"]) if known else None,
        plans.storage_max_gb(plan) * dbmetrics.GIB if known else None,
        [p for p in points if p.at >= asked.start],
    )


def _point(row: Any, before: Any | None) -> Point:
    seconds = (row["last_at"] - before["last_at"]).total_seconds() if before is not None else 0.0

    def per_s(name: str) -> float | None:
        return dbmetrics.rate(row[name], before[name] if before else None, seconds)

    hit = per_s("blocks_hit")
    read = per_s("blocks_read")
    ratio = None if hit is None or read is None else dbmetrics.hit_ratio_of_rates(hit, read)
    return Point(
        at=row["bucket"],
        connections=row["connections"],
        connections_max=row["connections_max"],
        max_connections=row["max_connections"],
        transactions_per_s=per_s("transactions"),
        rows_read_per_s=per_s("rows_read"),
        rows_written_per_s=per_s("rows_written"),
        cache_hit_ratio=ratio,
        size_bytes=row["size_bytes"],
        allocated_bytes=row["allocated_bytes"],
        replication_lag_s=row["replication_lag_s"],
        archive_lag_s=row["archive_lag_s"],
    )
