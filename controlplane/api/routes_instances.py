"""Customer routes for instances: create, read, list, change, delete, audit log, watch.

Each route parses the request, calls its use case (`controlplane.services.instances`) and renders
the result; a refusal is a DomainError, rendered as problem+json by `controlplane.api.errors`.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse

from controlplane import sql
from controlplane.api import errors, idempotency, views, watch
from controlplane.api.auth import Customer, customer
from controlplane.api.models import (
    Instance,
    InstanceCreate,
    InstanceEventPage,
    InstancePage,
    InstanceState,
    InstanceUpdate,
)
from controlplane.api.state import AppState, app_state
from controlplane.records import Instance as InstanceRecord
from controlplane.services import instances
from provisioners.base import RestoreSource

router = APIRouter(prefix="/v1/instances", tags=["instances"])

DEFAULT_LIMIT = 50
MAX_LIMIT = 100

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
    restore_from = None
    if body.restore_from is not None:
        restore_from = RestoreSource.from_spec(body.restore_from.model_dump(mode="json"))
    asked = instances.CreateInstance(
        who.org_id,
        body.name,
        body.plan,
        body.region,
        deletion_protection=body.deletion_protection,
        restore_from=restore_from,
    )
    digest = idempotency.request_hash("POST", "/v1/instances", body.model_dump(mode="json"))
    async with state.pool.connection() as conn, conn.transaction():
        if idempotency_key is not None:
            idempotency.check_key(idempotency_key)
            stored = await idempotency.begin(conn, who.org_id, idempotency_key, digest)
            if stored is not None:
                headers = {**stored.headers, "Idempotent-Replayed": "true"}
                return JSONResponse(stored.body, status_code=stored.status_code, headers=headers)
        created = await instances.create(conn, who.actor, who.request_id, asked, state.policy)
        doc = views.instance(created.instance, state.box)
        headers = _headers(doc, location=True)
        body_json = Instance.model_validate(doc).model_dump(mode="json")
        if idempotency_key is not None:
            await idempotency.save(
                conn, who.org_id, idempotency_key, digest, idempotency.StoredResponse(202, body_json, headers)
            )
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
                sql.LIST_ORG_INSTANCES,
                {
                    "org": who.org_id,
                    "state": state,
                    "after_created": after_created,
                    "after_id": after_id,
                    "limit": limit + 1,
                },
            )
        ).fetchall()
    found = [InstanceRecord.from_row(row) for row in rows]
    page, next_cursor = views.page_of(
        found, limit, lambda last: views.encode_cursor(last.created_at.isoformat(), last.id)
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
        doc = views.instance(await instances.load(conn, who.org_id, instance_id), app.box, reveal=True)
    return _json(doc, 200)


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
    asked = instances.ChangeInstance(
        who.org_id,
        instance_id,
        plan=body.plan,
        deletion_protection=body.deletion_protection,
        if_versions=views.if_match_versions(if_match),
    )
    async with app.pool.connection() as conn:
        changed = await instances.change(conn, who.actor, who.request_id, asked, app.policy)
    return _json(views.instance(changed.instance, app.box), 202)


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
    asked = instances.RequestDeletion(
        who.org_id, instance_id, skip_final_backup, if_versions=views.if_match_versions(if_match)
    )
    async with app.pool.connection() as conn:
        requested = await instances.request_deletion(conn, who.actor, who.request_id, asked, app.policy)
    return _json(views.instance(requested.instance, app.box), 202)


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
        await instances.load(conn, who.org_id, instance_id)
        rows = await (
            await conn.execute(
                sql.ORG_INSTANCE_EVENTS,
                {"id": instance_id, "org": who.org_id, "after": after, "limit": limit + 1},
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
        await instances.load(conn, who.org_id, instance_id)
    stream = watch.instance_stream(app, request, instance_id, who.org_id)
    return StreamingResponse(
        stream,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
