"""Routes without authentication: health, readiness, metrics, the lifecycle tables, the plans."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from controlplane.api import problems as errors
from controlplane.api.models import Health, Lifecycles, PlanList
from controlplane.api.state import app_state
from controlplane.core import plans, reference
from controlplane.db import connection as db
from controlplane.db import sql

router = APIRouter()


@router.get(
    "/healthz",
    response_model=Health,
    tags=["health"],
    summary="The process is up",
    operation_id="getHealth",
    description="Answers 200 while the process runs (liveness).",
)
async def healthz() -> dict[str, Any]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    response_model=Health,
    responses=errors.responses(503),
    tags=["health"],
    summary="The database is reachable and its schema is at the latest migration",
    operation_id="getReadiness",
    description=(
        "Answers 200 when the database is reachable and its schema is at the latest migration, else 503 "
        "(readiness)."
    ),
)
async def readyz(request: Request) -> Any:
    app = app_state(request)
    if app.head_revision is None:
        app.head_revision = db.head_revision()
    try:
        # The pool's own wait: short while the database is known to be unreachable.
        async with app.pool.connection() as conn:
            cursor = await conn.execute(sql.SCHEMA_REVISION)
            rows = [r["version_num"] for r in await cursor.fetchall()]
            cursor = await conn.execute(sql.SESSION_WRITABLE)
            writable = await cursor.fetchone()
            if not (writable and writable["writable"]):
                # The pool closes the session (it stays read-only for its life) and opens another
                # in its place, which finds the database writable once it is.
                raise db.READ_ONLY("the database is read-only")
    except Exception as exc:
        why = "read-only" if isinstance(exc, db.READ_ONLY) else f"not reachable: {type(exc).__name__}"
        return errors.problem_response(
            "unavailable", f"database {why}", instance="/readyz", headers={"Retry-After": "1"}
        )
    if rows != [app.head_revision]:
        return errors.problem_response(
            "unavailable",
            f"database schema is at {', '.join(rows) or 'no revision'}, expected {app.head_revision}",
            instance="/readyz",
        )
    return {"status": "ready", "detail": f"schema at {app.head_revision}"}


@router.get(
    "/metrics",
    tags=["health"],
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}}},
    summary="Prometheus metrics",
    operation_id="getMetrics",
    description="The process's metrics in the Prometheus text format.",
)
async def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


@router.get(
    "/v1/lifecycle",
    response_model=Lifecycles,
    response_model_by_alias=True,
    tags=["reference"],
    summary="The lifecycle tables with their metadata (labels, severity, billing, alerting moves,"
    " deadlines), the failure reasons, the steps of each operation, the customer actions",
    operation_id="getLifecycle",
    description=(
        "The instance and job lifecycles: states, moves, their labels, severities and billing classes, "
        "and every typed failure reason."
    ),
)
async def lifecycle_tables(request: Request) -> JSONResponse:
    deadlines = app_state(request).settings.reconciler.deadline_s
    return JSONResponse(reference.lifecycle_document(deadlines))


@router.get(
    "/v1/plans",
    response_model=PlanList,
    tags=["reference"],
    summary="The plans on offer",
    operation_id="listPlans",
    description="The plans a customer can choose, with their PostgreSQL settings, shape and backup schedule.",
)
async def list_plans() -> dict[str, Any]:
    return {
        "items": [
            {
                "name": name,
                "settings": dict(plans.PLANS[name]),
                **plans.get_shape(name).as_dict(),
                "backups": dataclasses.asdict(plans.backup_schedule(name)),
            }
            for name in plans.plan_names()
        ]
    }
