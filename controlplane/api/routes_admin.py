"""SRE routes (admin key): the audit log of all instances, jobs and operator actions, dwell times."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request

from controlplane.api import errors, views
from controlplane.api.auth import Admin, admin
from controlplane.api.models import AdminEventPage, InstanceState
from controlplane.api.state import app_state

router = APIRouter(prefix="/v1/admin", tags=["sre"])

AdminKey = Annotated[Admin, Depends(admin)]
MAX_LIMIT = 500
DEFAULT_LIMIT = 100


@router.get(
    "/events",
    response_model=AdminEventPage,
    responses=errors.responses(401, 403, 422),
    summary="The audit log of every instance, oldest first, filtered",
)
async def admin_events(
    request: Request,
    _: AdminKey,
    instance: uuid.UUID | None = None,
    org: uuid.UUID | None = None,
    actor: Annotated[
        str | None,
        Query(max_length=300, description="actor kind (`stripe`) or kind:id (`customer:<key id>`)"),
    ] = None,
    event: Annotated[str | None, Query(max_length=100)] = None,
    to_state: InstanceState | None = None,
    since: Annotated[datetime | None, Query(description="events at or after this time")] = None,
    until: Annotated[datetime | None, Query(description="events before this time")] = None,
    cursor: str | None = None,
    limit: Annotated[int, Query(ge=1, description=f"page size; values above {MAX_LIMIT} are capped")] = (
        DEFAULT_LIMIT
    ),
) -> dict[str, Any]:
    limit = min(limit, MAX_LIMIT)
    after = 0
    if cursor:
        (after_s,) = views.decode_cursor(cursor, 1)
        if not after_s.isdigit():
            raise views.bad_cursor()
        after = int(after_s)
    actor_kind, _sep, actor_id = (actor or "").partition(":")
    async with app_state(request).pool.connection() as conn:
        cursor_ = await conn.execute(
            """
            SELECT e.*, i.org_id FROM instance_events e JOIN instances i ON i.id = e.instance_id
            WHERE e.id > %(after)s
              AND (%(instance)s::uuid IS NULL OR e.instance_id = %(instance)s::uuid)
              AND (%(org)s::uuid IS NULL OR i.org_id = %(org)s::uuid)
              AND (%(actor_kind)s::text = '' OR e.actor_kind = %(actor_kind)s::text)
              AND (%(actor_id)s::text = '' OR e.actor_id = %(actor_id)s::text)
              AND (%(event)s::text IS NULL OR e.event = %(event)s::text)
              AND (%(to_state)s::text IS NULL OR e.to_state = %(to_state)s::text)
              AND (%(since)s::timestamptz IS NULL OR e.at >= %(since)s::timestamptz)
              AND (%(until)s::timestamptz IS NULL OR e.at < %(until)s::timestamptz)
            ORDER BY e.id
            LIMIT %(limit)s
            """,
            {
                "after": after,
                "instance": instance,
                "org": org,
                "actor_kind": actor_kind,
                "actor_id": actor_id,
                "event": event,
                "to_state": to_state,
                "since": since,
                "until": until,
                "limit": limit + 1,
            },
        )
        rows = await cursor_.fetchall()
    page, more = rows[:limit], len(rows) > limit
    items = [
        {
            **views.event(r),
            "instance_id": r["instance_id"],
            "org_id": r["org_id"],
            "state_version": r["state_version"],
            "request_id": r["request_id"],
        }
        for r in page
    ]
    return {"items": items, "next_cursor": views.encode_cursor(page[-1]["id"]) if more else None}
