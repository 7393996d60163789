"""Routes for the backups of an instance and the restore of one whose data is lost: customers'
(scoped to their organisation) and SREs' (admin key). Thin: the use cases are
controlplane.services.backups; their refusals are rendered by controlplane.api.problems."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from controlplane.api import problems as errors
from controlplane.api import views
from controlplane.api.auth import AdminKey, Customer, customer
from controlplane.api.models import (
    AdminBackupPage,
    AdminRecoverableWindow,
    BackupPage,
    BackupRequested,
    Instance,
    RecoverableWindow,
    RestoreEmpty,
    RestoreRequest,
)
from controlplane.api.routes.instances import InstanceRef
from controlplane.api.state import app_state
from controlplane.core import cursors
from controlplane.core.records import Backup as BackupRecord
from controlplane.db import connection as db
from controlplane.db.transitions import Actor
from controlplane.services import backups

router = APIRouter(tags=["backups"])

Caller = Annotated[Customer, Depends(customer)]
Page = views.Page


async def _page(
    request: Request,
    instance_id: uuid.UUID,
    org_id: uuid.UUID | None,
    paging: views.Paging,
    *,
    sre: bool = False,
) -> dict[str, Any]:
    before = None
    if paging.cursor:
        taken_s, backup_id = cursors.decode_cursor(paging.cursor, 2)
        try:
            before = (datetime.fromisoformat(taken_s), backup_id)
        except ValueError:
            raise cursors.bad_cursor() from None
    limit = paging.size
    asked = backups.ListBackups(instance_id, org_id, limit=limit + 1, before=before)
    async with app_state(request).pool.connection() as conn:
        rows = await backups.list_backups(conn, asked)
    page, next_cursor = cursors.page_of(
        rows, limit, lambda last: cursors.encode_cursor(last.taken_at.isoformat(), last.backup_id)
    )
    return {"items": [_backup(backup, sre=sre) for backup in page], "next_cursor": next_cursor}


def _backup(backup: BackupRecord, *, sre: bool = False) -> dict[str, Any]:
    shown: dict[str, Any] = {
        "id": backup.backup_id,
        "kind": backup.kind,
        "type": backup.type,
        "taken_at": backup.taken_at,
        "size_bytes": backup.size_bytes,
    }
    if sre:
        shown |= {"location": backup.location, "recorded_at": backup.recorded_at}
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
        asked = backups.RequestRestore(instance_id, org_id, empty=True, reason=body.reason)
    else:
        asked = backups.RequestRestore(instance_id, org_id, backup_id=body.backup_id, reason=body.reason)
    inst = await db.in_transaction(
        app.pool, lambda conn: backups.request_restore(conn, actor, request_id, asked, app.policy)
    )
    body_json = Instance.model_validate(views.instance(inst, app.box)).model_dump(mode="json")
    return JSONResponse(body_json, status_code=202, headers={"Location": f"/v1/instances/{instance_id}"})


@router.get(
    "/v1/instances/{instance_id}/backups",
    response_model=BackupPage,
    responses=errors.responses(401, 403, 404, 422),
    summary="The backups held of an instance, newest first (cursor paginated)",
    operation_id="listBackups",
    description=(
        "The backups held of the instance (scheduled, on demand and final), newest first, a page at a time."
    ),
)
async def list_backups(
    instance_id: InstanceRef, request: Request, who: Caller, paging: Page
) -> dict[str, Any]:
    return await _page(request, instance_id, who.org_id, paging)


async def _recovery(
    request: Request, instance_id: uuid.UUID, org_id: uuid.UUID | None, *, sre: bool = False
) -> dict[str, Any]:
    async with app_state(request).pool.connection() as conn:
        found = await backups.recovery(conn, backups.ShowRecovery(instance_id, org_id))
    return views.recovery(found, [_backup(b, sre=sre) for b in found.backups], sre=sre)


@router.get(
    "/v1/instances/{instance_id}/recovery",
    response_model=RecoverableWindow,
    responses=errors.responses(401, 403, 404, 422),
    summary="The moments an instance can be restored to, its archive's health and its backups",
    operation_id="getRecoverableWindow",
    description=(
        "The earliest and latest moment a point-in-time restore of the instance can reach (into a new "
        "instance: `POST /v1/instances` with `restore_from`), the health and lag of its continuous "
        "archive, and its backups, newest first. A deleted instance's stays until `retained_until`."
    ),
)
async def recovery(instance_id: InstanceRef, request: Request, who: Caller) -> dict[str, Any]:
    return await _recovery(request, instance_id, who.org_id)


@router.get(
    "/v1/admin/instances/{instance_id}/recovery",
    response_model=AdminRecoverableWindow,
    responses=errors.responses(401, 403, 404, 422),
    tags=["sre"],
    summary="Any instance's recoverable window, with what fails and where its backups are kept",
    operation_id="adminGetRecoverableWindow",
    description="Any instance's recoverable window, with the archive's error and the backups' locations.",
)
async def admin_recovery(instance_id: uuid.UUID, request: Request, _: AdminKey) -> dict[str, Any]:
    return await _recovery(request, instance_id, None, sre=True)


@router.post(
    "/v1/instances/{instance_id}/backups",
    status_code=202,
    response_model=BackupRequested,
    responses=errors.responses(401, 403, 404, 409, 422),
    summary="Take a backup now (in the background), beside the plan's schedule",
    operation_id="takeBackup",
    description=(
        "Enqueues a backup now, beside the plan's schedule; a backup already under way is answered "
        "instead of a second one (`created: false`)."
    ),
)
async def take_backup(instance_id: InstanceRef, request: Request, who: Caller) -> dict[str, Any]:
    app = app_state(request)
    asked = backups.RequestBackup(instance_id, who.org_id)
    requested = await db.in_transaction(
        app.pool, lambda conn: backups.request_backup(conn, who.actor, who.request_id, asked, app.policy)
    )
    return {"instance_id": requested.instance_id, "job_id": requested.job_id, "created": requested.created}


@router.post(
    "/v1/instances/{instance_id}/restore",
    status_code=202,
    response_model=Instance,
    responses=errors.responses(400, 401, 403, 404, 409, 413, 422),
    summary="Bring back an instance whose data is lost: from a backup (the newest by default), or empty",
    operation_id="restoreInstance",
    description=(
        "For an instance whose data is lost: restore it from a backup (the newest by default) or, "
        "accepting the loss, re-create it empty."
    ),
)
async def restore(
    instance_id: InstanceRef, body: RestoreRequest, request: Request, who: Caller
) -> JSONResponse:
    return await _restore(request, instance_id, who.org_id, body, who.actor, who.request_id)


@router.get(
    "/v1/admin/instances/{instance_id}/backups",
    response_model=AdminBackupPage,
    responses=errors.responses(401, 403, 404, 422),
    tags=["sre"],
    summary="The backups held of any instance, newest first, with where they are kept",
    operation_id="adminListBackups",
    description="Any instance's backups, newest first, with where each is kept (SREs only).",
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
    operation_id="adminRestoreInstance",
    description="An SRE's decision for an instance whose data is lost: a restore point, or empty.",
)
async def admin_restore(
    instance_id: uuid.UUID, body: RestoreRequest, request: Request, who: AdminKey
) -> JSONResponse:
    return await _restore(request, instance_id, None, body, who.actor, who.request_id)
