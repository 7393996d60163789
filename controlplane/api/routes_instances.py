"""Customer routes for instances: create, read, list, change, delete, audit log, watch."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any

import psycopg
from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from psycopg.rows import DictRow

import provisioners
from controlplane import handlers, jobs, lifecycle
from controlplane.api import errors, idempotency, views, watch
from controlplane.api.auth import Customer, customer
from controlplane.api.errors import ProblemError
from controlplane.api.models import (
    Instance,
    InstanceCreate,
    InstanceEventPage,
    InstancePage,
    InstanceState,
    InstanceUpdate,
)
from controlplane.api.state import AppState, app_state
from controlplane.db import AsyncConn
from controlplane.instances import create_instance

router = APIRouter(prefix="/v1/instances", tags=["instances"])

DEFAULT_LIMIT = 50
MAX_LIMIT = 100
LIVE_NAME_INDEX = "ux_instances_live_name"
DEPROVISIONABLE_NOW = ("ready", "degraded", "suspended")

Caller = Annotated[Customer, Depends(customer)]
InstanceId = Annotated[uuid.UUID, "the instance id"]


def _location(instance_id: uuid.UUID) -> str:
    return f"/v1/instances/{instance_id}"


def _headers(doc: dict[str, Any], *, location: bool = False) -> dict[str, str]:
    headers = {"ETag": views.etag(int(doc["state_version"]))}
    if location:
        headers["Location"] = _location(doc["id"])
    return headers


def _json(doc: dict[str, Any], status: int) -> JSONResponse:
    body = Instance.model_validate(doc).model_dump(mode="json")
    return JSONResponse(body, status_code=status, headers=_headers(doc))


async def _load(conn: AsyncConn, who: Customer, instance_id: uuid.UUID, *, lock: bool = False) -> DictRow:
    """The caller's instance (scoped to its organisation in SQL), or 404."""
    cursor = await conn.execute(
        f"SELECT {views.INSTANCE_COLUMNS} FROM {views.INSTANCE_FROM}"
        " WHERE i.id = %s AND i.org_id = %s" + (" FOR UPDATE OF i" if lock else ""),
        (instance_id, who.org_id),
    )
    row = await cursor.fetchone()
    if row is None:
        raise ProblemError("not-found", f"no instance {instance_id}")
    return row


async def _check_restore_source(conn: AsyncConn, who: Customer, source: uuid.UUID, provisioner: str) -> None:
    """A restore names an instance of the caller's own organisation (404 otherwise, as for a read),
    on a provisioner that restores (422 otherwise)."""
    cursor = await conn.execute("SELECT 1 FROM instances WHERE id = %s AND org_id = %s", (source, who.org_id))
    if await cursor.fetchone() is None:
        raise ProblemError("not-found", f"restore_from.instance_id: no instance {source}")
    if not provisioners.supports_restore(provisioner):
        raise ProblemError(
            "validation", f"restore_from is not supported by the {provisioner} provisioner of this service"
        )


def _refuse_state(row: DictRow, detail: str, kind: str = "invalid-state") -> ProblemError:
    return ProblemError(
        kind,
        detail,
        current_state=row["state"],
        allowed_actions=views.row_actions(row),
    )


@router.post(
    "",
    status_code=202,
    response_model=Instance,
    responses={
        202: {"headers": {"Location": {"schema": {"type": "string"}}}},
        **errors.responses(400, 401, 403, 404, 409, 413, 422),
    },
    summary="Create an instance (provisioned in the background)",
)
async def create(
    body: InstanceCreate,
    request: Request,
    who: Caller,
    idempotency_key: Annotated[str | None, Header(max_length=idempotency.MAX_KEY_LENGTH)] = None,
) -> JSONResponse:
    state = app_state(request)
    spec: dict[str, Any] = {"plan": body.plan, "region": body.region}
    if body.restore_from is not None:
        spec["restore_from"] = body.restore_from.model_dump(mode="json")
    digest = idempotency.request_hash("POST", "/v1/instances", body.model_dump(mode="json"))
    async with state.pool.connection() as conn:
        try:
            async with conn.transaction():
                if idempotency_key is not None:
                    idempotency.check_key(idempotency_key)
                    stored = await idempotency.begin(conn, who.org_id, idempotency_key, digest)
                    if stored is not None:
                        headers = {**stored.headers, "Idempotent-Replayed": "true"}
                        return JSONResponse(stored.body, status_code=stored.status_code, headers=headers)
                if body.restore_from is not None:
                    await _check_restore_source(
                        conn, who, body.restore_from.instance_id, state.settings.provisioner
                    )
                row = await create_instance(
                    conn,
                    who.org_id,
                    body.name,
                    spec,
                    who.actor,
                    deadline_s=state.settings.deadline_s("pending") or 300.0,
                    deletion_protection=body.deletion_protection,
                    request_id=who.request_id,
                )
                await jobs.enqueue(
                    conn,
                    jobs.NewJob(handlers.PROVISION, row["id"], max_attempts=state.settings.job_max_attempts),
                    who.actor,
                    request_id=who.request_id,
                )
                doc = views.instance(row, state.box)
                headers = _headers(doc, location=True)
                body_json = Instance.model_validate(doc).model_dump(mode="json")
                if idempotency_key is not None:
                    await idempotency.save(
                        conn,
                        who.org_id,
                        idempotency_key,
                        digest,
                        idempotency.StoredResponse(202, body_json, headers),
                    )
        except psycopg.errors.UniqueViolation as exc:
            if exc.diag.constraint_name != LIVE_NAME_INDEX:
                raise
            raise ProblemError(
                "name-taken", f"a live instance named {body.name!r} already exists in this organisation"
            ) from None
    return JSONResponse(body_json, status_code=202, headers=headers)


