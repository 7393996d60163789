"""Customer routes for instances: create, read, list, change, delete, retry, audit log, watch.

Each route parses the request, calls its use case (`controlplane.services.instances`) and renders
the result; a refusal is a DomainError, rendered as problem+json by `controlplane.api.problems`.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Path, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from controlplane.api import openapi, views, watch
from controlplane.api import problems as errors
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
from controlplane.api.state import app_state
from controlplane.core.records import Instance as InstanceRecord
from controlplane.db import connection as db
from controlplane.db.connection import AsyncConn
from controlplane.runtime import crashpoints
from controlplane.runtime.secretbox import SecretBox
from controlplane.services import idempotency, instances
from provisioners.base import RestoreSource

router = APIRouter(prefix="/v1/instances", tags=["instances"])

DEFAULT_LIMIT = views.DEFAULT_LIMIT
MAX_LIMIT = views.MAX_LIMIT

Caller = Annotated[Customer, Depends(customer)]


async def resolve_instance(
    request: Request,
    who: Caller,
    instance_id: Annotated[
        str,
        Path(
            min_length=1,
            max_length=63,
            description="the instance's id, or its name (its live instance of that name)",
            examples=["orders"],
        ),
    ],
) -> uuid.UUID:
    """The id an instance path names: an id as given, a name by one look-up in the use cases."""
    try:
        return uuid.UUID(instance_id)
    except ValueError:
        pass
    async with app_state(request).pool.connection() as conn:
        return await instances.resolve(conn, who.org_id, instance_id)


# An instance path segment: its id or its name, resolved to the id.
InstanceRef = Annotated[uuid.UUID, Depends(resolve_instance)]


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


async def accepted(
    conn: AsyncConn, made: instances.InstanceResult, box: SecretBox
) -> idempotency.StoredResponse:
    """202 with the instance a creating use case made (what its Idempotency-Key stores)."""
    doc = await views.created_instance(conn, made, box)
    body = Instance.model_validate(doc).model_dump(mode="json")
    crashpoints.reached("api.create.before_commit")
    return idempotency.StoredResponse(202, body, _headers(made.instance, location=True))


@router.post(
    "",
    status_code=202,
    response_model=Instance,
    responses={
        202: {"headers": openapi.headers("Location", "ETag", "Idempotent-Replayed")},
        **errors.responses(400, 401, 403, 404, 409, 413, 422),
    },
    summary="Create an instance (provisioned in the background)",
    operation_id="createInstance",
    description=(
        "Creates the instance in `pending` and enqueues its provisioning; answers 202 at once with the "
        "instance and its Location. Follow it with GET (or the watch stream) until `ready`. An "
        "Idempotency-Key makes a retried request answer the first one's response (with "
        "Idempotent-Replayed: true) instead of creating a second instance."
    ),
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
    keyed = idempotency.Keyed(
        idempotency_key, idempotency.request_hash("POST", "/v1/instances", body.model_dump(mode="json"))
    )
    answer = await instances.once(
        state.pool,
        who.org_id,
        keyed,
        lambda conn: instances.create(conn, who.actor, who.request_id, asked, state.policy),
        lambda conn, made: accepted(conn, made, state.box),
    )
    crashpoints.reached("api.create.after_commit")
    return views.answered(answer)


@router.get(
    "",
    response_model=InstancePage,
    responses=errors.responses(401, 403, 422),
    summary="List the organisation's instances (oldest first, cursor paginated)",
    operation_id="listInstances",
    description=(
        "The organisation's instances, oldest first, a page at a time: pass `next_cursor` back as "
        "`cursor` for the next page. `live=true` leaves out failed and deleted instances; `name` finds "
        "the instances of one name."
    ),
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
    live: Annotated[bool, Query(description="only instances that are neither failed nor deleted")] = False,
    limit: Annotated[int, Query(ge=1, description=f"page size; values above {MAX_LIMIT} are capped")] = (
        DEFAULT_LIMIT
    ),
    cursor: str | None = None,
) -> dict[str, Any]:
    app = app_state(request)
    asked = instances.ListInstances(who.org_id, state, name, archived=include == "archived", live=live)
    async with app.pool.connection() as conn:
        page, next_cursor = await instances.list_page(conn, asked, limit=min(limit, MAX_LIMIT), cursor=cursor)
        items = await views.instances(conn, page, app.box)
    return {"items": items, "next_cursor": next_cursor}


@router.get(
    "/{instance_id}",
    response_model=Instance,
    responses={
        200: {"headers": openapi.headers("ETag", "Cache-Control")},
        304: {"description": "Not modified: the instance is still at the ETag If-None-Match names"},
        **errors.responses(401, 403, 404, 422),
    },
    summary="Get an instance, with its connection details once it has been ready",
    operation_id="getInstance",
    description=(
        "One instance by id or name, with its state metadata, progress, typed failure and, once it has "
        "been ready, its connection details (password included). The ETag is its version for If-Match."
    ),
)
async def get_instance(
    instance_id: InstanceRef,
    request: Request,
    who: Caller,
    if_none_match: Annotated[str | None, Header()] = None,
) -> Response:
    app = app_state(request)
    async with app.pool.connection() as conn:
        inst = await instances.load(conn, who.org_id, instance_id)
        if views.none_match(if_none_match, inst):
            return Response(status_code=304, headers=_headers(inst) | NO_STORE)
        doc = await views.one_instance(conn, inst, app.box, reveal=True)
    return _json(inst, doc, 200)


@router.patch(
    "/{instance_id}",
    status_code=202,
    response_model=Instance,
    responses={
        202: {"headers": openapi.headers("ETag")},
        **errors.responses(400, 401, 403, 404, 409, 412, 413, 422),
    },
    summary="Change an instance's plan or deletion protection",
    operation_id="updateInstance",
    description=(
        "A new plan is a new spec generation, carried out by an update job now if the instance is ready "
        "(else once it is); deletion protection changes at once. If-Match with the ETag refuses the "
        "change (412) if the instance changed since it was read."
    ),
)
async def update_instance(
    instance_id: InstanceRef,
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

    async def once(conn: AsyncConn) -> tuple[InstanceRecord, dict[str, Any]]:
        changed = await instances.change(conn, who.actor, who.request_id, asked, app.policy)
        return changed.instance, await views.one_instance(conn, changed.instance, app.box)

    return _json(*await db.in_transaction(app.pool, once), 202)


@router.delete(
    "/{instance_id}",
    status_code=202,
    response_model=Instance,
    responses={
        202: {"headers": openapi.headers("ETag")},
        **errors.responses(401, 403, 404, 409, 412, 422),
    },
    summary="Delete an instance (now if it can start deprovisioning, else as soon as it can)",
    operation_id="deleteInstance",
    description=(
        "Requests deletion: it starts now when the instance can start deprovisioning, else as soon as it "
        "can. A final backup is taken first unless `skip_final_backup`. Refused (409) while deletion "
        "protection is on. A failed instance is archived and what it left is removed."
    ),
)
async def delete_instance(
    instance_id: InstanceRef,
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

    async def once(conn: AsyncConn) -> tuple[InstanceRecord, dict[str, Any]]:
        requested = await instances.request_deletion(conn, who.actor, who.request_id, asked, app.policy)
        return requested.instance, await views.one_instance(conn, requested.instance, app.box)

    return _json(*await db.in_transaction(app.pool, once), 202)


@router.post(
    "/{instance_id}/retry",
    status_code=202,
    response_model=Instance,
    responses={
        202: {"headers": openapi.headers("Location", "ETag", "Idempotent-Replayed")},
        **errors.responses(400, 401, 403, 404, 409, 422),
    },
    summary="Retry a failed instance: a new one from its spec and name, linked both ways",
    operation_id="retryInstance",
    description=(
        "Creates a new instance from a failed one's name, plan and deletion protection; the failed one "
        "stays as it is, linked to the new one (`replaced_by`). Refused when the failure's reason says a "
        "retry cannot help."
    ),
)
async def retry_instance(
    instance_id: InstanceRef,
    request: Request,
    who: Caller,
    idempotency_key: Annotated[str | None, Header(max_length=idempotency.MAX_KEY_LENGTH)] = None,
) -> JSONResponse:
    state = app_state(request)
    asked = instances.RetryInstance(who.org_id, instance_id)
    keyed = idempotency.Keyed(
        idempotency_key, idempotency.request_hash("POST", f"/v1/instances/{instance_id}/retry", {})
    )
    answer = await instances.once(
        state.pool,
        who.org_id,
        keyed,
        lambda conn: instances.retry(conn, who.actor, who.request_id, asked, state.policy),
        lambda conn, made: accepted(conn, made, state.box),
    )
    return views.answered(answer)


@router.get(
    "/{instance_id}/events",
    response_model=InstanceEventPage,
    responses=errors.responses(401, 403, 404, 422),
    summary="The instance's audit log, oldest first",
    operation_id="listInstanceEvents",
    description=(
        "Every state change of the instance, oldest first, with who caused it and why, a page at a time."
    ),
)
async def instance_events(
    instance_id: InstanceRef,
    request: Request,
    who: Caller,
    cursor: str | None = None,
    limit: Annotated[int, Query(ge=1)] = DEFAULT_LIMIT,
) -> dict[str, Any]:
    app = app_state(request)
    async with app.pool.connection() as conn:
        rows, next_cursor = await instances.events_page(
            conn, who.org_id, instance_id, limit=min(limit, MAX_LIMIT), cursor=cursor
        )
    return {"items": [views.event(r) for r in rows], "next_cursor": next_cursor}


@router.get(
    "/{instance_id}/watch",
    responses={
        200: {
            "description": "Server-Sent Events: `instance` (snapshot), then one `transition` per change"
            " and one `step` per step of the running operation; each transition's id is the state_version"
            " (reconnect with Last-Event-ID to resume)",
            "content": {
                "text/event-stream": {
                    "schema": {
                        "type": "object",
                        "description": "One event of the stream; `data` is JSON: the instance for "
                        "`instance`, {id, state, state_version} for `transition`, the step for `step`",
                        "properties": {
                            "event": {"type": "string", "enum": ["instance", "transition", "step"]},
                            "data": {"type": "string", "description": "the event's JSON"},
                            "id": {"type": "string", "description": "the state_version it follows"},
                            "retry": {"type": "integer", "description": "ms before reconnecting"},
                        },
                    }
                }
            },
        },
        **errors.responses(401, 403, 404, 422),
    },
    response_class=StreamingResponse,
    summary="Follow the instance's state changes as Server-Sent Events",
    operation_id="watchInstance",
    description=(
        "A Server-Sent Events stream: an `instance` snapshot first, then one `transition` event per state"
        " change and one `step` event per step of the running operation; it ends after a terminal state."
    ),
)
async def watch_instance(
    instance_id: InstanceRef,
    request: Request,
    who: Caller,
    last_event_id: Annotated[
        str | None, Header(description="the last event id a client saw: resume after it")
    ] = None,
) -> StreamingResponse:
    return await watch.response(request, who.org_id, instance_id, last_event_id)
