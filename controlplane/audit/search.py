"""Searching the instances' audit log across organisations (the SRE view of the API and the CLI)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from psycopg.rows import DictRow

from controlplane.db import sql
from controlplane.db.connection import AsyncConn


@dataclass(frozen=True)
class EventFilter:
    instance: uuid.UUID | None = None
    org: uuid.UUID | None = None
    # An actor kind (`stripe`) or kind:id (`customer:<key id>`).
    actor: str | None = None
    event: str | None = None
    to_state: str | None = None
    since: datetime | None = None
    until: datetime | None = None


async def search(conn: AsyncConn, where: EventFilter, *, after: int = 0, limit: int = 100) -> list[DictRow]:
    """Events matching `where` with ids above `after`, oldest first, at most `limit`."""
    actor_kind, _sep, actor_id = (where.actor or "").partition(":")
    cursor = await conn.execute(
        sql.SEARCH_INSTANCE_EVENTS,
        {
            "after": after,
            "instance": where.instance,
            "org": where.org,
            "actor_kind": actor_kind,
            "actor_id": actor_id,
            "event": where.event,
            "to_state": where.to_state,
            "since": where.since,
            "until": where.until,
            "limit": limit,
        },
    )
    return await cursor.fetchall()
