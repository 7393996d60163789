"""Routes for the backups of an instance and the restore of one whose data is lost: customers'
(scoped to their organisation) and SREs' (admin key). Thin: the use cases are controlplane.backups."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse
from psycopg.rows import DictRow

from controlplane import backups, sql
from controlplane.api import errors, views
from controlplane.api.auth import AdminKey, Customer, customer
from controlplane.api.errors import ProblemError
from controlplane.api.models import (
    AdminBackupPage,
    BackupPage,
    BackupRequested,
    Instance,
    RestoreEmpty,
    RestoreRequest,
)
from controlplane.api.state import app_state, provisioner_of
from controlplane.db import AsyncConn
from controlplane.transitions import Actor

router = APIRouter(tags=["backups"])

DEFAULT_LIMIT = 50
MAX_LIMIT = 100
Caller = Annotated[Customer, Depends(customer)]


@dataclass(frozen=True)
class Paging:
    """The query parameters of a page: where it starts, and how long it is."""

    cursor: str | None = None
    limit: Annotated[int, Query(ge=1, description=f"page size; values above {MAX_LIMIT} are capped")] = (
        DEFAULT_LIMIT
    )


Page = Annotated[Paging, Depends()]


async def _instance(
    conn: AsyncConn, instance_id: uuid.UUID, org_id: uuid.UUID | None, *, lock: bool = False
) -> DictRow:
    """The instance (the caller's organisation's, unless an SRE asks), or 404."""
    query = sql.INSTANCE_IN_SCOPE + (" FOR UPDATE OF i" if lock else "")
    row = await (await conn.execute(query, {"id": instance_id, "org": org_id})).fetchone()
    if row is None:
        raise ProblemError("not-found", f"no instance {instance_id}")
    return row


async def _page(
    request: Request, instance_id: uuid.UUID, org_id: uuid.UUID | None, paging: Paging, *, sre: bool = False
) -> dict[str, Any]:
    before = None
    if paging.cursor:
        taken_s, backup_id = views.decode_cursor(paging.cursor, 2)
        try:
            before = (datetime.fromisoformat(taken_s), backup_id)
        except ValueError:
            raise views.bad_cursor() from None
    limit = min(paging.limit, MAX_LIMIT)
    async with app_state(request).pool.connection() as conn:
        await _instance(conn, instance_id, org_id)
        rows = await backups.held(conn, instance_id, limit=limit + 1, before=before)
    page, next_cursor = views.page_of(
        rows, limit, lambda last: views.encode_cursor(last["taken_at"].isoformat(), last["backup_id"])
    )
    return {"items": [_backup(row, sre=sre) for row in page], "next_cursor": next_cursor}


def _backup(row: DictRow, *, sre: bool = False) -> dict[str, Any]:
    shown = {
        "id": row["backup_id"],
        "kind": row["kind"],
        "taken_at": row["taken_at"],
        "size_bytes": row["size_bytes"],
    }
    if sre:
        shown |= {"location": row["location"], "recorded_at": row["recorded_at"]}
    return shown


async def _restore(
    request: Request,
    instance_id: uuid.UUID,
    org_id: uuid.UUID | None,
    body: RestoreRequest,
    actor: Actor,
    request_id: str | None,
) -> JSONResponse:
    app = app_state(request)
    if isinstance(body, RestoreEmpty):
        choice = backups.RestoreChoice(empty=True, reason=body.reason)
    else:
        choice = backups.RestoreChoice(backup_id=body.backup_id, reason=body.reason)
    async with app.pool.connection() as conn, conn.transaction():
        row = await _instance(conn, instance_id, org_id, lock=True)
        try:
            await backups.request_restore(
                conn,
                row,
                choice,
                actor,
                max_attempts=app.settings.job_max_attempts,
                request_id=request_id,
            )
        except backups.Refused as exc:
            raise ProblemError(
                "invalid-state", str(exc), current_state=exc.state, allowed_actions=views.row_actions(row)
            ) from None
        except backups.UnknownBackup as exc:
            if choice.backup_id is None:
                raise ProblemError(
                    "invalid-state",
                    str(exc),
                    current_state=row["state"],
                    allowed_actions=views.row_actions(row),
                ) from None
            errors_ = [{"field": "body.backup_id", "message": str(exc)}]
            raise ProblemError("validation", str(exc), errors=errors_) from None
    body_json = Instance.model_validate(views.instance(row, app.box)).model_dump(mode="json")
    return JSONResponse(body_json, status_code=202, headers={"Location": f"/v1/instances/{instance_id}"})


@router.get(
    "/v1/instances/{instance_id}/backups",
    response_model=BackupPage,
    responses=errors.responses(401, 403, 404, 422),
    summary="The backups held of an instance, newest first (cursor paginated)",
)
async def list_backups(instance_id: uuid.UUID, request: Request, who: Caller, paging: Page) -> dict[str, Any]:
    return await _page(request, instance_id, who.org_id, paging)


@router.post(
    "/v1/instances/{instance_id}/backups",
    status_code=202,
    response_model=BackupRequested,
    responses=errors.responses(401, 403, 404, 409, 422),
    summary="Take a backup now (in the background), beside the plan's schedule",
)
async def take_backup(instance_id: uuid.UUID, request: Request, who: Caller) -> dict[str, Any]:
    app = app_state(request)
    if not provisioner_of(app).supports_backups:
        raise ProblemError("conflict", f"the {provisioner_of(app).name} provisioner takes no backups")
    async with app.pool.connection() as conn, conn.transaction():
        row = await _instance(conn, instance_id, who.org_id, lock=True)
        try:
            enqueued = await backups.request_backup(
                conn, row, who.actor, max_attempts=app.settings.job_max_attempts, request_id=who.request_id
            )
        except backups.Refused as exc:
            raise ProblemError(
                "invalid-state", str(exc), current_state=exc.state, allowed_actions=views.row_actions(row)
            ) from None
    return {"instance_id": instance_id, "job_id": enqueued.job["id"], "created": enqueued.created}


@router.post(
    "/v1/instances/{instance_id}/restore",
    status_code=202,
    response_model=Instance,
    responses=errors.responses(400, 401, 403, 404, 409, 413, 422),
    summary="Bring back an instance whose data is lost: from a backup (the newest by default), or empty",
)
async def restore(
    instance_id: uuid.UUID, body: RestoreRequest, request: Request, who: Caller
) -> JSONResponse:
    return await _restore(request, instance_id, who.org_id, body, who.actor, who.request_id)


@router.get(
    "/v1/admin/instances/{instance_id}/backups",
    response_model=AdminBackupPage,
    responses=errors.responses(401, 403, 404, 422),
    tags=["sre"],
    summary="The backups held of any instance, newest first, with where they are kept",
)
async def admin_list_backups(
    instance_id: uuid.UUID, request: Request, _: AdminKey, paging: Page
) -> dict[str, Any]:
    return await _page(request, instance_id, None, paging, sre=True)


@router.post(
    "/v1/admin/instances/{instance_id}/restore",
    status_code=202,
    response_model=Instance,
    responses=errors.responses(400, 401, 403, 404, 409, 413, 422),
    tags=["sre"],
    summary="An SRE's decision for an instance whose data is lost: a restore point, or empty",
)
async def admin_restore(
    instance_id: uuid.UUID, body: RestoreRequest, request: Request, who: AdminKey
) -> JSONResponse:
    return await _restore(request, instance_id, None, body, who.actor, who.request_id)
