"""Server-Sent Events of one instance's transitions, from LISTEN on the cp_instance_<state> channels."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
from psycopg.conninfo import make_conninfo
from starlette.requests import Request

from controlplane import db, lifecycle, sql
from controlplane.api import views
from controlplane.api.state import AppState
from controlplane.db import AsyncConn
from controlplane.records import Instance

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


async def _snapshot(conn: AsyncConn, app: AppState, instance_id: uuid.UUID, org_id: uuid.UUID) -> Any:
    cursor = await conn.execute(sql.ORG_INSTANCE, {"id": instance_id, "org": org_id})
    row = await cursor.fetchone()
    return None if row is None else views.instance(Instance.from_row(row), app.box)


async def instance_stream(
    app: AppState,
    request: Request,
    instance_id: uuid.UUID,
    org_id: uuid.UUID,
    *,
    keepalive_s: float = KEEPALIVE_S,
) -> AsyncIterator[bytes]:
    """A snapshot event, then one `transition` event per state change; ends after a terminal state.

    LISTEN starts before the snapshot is read, so no transition falls between the two; a
    notification at or below the snapshot's state_version is skipped.
    """
    conn = await db.connect(make_conninfo(app.database_url, application_name=APPLICATION_NAME))
    try:
        await conn.execute(sql.LISTEN_INSTANCE_CHANNELS)
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
