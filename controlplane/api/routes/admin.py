"""SRE routes (admin key): any instance with its raw failure and its step records, the audit log of
all instances (raw reasons), jobs and operator actions, dwell times."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request

from controlplane.api import problems as errors
from controlplane.api import views
from controlplane.api.auth import AdminKey
from controlplane.api.models import (
    AdminEventPage,
    AdminInstance,
    DwellStats,
    InstanceState,
    Job,
    JobAction,
    JobEventList,
    JobList,
    JobState,
    Stuck,
    Timestamp,
)
from controlplane.api.state import app_state
from controlplane.audit import dwell, search
from controlplane.core import cursors
from controlplane.db import sql
from controlplane.queue import moves as queue
from controlplane.services import instances

# Step records an SRE view of an instance lists at most (the oldest first).
MAX_STEPS = 1000

router = APIRouter(prefix="/v1/admin", tags=["sre"])

MAX_LIMIT = 500
DEFAULT_LIMIT = 100


@router.get(
    "/instances/{instance_id}",
    response_model=AdminInstance,
    responses=errors.responses(401, 403, 404, 422),
    summary="Any instance as SREs see it: the raw failure reason and every step record of its jobs",
    operation_id="adminGetInstance",
    description="Any instance as SREs see it: the raw failure reason and every step record of its jobs.",
)
async def admin_instance(instance_id: uuid.UUID, request: Request, _: AdminKey) -> dict[str, Any]:
    app = app_state(request)
    async with app.pool.connection() as conn:
        inst = await instances.load(conn, None, instance_id)
        doc = await views.one_instance(conn, inst, app.box)
        cursor = await conn.execute(
            sql.INSTANCE_STEPS, {"instance_id": instance_id, "after": 0, "limit": MAX_STEPS}
        )
        steps = await cursor.fetchall()
    return {**doc, "failure_reason_raw": inst.failure_reason, "steps": steps}


@router.get(
    "/events",
    response_model=AdminEventPage,
    responses=errors.responses(401, 403, 422),
    summary="The audit log of every instance, oldest first, filtered",
    operation_id="adminListEvents",
    description=(
        "The audit log of every instance, oldest first, filtered by instance, organisation, actor, event,"
        " state and time. The actor filter also finds the moves of jobs that actor caused (`stripe` finds"
        " what Stripe events did)."
    ),
)
async def admin_events(
    request: Request,
    _: AdminKey,
    instance: uuid.UUID | None = None,
    org: uuid.UUID | None = None,
    actor: Annotated[
        str | None,
        Query(max_length=300, description="actor kind (`stripe`) or kind:id (`customer:<key id>`)"),
    ] = None,
    event: Annotated[str | None, Query(max_length=100)] = None,
    to_state: InstanceState | None = None,
    since: Annotated[Timestamp | None, Query(description="events at or after this time")] = None,
    until: Annotated[Timestamp | None, Query(description="events before this time")] = None,
    cursor: str | None = None,
    limit: Annotated[int, Query(ge=1, description=f"page size; values above {MAX_LIMIT} are capped")] = (
        DEFAULT_LIMIT
    ),
) -> dict[str, Any]:
    limit = min(limit, MAX_LIMIT)
    after = cursors.after_id(cursor)
    where = search.EventFilter(instance, org, actor, event, to_state, since, until)
    async with app_state(request).pool.connection() as conn:
        rows = await search.search(conn, where, after=after, limit=limit + 1)
    page, next_cursor = cursors.page_of(rows, limit, cursors.id_cursor)
    items = [
        {
            **views.sre_event(r),
            "instance_id": r["instance_id"],
            "instance_name": r["instance_name"],
            "org_id": r["org_id"],
            "org_name": r["org_name"],
            "state_version": r["state_version"],
            "request_id": r["request_id"],
        }
        for r in page
    ]
    return {"items": items, "next_cursor": next_cursor}


def _job(row: Any) -> dict[str, Any]:
    return {name: row.get(name) for name in Job.model_fields}


@router.get(
    "/jobs",
    response_model=JobList,
    responses=errors.responses(401, 403, 422),
    summary="Jobs, newest first, by state and kind",
    operation_id="adminListJobs",
    description="Jobs, newest first, filtered by state, kind and instance.",
)
async def admin_jobs(
    request: Request,
    _: AdminKey,
    state: JobState | None = None,
    kind: Annotated[str | None, Query(max_length=100)] = None,
    instance: uuid.UUID | None = None,
    limit: Annotated[int, Query(ge=1, description=f"values above {MAX_LIMIT} are capped")] = DEFAULT_LIMIT,
) -> dict[str, Any]:
    async with app_state(request).pool.connection() as conn:
        rows = await queue.list_jobs(
            conn, state=state, kind=kind, instance_id=instance, limit=min(limit, MAX_LIMIT)
        )
    return {"items": [_job(r) for r in rows]}


@router.get(
    "/jobs/{job_id}",
    response_model=JobEventList,
    responses=errors.responses(401, 403, 404, 422),
    summary="A job's event history, oldest first",
    operation_id="adminListJobEvents",
    description="Every state change of the job, oldest first, with its actor, reason and detail (the "
    "actor that enqueued it first: `stripe:<event id>` for what a Stripe event caused).",
)
async def admin_job_events(
    job_id: uuid.UUID,
    request: Request,
    _: AdminKey,
    limit: Annotated[int, Query(ge=1, le=10_000, description="events at most")] = 1000,
) -> dict[str, Any]:
    async with app_state(request).pool.connection() as conn:
        rows = await queue.job_events(conn, job_id, limit)
    if not rows:
        raise errors.ProblemError("not-found", f"no job {job_id}")
    return {
        "items": [
            {
                **views.sre_event(r),
                "job_id": r["job_id"],
                "request_id": r["request_id"],
                "state_version": r["state_version"],
            }
            for r in rows
        ]
    }


@router.get(
    "/stuck",
    response_model=Stuck,
    responses=errors.responses(401, 403),
    summary="Instances past their state deadline; jobs whose heartbeat went silent",
    operation_id="adminStuck",
    description="Live instances past their state deadline, and held jobs whose holder has not "
    "heartbeated for longer than the reclaim interval (the worker settings of this process).",
)
async def admin_stuck(request: Request, _: AdminKey) -> dict[str, Any]:
    app = app_state(request)
    stale_after_s = app.settings.worker.reclaim_after_s
    async with app.pool.connection() as conn:
        late = await (await conn.execute(sql.STUCK_INSTANCES)).fetchall()
        silent = await (await conn.execute(sql.SILENT_JOBS, {"stale_after_s": stale_after_s})).fetchall()
    return {
        "instances_past_deadline": [{**r, "overdue_s": r["overdue"].total_seconds()} for r in late],
        "jobs_without_heartbeat": [{**r, "silent_for_s": r["silent_for"].total_seconds()} for r in silent],
        "stale_after_s": stale_after_s,
    }


@router.post(
    "/jobs/{job_id}/{action}",
    response_model=Job,
    responses=errors.responses(400, 401, 403, 404, 409, 413, 422),
    summary="Pause, resume, retry or abandon a job, with a reason (recorded as the operator's)",
    operation_id="adminJobAction",
    description="Pause, resume, retry or abandon a job as an operator; the reason is recorded in its search.",
)
async def admin_job_action(
    job_id: uuid.UUID,
    action: Literal["pause", "resume", "retry", "abandon"],
    body: JobAction,
    request: Request,
    who: AdminKey,
) -> dict[str, Any]:
    app = app_state(request)
    registry = app.job_registry if action == "abandon" else None
    async with app.pool.connection() as conn:
        row = await queue.operator_action(conn, job_id, action, who.actor.id, body.reason, registry=registry)
    return _job(row)


@router.post(
    "/instances/{ref}/switchover",
    response_model=Job,
    status_code=202,
    responses=errors.responses(400, 401, 403, 404, 409, 413, 422),
    summary="Switch an HA instance's primary over to a standby (writes pause for seconds, none lost)",
    operation_id="adminSwitchover",
    description=(
        "Move a ready HA instance's primary to its most advanced standby: an update job (ready ->"
        " updating -> ready, the plan unchanged) that pauses writes at the instance's pooler, stops the"
        " primary cleanly, promotes the standby and makes the old primary its standby. `ref` is an id or"
        " the name of one live instance; the reason is recorded with the operator as its actor."
    ),
)
async def admin_switchover(ref: str, body: JobAction, request: Request, who: AdminKey) -> dict[str, Any]:
    app = app_state(request)
    async with app.pool.connection() as conn, conn.transaction():
        job_id = await instances.request_switchover(conn, ref, who.actor, body.reason)
        row = await (await conn.execute(sql.JOB_BY_ID, {"id": job_id})).fetchone()
    return _job(row)


@router.get(
    "/stats/dwell",
    response_model=DwellStats,
    responses=errors.responses(401, 403, 422),
    summary="Time spent in each state: count, p50, p95, max (seconds)",
    operation_id="adminDwellStats",
    description=(
        "Time spent in each state of the instance or job lifecycle: count, p50, p95 and max in seconds."
    ),
)
async def admin_dwell(
    request: Request,
    _: AdminKey,
    entity: Literal["instance", "job"] = "instance",
    since: Annotated[Timestamp | None, Query(description="only stays going on at or after this time")] = None,
) -> dict[str, Any]:
    async with app_state(request).pool.connection() as conn:
        stats = await dwell.dwell_stats(conn, entity, since=since)
    return {"entity": entity, "states": [s.as_dict() for s in stats]}