@router.get(
    "",
    response_model=InstancePage,
    responses=errors.responses(401, 403, 422),
    summary="List the organisation's instances (oldest first, cursor paginated)",
)
async def list_instances(
    request: Request,
    who: Caller,
    state: InstanceState | None = None,
    limit: Annotated[int, Query(ge=1, description=f"page size; values above {MAX_LIMIT} are capped")] = (
        DEFAULT_LIMIT
    ),
    cursor: str | None = None,
) -> dict[str, Any]:
    app = app_state(request)
    limit = min(limit, MAX_LIMIT)
    after_created: datetime | None = None
    after_id: uuid.UUID | None = None
    if cursor:
        created_s, id_s = views.decode_cursor(cursor, 2)
        try:
            after_created, after_id = datetime.fromisoformat(created_s), uuid.UUID(id_s)
        except ValueError:
            raise views.bad_cursor() from None
    async with app.pool.connection() as conn:
        rows = await (
            await conn.execute(
                f"SELECT {views.INSTANCE_COLUMNS} FROM {views.INSTANCE_FROM}"
                " WHERE i.org_id = %(org)s"
                " AND (%(state)s::text IS NULL OR i.state = %(state)s::text)"
                " AND (%(after_created)s::timestamptz IS NULL"
                "      OR (i.created_at, i.id) > (%(after_created)s::timestamptz, %(after_id)s::uuid))"
                " ORDER BY i.created_at, i.id LIMIT %(limit)s",
                {
                    "org": who.org_id,
                    "state": state,
                    "after_created": after_created,
                    "after_id": after_id,
                    "limit": limit + 1,
                },
            )
        ).fetchall()
    page, next_cursor = views.page_of(
        rows, limit, lambda last: views.encode_cursor(last["created_at"].isoformat(), last["id"])
    )
    return {"items": [views.instance(r, app.box) for r in page], "next_cursor": next_cursor}


@router.get(
    "/{instance_id}",
    response_model=Instance,
    responses={
        200: {"headers": {"ETag": {"schema": {"type": "string"}}}},
        **errors.responses(401, 403, 404, 422),
    },
    summary="Get an instance, with its connection details once it has been ready",
)
async def get_instance(instance_id: uuid.UUID, request: Request, who: Caller) -> JSONResponse:
    app = app_state(request)
    async with app.pool.connection() as conn:
        doc = views.instance(await _load(conn, who, instance_id), app.box, reveal=True)
    return _json(doc, 200)


async def _load_to_change(
    conn: AsyncConn, who: Customer, instance_id: uuid.UUID, if_match: str | None
) -> DictRow:
    """The caller's instance locked for a change, once its If-Match precondition (if any) holds."""
    row = await _load(conn, who, instance_id, lock=True)
    if if_match is not None and not views.matches(if_match, row["state_version"]):
        raise ProblemError(
            "precondition-failed",
            f"If-Match {if_match} does not match the instance's ETag {views.etag(row['state_version'])}",
            current_state=row["state"],
        )
    return row


