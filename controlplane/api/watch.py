"""Server-Sent Events of one instance's transitions and steps, from LISTEN on the cp_instance_<state>
channels and the step channel."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
from psycopg.conninfo import make_conninfo
from starlette.requests import Request

from controlplane import db, failures, lifecycle, sql, steps
from controlplane.api import views
from controlplane.api.state import AppState
from controlplane.db import AsyncConn
from controlplane.kinds import STEP_LABELS
from controlplane.records import Instance, StepRecord

KEEPALIVE_S = 15.0
# How a watch's dedicated connection shows in pg_stat_activity.
APPLICATION_NAME = "controlplane-watch"


def sse(event: str, data: Any, event_id: int | None = None) -> bytes:
    lines = [f"event: {event}"]
    if event_id is not None:
        lines.append(f"id: {event_id}")
    lines.append("data: " + json.dumps(data, default=str, separators=(",", ":")))
    return ("\n".join(lines) + "\n\n").encode()


def parse_notification(channel: str, payload: str) -> tuple[str, str, int] | None:
    """(instance id, state, state_version) of a transition notification, or None if malformed."""
    instance_id, _, version = payload.partition(":")
    if not channel.startswith(sql.INSTANCE_CHANNEL_PREFIX) or not version.isdigit():
        return None
    return instance_id, channel.removeprefix(sql.INSTANCE_CHANNEL_PREFIX), int(version)


def parse_step_notification(channel: str, payload: str) -> tuple[str, int] | None:
    """(instance id, step record id) of a step notification, or None if it is not one."""
    instance_id, _, step_id = payload.partition(":")
    if channel != sql.STEP_CHANNEL or not step_id.isdigit():
        return None
    return instance_id, int(step_id)


async def _snapshot(conn: AsyncConn, app: AppState, instance_id: uuid.UUID, org_id: uuid.UUID) -> Any:
    cursor = await conn.execute(sql.ORG_INSTANCE, {"id": instance_id, "org": org_id})
    row = await cursor.fetchone()
    return None if row is None else await views.one_instance(conn, Instance.from_row(row), app.box)


async def _step_event(
    app: AppState, instance_id: uuid.UUID, org_id: uuid.UUID, step_id: int
) -> dict[str, Any] | None:
    """The `step` event of one step record: what happened, and the instance's progress after it.

    Read on a pooled connection: the listening one is held by its notification loop."""
    async with app.pool.connection() as conn:
        cursor = await conn.execute(sql.STEP_BY_ID, {"id": step_id, "instance_id": instance_id})
        row = await cursor.fetchone()
        cursor = await conn.execute(sql.ORG_INSTANCE, {"id": instance_id, "org": org_id})
        found = await cursor.fetchone()
        if row is None or found is None:
            return None
        inst = Instance.from_row(found)
        # As of this step: the records after it are left out (the state may have moved on since).
        moving = await steps.progress_of(conn, [inst], through_step=step_id)
    step = StepRecord.from_row(row)
    code = step.code if step.event == "failed" else None
    return {
        "instance_id": step.instance_id,
        "job_id": step.job_id,
        "operation": step.kind,
        "step": step.step,
        "label": STEP_LABELS.get(step.step, step.step),
        "event": step.event,
        "attempt": step.attempt,
        "at": step.at,
        "duration_s": None
        if step.started_at is None
        else round((step.at - step.started_at).total_seconds(), 3),
        "failure": None if code is None else failures.reason(code).as_dict(),
        "progress": moving.get(inst.id),
    }


async def instance_stream(
    app: AppState,
    request: Request,
    instance_id: uuid.UUID,
    org_id: uuid.UUID,
    *,
    keepalive_s: float = KEEPALIVE_S,
) -> AsyncIterator[bytes]:
    """A snapshot event, then one `transition` event per state change and one `step` event per step
    record; ends after a terminal state.

    LISTEN starts before the snapshot is read, so no transition falls between the two; a
    notification at or below the snapshot's state_version is skipped. A step event carries the
    progress as of its reading (a reconnecting client gets it in the snapshot).
    """
    conn = await db.connect(make_conninfo(app.database_url, application_name=APPLICATION_NAME))
    try:
        await conn.execute(sql.LISTEN_INSTANCE_CHANNELS + "; " + sql.LISTEN_STEP_CHANNEL)
        snapshot = await _snapshot(conn, app, instance_id, org_id)
        if snapshot is None:
            return
        last = int(snapshot["state_version"])
        yield sse("instance", snapshot, last)
        if snapshot["state"] in lifecycle.INSTANCE.terminal:
            return
        target = str(instance_id)
        while True:
            async for notification in conn.notifies(timeout=keepalive_s):
                stepped = parse_step_notification(notification.channel, notification.payload)
                if stepped is not None:
                    if stepped[0] == target:
                        event = await _step_event(app, instance_id, org_id, stepped[1])
                        if event is not None:
                            yield sse("step", event)
                    continue
                parsed = parse_notification(notification.channel, notification.payload)
                if parsed is None or parsed[0] != target or parsed[2] <= last:
                    continue
                _, state, last = parsed
                yield sse("transition", {"id": target, "state": state, "state_version": last}, last)
                if state in lifecycle.INSTANCE.terminal:
                    return
            if await request.is_disconnected():
                return
            yield b": keepalive\n\n"
    finally:
        with anyio.CancelScope(shield=True):
            await conn.close()
