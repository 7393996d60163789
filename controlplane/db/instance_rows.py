"""Instance records: creation in the initial state with its audit row, moves of a row as read, look-ups."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

from psycopg.rows import DictRow

from controlplane.core.records import Instance, InstancePatch
from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.db.job_rows import NewJob
from controlplane.db.transitions import Actor, transition


async def create_instance(
    conn: AsyncConn,
    org_id: uuid.UUID,
    name: str,
    spec: Mapping[str, Any],
    actor: Actor,
    *,
    deadline_s: float,
    deletion_protection: bool = False,
    request_id: str | None = None,
    replaces: uuid.UUID | None = None,
    first_job: NewJob | None = None,
) -> DictRow:
    """Insert an instance in `pending` with its creation event (and `first_job`, for it, with its
    own: one statement), in the caller's transaction or as one of its own (`replaces`: the failed
    instance it retries)."""
    params: dict[str, Any] = {
        "org_id": org_id,
        "name": name,
        "spec": json.dumps(dict(spec)),
        "deletion_protection": deletion_protection,
        "deadline_s": deadline_s,
        "replaces": replaces,
        "actor_kind": actor.kind,
        "actor_id": actor.id,
        "request_id": request_id,
    }
    if first_job is None:
        cursor = await conn.execute(sql.CREATE_INSTANCE, params, prepare=True)
    else:
        params.update(
            job_kind=first_job.kind,
            job_payload=first_job.payload_json(),
            job_priority=first_job.priority,
            job_max_attempts=first_job.max_attempts,
        )
        cursor = await conn.execute(sql.CREATE_INSTANCE_WITH_JOB, params, prepare=True)
    row = await cursor.fetchone()
    assert row is not None
    return row


async def get_instance(conn: AsyncConn, instance_id: uuid.UUID) -> DictRow | None:
    cursor = await conn.execute(sql.INSTANCE_BY_ID, {"id": instance_id})
    return await cursor.fetchone()


async def transition_instance(
    conn: AsyncConn,
    inst: Instance,
    event: str,
    actor: Actor,
    *,
    reason: str | None = None,
    detail: Mapping[str, Any] | None = None,
    patch: InstancePatch | None = None,
) -> Instance:
    """`event` on the instance as it was read: guarded by the state and version read."""
    row = await transition(
        conn,
        "instance",
        inst.id,
        event,
        inst.state_version,
        expected_state=inst.state,
        actor=actor,
        reason=reason,
        detail=detail,
        patch=patch,
    )
    return Instance.from_row(row)
