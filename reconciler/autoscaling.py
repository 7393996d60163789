"""Storage autoscaling's effects, decided by `planning.plan_storage`: a larger allocation recorded
as a new spec generation with the update job that applies it (`ready → updating → ready`, a fenced
`apply_plan`, the reason in the audit row of its `update` move), or the warning that a database is
nearly full at its plan's maximum; the customer is notified of either."""

from __future__ import annotations

from typing import Any

from controlplane.core import kinds
from controlplane.core.records import ScannedInstance
from controlplane.db import job_rows as jobs
from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.db.transitions import Actor
from controlplane.runtime.settings import Settings
from controlplane.services import notices
from reconciler import planning

GROWN = "instance.storage_grown"
FULL = "instance.storage_full"


async def apply(
    conn: AsyncConn,
    inst: ScannedInstance,
    action: planning.GrowStorage | planning.WarnStorageFull,
    actor: Actor,
    settings: Settings,
) -> bool:
    """Carry the decision out in the reconciler's transaction; False when the instance changed
    since the scan (nothing done: the next pass decides again)."""
    params = {"id": inst.id, "state_version": inst.state_version, "now": inst.now}
    if isinstance(action, planning.GrowStorage):
        cursor = await conn.execute(sql.SET_STORAGE_GROWN, {**params, "storage_gb": action.to_gb})
        row = await cursor.fetchone()
        if row is None:
            return False  # it changed since the scan: the next pass decides again
        generation = int(row["spec_generation"])
        payload = kinds.UpdatePayload(action.reason, spec_generation=generation)
        job = jobs.NewJob(
            kinds.UPDATE, inst.id, payload=payload, max_attempts=settings.worker.job_max_attempts
        )
        await jobs.enqueue(conn, job, actor)
        await _notify(conn, inst, GROWN, f"{generation}", action.reason, storage_gb=action.to_gb)
    else:
        cursor = await conn.execute(sql.WARN_STORAGE_FULL, params)
        if cursor.rowcount == 0:
            return False
        await _notify(conn, inst, FULL, f"{int(inst.now.timestamp())}", action.reason)
    return True


async def _notify(
    conn: AsyncConn, inst: ScannedInstance, notice: str, key: str, message: str, **data: Any
) -> None:
    cursor = await conn.execute(sql.INSTANCE_FOR_NOTICE, {"id": inst.id})
    row = await cursor.fetchone()
    if row is None or inst.org_id is None:
        return
    body = {
        "id": f"evt_{notice.split('.')[1]}_{inst.id}_{key}",
        "type": notice,
        "created": int(inst.now.timestamp()),
        "organisation_id": str(inst.org_id),
        "data": {
            "instance": {"id": str(inst.id), "name": row["name"], "plan": row["plan"], "state": row["state"]},
            "message": message,
            **data,
        },
    }
    await notices.queue_notice(conn, inst.org_id, inst.id, notice, body)
