"""Customer routes for instances: create, read, list, change, delete, retry, audit log, watch.

Each route parses the request, calls its use case (`controlplane.services.instances`) and renders
the result; a refusal is a DomainError, rendered as problem+json by `controlplane.api.errors`.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from psycopg.rows import DictRow

from controlplane import sql
from controlplane.api import errors, idempotency, views, watch
from controlplane.api.auth import Customer, customer
from controlplane.api.models import (
    DNS_LABEL,
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


@dataclass(frozen=True)
class Created:
    """The answer to a creating request: the instance document (or the one stored for its
    Idempotency-Key, then `replayed`)."""

    status_code: int
    body: dict[str, Any]
    headers: dict[str, str]
    replayed: bool

    def response(self) -> JSONResponse:
        headers = {**self.headers, "Idempotent-Replayed": "true"} if self.replayed else self.headers
        return JSONResponse(self.body, status_code=self.status_code, headers=headers)


async def _accepted(
    state: AppState,
    who: Customer,
    idempotency_key: str | None,
    digest: str,
    run: Callable[[AsyncConn], Awaitable[InstanceRecord]],
) -> Created:
    """202 with the instance a creating use case made, in one transaction with its Idempotency-Key
    record: the same key and request again replays the stored answer."""
    async with state.pool.connection() as conn, conn.transaction():
        if idempotency_key is not None:
            idempotency.check_key(idempotency_key)
            stored = await idempotency.begin(conn, who.org_id, idempotency_key, digest)
            if stored is not None:
                return Created(stored.status_code, stored.body, stored.headers, replayed=True)
        doc = await views.one_instance(conn, await run(conn), state.box)
        headers = _headers(doc, location=True)
        body_json = Instance.model_validate(doc).model_dump(mode="json")
        if idempotency_key is not None:
            await idempotency.save(
                conn, who.org_id, idempotency_key, digest, idempotency.StoredResponse(202, body_json, headers)
            )
    return Created(202, body_json, headers, replayed=False)


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
    return (await create_instance(app_state(request), who, body, idempotency_key)).response()


async def create_instance(
    state: AppState, who: Customer, body: InstanceCreate, idempotency_key: str | None
) -> Created:
    """The create use case behind an Idempotency-Key (the API's and the console's)."""
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

    async def run(conn: AsyncConn) -> InstanceRecord:
        return (await instances.create(conn, who.actor, who.request_id, asked, state.policy)).instance

    return await _accepted(state, who, idempotency_key, digest, run)


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
    name: Annotated[
        str | None, Query(max_length=63, pattern=DNS_LABEL, description="only the instances of this name")
    ] = None,
    include: Annotated[
        Literal["archived"] | None, Query(description="archived: list deleted failed instances too")
    ] = None,
    limit: Annotated[int, Query(ge=1, description=f"page size; values above {MAX_LIMIT} are capped")] = (
        DEFAULT_LIMIT
    ),
    cursor: str | None = None,
) -> dict[str, Any]:
    app = app_state(request)
    items, next_cursor = await instances_page(
        app, who.org_id, state=state, name=name, archived=include == "archived", limit=limit, cursor=cursor
    )
    return {"items": items, "next_cursor": next_cursor}


async def instances_page(
    app: AppState,
    org_id: uuid.UUID,
    *,
    state: str | None = None,
    name: str | None = None,
    archived: bool = False,
    limit: int = DEFAULT_LIMIT,
    cursor: str | None = None,
) -> tuple[list[dict[str, Any]], str | None]:
    """A page of an organisation's instances (their documents), oldest first, and the cursor of
    the next page; archived ones only when asked for."""
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
                    "org": org_id,
                    "state": state,
                    "name": name,
                    "archived": archived,
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
        items = await views.instances(conn, page, app.box)
    return items, next_cursor


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
        inst = await instances.load(conn, who.org_id, instance_id)
        doc = await views.one_instance(conn, inst, app.box, reveal=True)
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
        doc = await views.one_instance(conn, changed.instance, app.box)
    return _json(doc, 202)


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
        doc = await views.one_instance(conn, requested.instance, app.box)
    return _json(doc, 202)


@router.post(
    "/{instance_id}/retry",
    status_code=202,
    response_model=Instance,
    responses={
        202: {"headers": {"Location": {"schema": {"type": "string"}}}},
        **errors.responses(400, 401, 403, 404, 409, 422),
    },
    summary="Retry a failed instance: a new one from its spec and name, linked both ways",
)
async def retry_instance(
    instance_id: uuid.UUID,
    request: Request,
    who: Caller,
    idempotency_key: Annotated[str | None, Header(max_length=idempotency.MAX_KEY_LENGTH)] = None,
) -> JSONResponse:
    return (await retry(app_state(request), who, instance_id, idempotency_key)).response()


async def retry(
    state: AppState, who: Customer, instance_id: uuid.UUID, idempotency_key: str | None
) -> Created:
    """The retry use case behind an Idempotency-Key (the API's and the console's)."""
    asked = instances.RetryInstance(who.org_id, instance_id)
    path = f"/v1/instances/{instance_id}/retry"
    digest = idempotency.request_hash("POST", path, {})

    async def run(conn: AsyncConn) -> InstanceRecord:
        return (await instances.retry(conn, who.actor, who.request_id, asked, state.policy)).instance

    return await _accepted(state, who, idempotency_key, digest, run)


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
    rows, next_cursor = await events_page(app, who.org_id, instance_id, limit=limit, cursor=cursor)
    return {"items": [views.event(r) for r in rows], "next_cursor": next_cursor}


async def events_page(
    app: AppState, org_id: uuid.UUID, instance_id: uuid.UUID, *, limit: int, cursor: str | None
) -> tuple[Sequence[DictRow], str | None]:
    """A page of an organisation's instance's audit log, oldest first (NotFound if it has none of
    that id), and the cursor of the next page."""
    limit = min(limit, MAX_LIMIT)
    after = views.after_id(cursor)
    async with app.pool.connection() as conn:
        await instances.load(conn, org_id, instance_id)
        rows = await (
            await conn.execute(
                sql.ORG_INSTANCE_EVENTS,
                {"id": instance_id, "org": org_id, "after": after, "limit": limit + 1},
            )
        ).fetchall()
    return views.page_of(rows, limit, views.id_cursor)


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
    return await watch_response(request, who.org_id, instance_id)


async def watch_response(request: Request, org_id: uuid.UUID, instance_id: uuid.UUID) -> StreamingResponse:
    """The watch stream of an organisation's instance (NotFound if it has none of that id)."""
    app: AppState = app_state(request)
    async with app.pool.connection() as conn:
        await instances.load(conn, org_id, instance_id)
    stream = watch.instance_stream(app, request, instance_id, org_id)
    return StreamingResponse(
        stream,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
