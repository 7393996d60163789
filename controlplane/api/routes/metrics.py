"""The customer route for a database's own metrics (scoped to the caller's organisation: another's
instance is not found). Thin: the use case is controlplane.services.metrics."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request

from controlplane.api import problems as errors
from controlplane.api.auth import Customer, customer
from controlplane.api.models import MetricsSeries
from controlplane.api.routes.instances import InstanceRef
from controlplane.api.state import app_state
from controlplane.services import metrics

router = APIRouter(tags=["instances"])

Caller = Annotated[Customer, Depends(customer)]


@router.get(
    "/v1/instances/{instance_id}/metrics",
    response_model=MetricsSeries,
    response_model_by_alias=True,
    responses=errors.responses(401, 403, 404, 422),
    summary="The database's own metrics over a range (connections, transactions, rows, cache, size)",
    operation_id="instanceMetrics",
    description=(
        "Samples of the database's metrics, taken by the control plane every 10 seconds (kept a "
        "day) and rolled up into 5-minute points (kept 30 days), as at most 720 points of `step` "
        "seconds between `from` (default: an hour before `to`) and `to` (default: now). A smaller "
        "step is widened; a range longer than 30 days or older than the retention is refused (422)."
    ),
)
async def instance_metrics(
    instance_id: InstanceRef,
    request: Request,
    who: Caller,
    from_: Annotated[datetime | None, Query(alias="from", description="start (RFC 3339)")] = None,
    to: Annotated[datetime | None, Query(description="end (RFC 3339)")] = None,
    step: Annotated[int | None, Query(ge=1, le=86_400, description="seconds between points")] = None,
) -> dict[str, Any]:
    app = app_state(request)
    kept = metrics.retention(app.settings.reconciler)
    async with app.pool.connection() as conn:
        found = await metrics.series(conn, who.org_id, instance_id, from_, to, step, kept)
    return found.as_dict()
