"""Customer routes for instances: create, read, list, change, delete, audit log, watch.

Each route parses the request, calls its use case (`controlplane.services.instances`) and renders
the result; a refusal is a DomainError, rendered as problem+json by `controlplane.api.errors`.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from controlplane import crashpoints, db, sql
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
from controlplane.db import AsyncConn
from controlplane.records import Instance as InstanceRecord
from controlplane.services import instances
from provisioners.base import RestoreSource

router = APIRouter(prefix="/v1/instances", tags=["instances"])

DEFAULT_LIMIT = views.DEFAULT_LIMIT
MAX_LIMIT = views.MAX_LIMIT

Caller = Annotated[Customer, Depends(customer)]
InstanceId = Annotated[uuid.UUID, "the instance id"]


def _location(instance_id: uuid.UUID) -> str:
    return f"/v1/instances/{instance_id}"


# A response that carries a password is never stored by a cache (nor kept by a browser's history).
NO_STORE = {"Cache-Control": "no-store"}


def _headers(inst: InstanceRecord, *, location: bool = False) -> dict[str, str]:
    headers = {"ETag": views.etag(inst)}
    if location:
        headers["Location"] = _location(inst.id)
    return headers


def _json(inst: InstanceRecord, doc: dict[str, Any], status: int) -> JSONResponse:
    body = Instance.model_validate(doc).model_dump(mode="json")
    headers = _headers(inst) | (NO_STORE if body["connection"] and body["connection"]["password"] else {})
    return JSONResponse(body, status_code=status, headers=headers)


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
    if idempotency_key is not None:
        idempotency.check_key(idempotency_key)

    async def create_once(conn: AsyncConn) -> JSONResponse:
        """The key's stored response, or the use case's with the response stored under the key."""
        if idempotency_key is not None:
            stored = await idempotency.begin(conn, who.org_id, idempotency_key, digest)
            if stored is not None:
                headers = {**stored.headers, "Idempotent-Replayed": "true"}
                return JSONResponse(stored.body, status_code=stored.status_code, headers=headers)
        created = await instances.create(conn, who.actor, who.request_id, asked, state.policy)
        doc = views.instance(created.instance, state.box)
        headers = _headers(created.instance, location=True)
        body_json = Instance.model_validate(doc).model_dump(mode="json")
        if idempotency_key is not None:
            await idempotency.save(
                conn, who.org_id, idempotency_key, digest, idempotency.StoredResponse(202, body_json, headers)
            )
        crashpoints.reached("api.create.before_commit")
        return JSONResponse(body_json, status_code=202, headers=headers)

    response = await db.in_transaction(state.pool, create_once)
    crashpoints.reached("api.create.after_commit")
    return response


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
    after_created, after_id = views.after_created(cursor) or (None, None)
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
        found, limit, lambda last: views.created_cursor(last.created_at, last.id)
    )
    return {"items": [views.instance(r, app.box) for r in page], "next_cursor": next_cursor}


@router.get(
    "/{instance_id}",
    response_model=Instance,
    responses={
        200: {
            "headers": {
                "ETag": {"schema": {"type": "string"}},
                "Cache-Control": {"schema": {"type": "string"}, "description": "no-store: it has a password"},
            }
        },
        304: {"description": "Not modified: the instance is still at the ETag If-None-Match names"},
        **errors.responses(401, 403, 404, 422),
    },
    summary="Get an instance, with its connection details once it has been ready",
)
async def get_instance(
    instance_id: uuid.UUID,
    request: Request,
    who: Caller,
    if_none_match: Annotated[str | None, Header()] = None,
) -> Response:
    app = app_state(request)
    async with app.pool.connection() as conn:
        inst = await instances.load(conn, who.org_id, instance_id)
    if views.none_match(if_none_match, inst):
        return Response(status_code=304, headers=_headers(inst) | NO_STORE)
    return _json(inst, views.instance(inst, app.box, reveal=True), 200)


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
    changed = await db.in_transaction(
        app.pool, lambda conn: instances.change(conn, who.actor, who.request_id, asked, app.policy)
    )
    return _json(changed.instance, views.instance(changed.instance, app.box), 202)


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
    requested = await db.in_transaction(
        app.pool, lambda conn: instances.request_deletion(conn, who.actor, who.request_id, asked, app.policy)
    )
    return _json(requested.instance, views.instance(requested.instance, app.box), 202)


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
            "description": "Server-Sent Events: `instance` (snapshot), then one `transition` per change; "
            "each event's id is the state_version (reconnect with Last-Event-ID to resume)",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        },
        **errors.responses(401, 403, 404, 422),
    },
    response_class=StreamingResponse,
    summary="Follow the instance's state changes as Server-Sent Events",
)
async def watch_instance(
    instance_id: uuid.UUID,
    request: Request,
    who: Caller,
    last_event_id: Annotated[
        str | None, Header(description="the last event id a client saw: resume after it")
    ] = None,
) -> StreamingResponse:
    app: AppState = app_state(request)
    async with app.pool.connection() as conn:
        await instances.load(conn, who.org_id, instance_id)
    resume_after = watch.last_event_id(last_event_id)
    stream = watch.instance_stream(app, request, instance_id, who.org_id, resume_after=resume_after)
    return StreamingResponse(
        stream,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