@router.patch(
    "/{instance_id}",
    status_code=202,
    response_model=Instance,
    responses=errors.responses(400, 401, 403, 404, 409, 412, 413, 422),
    summary="Change an instance's plan or deletion protection",
)
async def update_instance(
    instance_id: uuid.UUID,
    body: InstanceUpdate,
    request: Request,
    who: Caller,
    if_match: Annotated[str | None, Header()] = None,
) -> JSONResponse:
    app = app_state(request)
    async with app.pool.connection() as conn, conn.transaction():
        row = await _load_to_change(conn, who, instance_id, if_match)
        if row["deletion_requested_at"] is not None or not views.can_still_update(row["state"]):
            why = (
                "its deletion has been requested" if row["deletion_requested_at"] else f"it is {row['state']}"
            )
            raise _refuse_state(row, f"instance {instance_id} cannot be changed: {why}")
        # A plan other than the declared one, or the declared one again after its update was
        # given up (a retry): either makes a new spec generation.
        new_plan = body.plan is not None and (
            body.plan != row["spec"].get("plan") or row["failed_generation"] == row["spec_generation"]
        )
        protection = body.deletion_protection
        if new_plan or (protection is not None and protection != row["deletion_protection"]):
            await conn.execute(
                "UPDATE instances SET"
                " spec = CASE WHEN %(new_plan)s THEN spec || jsonb_build_object('plan', %(plan)s::text)"
                "        ELSE spec END,"
                " spec_generation = spec_generation + CASE WHEN %(new_plan)s THEN 1 ELSE 0 END,"
                " deletion_protection = COALESCE(%(protection)s, deletion_protection),"
                " updated_at = now()"
                " WHERE id = %(id)s AND org_id = %(org)s",
                {
                    "new_plan": new_plan,
                    "plan": body.plan,
                    "protection": protection,
                    "id": instance_id,
                    "org": who.org_id,
                },
            )
        row = await _load(conn, who, instance_id)
        if new_plan and "update" in lifecycle.INSTANCE.allowed_events(row["state"]):
            await jobs.enqueue(
                conn,
                jobs.NewJob(
                    handlers.UPDATE,
                    instance_id,
                    payload={"spec_generation": row["spec_generation"]},
                    max_attempts=app.settings.job_max_attempts,
                ),
                who.actor,
                request_id=who.request_id,
            )
    return _json(views.instance(row, app.box), 202)


@router.delete(
    "/{instance_id}",
    status_code=202,
    response_model=Instance,
    responses=errors.responses(401, 403, 404, 409, 412, 422),
    summary="Delete an instance (now if it can start deprovisioning, else as soon as it can)",
)
async def delete_instance(
    instance_id: uuid.UUID,
    request: Request,
    who: Caller,
    skip_final_backup: Annotated[
        bool, Query(description="delete without taking a final backup first")
    ] = False,
    if_match: Annotated[str | None, Header()] = None,
) -> JSONResponse:
    app = app_state(request)
    async with app.pool.connection() as conn, conn.transaction():
        row = await _load_to_change(conn, who, instance_id, if_match)
        if row["state"] in lifecycle.INSTANCE.terminal:
            raise _refuse_state(row, f"instance {instance_id} is {row['state']}")
        if row["deletion_protection"]:
            raise _refuse_state(
                row,
                f"instance {instance_id} has deletion protection on; turn it off with PATCH first",
                "deletion-protected",
            )
        if row["deletion_requested_at"] is None and row["state"] != "deprovisioning":
            await conn.execute(
                "UPDATE instances SET deletion_requested_at = now(), skip_final_backup = %s,"
                " updated_at = now() WHERE id = %s AND org_id = %s",
                (skip_final_backup, instance_id, who.org_id),
            )
            if row["state"] in DEPROVISIONABLE_NOW:
                await jobs.enqueue(
                    conn,
                    jobs.NewJob(
                        handlers.DEPROVISION,
                        instance_id,
                        payload={"skip_final_backup": skip_final_backup},
                        max_attempts=app.settings.job_max_attempts,
                    ),
                    who.actor,
                    request_id=who.request_id,
                )
            row = await _load(conn, who, instance_id)
    return _json(views.instance(row, app.box), 202)


@router.get(
    "/{instance_id}/events",
    response_model=InstanceEventPage,
    responses=errors.responses(401, 403, 404, 422),
    summary="The instance's audit log, oldest first",
)
async def instance_events(
    instance_id: uuid.UUID,
    request: Request,
    who: Caller,
    cursor: str | None = None,
    limit: Annotated[int, Query(ge=1)] = DEFAULT_LIMIT,
) -> dict[str, Any]:
    app = app_state(request)
    limit = min(limit, MAX_LIMIT)
    after = views.after_id(cursor)
    async with app.pool.connection() as conn:
        await _load(conn, who, instance_id)
        rows = await (
            await conn.execute(
                "SELECT e.* FROM instance_events e JOIN instances i ON i.id = e.instance_id"
                " WHERE e.instance_id = %s AND i.org_id = %s AND e.id > %s ORDER BY e.id LIMIT %s",
                (instance_id, who.org_id, after, limit + 1),
            )
        ).fetchall()
    page, next_cursor = views.page_of(rows, limit, views.id_cursor)
    return {"items": [views.event(r) for r in page], "next_cursor": next_cursor}


@router.get(
    "/{instance_id}/watch",
    responses={
        200: {
            "description": "Server-Sent Events: `instance` (snapshot), then one `transition` per change",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        },
        **errors.responses(401, 403, 404, 422),
    },
    response_class=StreamingResponse,
    summary="Follow the instance's state changes as Server-Sent Events",
)
async def watch_instance(instance_id: uuid.UUID, request: Request, who: Caller) -> StreamingResponse:
    app: AppState = app_state(request)
    async with app.pool.connection() as conn:
        await _load(conn, who, instance_id)
    stream = watch.instance_stream(app, request, instance_id, who.org_id)
    return StreamingResponse(
        stream,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
