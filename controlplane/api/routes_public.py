"""Routes without authentication: health, readiness, metrics, the lifecycle tables, the plans."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from controlplane import db, plans, reference, sql
from controlplane.api import errors
from controlplane.api.models import Health, Lifecycles, PlanList
from controlplane.api.state import app_state

router = APIRouter()


@router.get("/healthz", response_model=Health, tags=["health"], summary="The process is up")
async def healthz() -> dict[str, Any]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    response_model=Health,
    responses=errors.responses(503),
    tags=["health"],
    summary="The database is reachable and its schema is at the latest migration",
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
    except Exception as exc:
        return errors.problem_response(
            "unavailable",
            f"database not reachable: {type(exc).__name__}",
            instance="/readyz",
            headers={"Retry-After": "1"},
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
)
async def lifecycle_tables(request: Request) -> JSONResponse:
    deadlines = app_state(request).settings.reconciler.deadline_s
    return JSONResponse(reference.lifecycle_document(deadlines))


@router.get("/v1/plans", response_model=PlanList, tags=["reference"], summary="The plans on offer")
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
