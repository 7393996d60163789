"""Rows for tests, made through the product's own creation paths."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from psycopg.rows import DictRow

from controlplane.db.connection import AsyncConn
from controlplane.db.instance_rows import create_instance
from controlplane.db.transitions import Actor, transition

TEST_ACTOR = Actor("system", "tests")
GONE_WORKER = Actor("worker", "gone-worker")


async def make_org(
    conn: AsyncConn, name: str | None = None, stripe_customer_id: str | None = None
) -> uuid.UUID:
    cursor = await conn.execute(
        "INSERT INTO organisations (name, stripe_customer_id) VALUES (%s, %s) RETURNING id",
        (name or f"org-{uuid.uuid4().hex[:8]}", stripe_customer_id),
    )
    row = await cursor.fetchone()
    assert row is not None
    org_id: uuid.UUID = row["id"]
    return org_id


async def make_instance(conn: AsyncConn, org_id: uuid.UUID | None = None, **spec: Any) -> DictRow:
    org = org_id or await make_org(conn)
    return await create_instance(
        conn,
        org,
        f"db-{uuid.uuid4().hex[:8]}",
        {"plan": "dev", "region": "local", **spec},
        TEST_ACTOR,
        deadline_s=300,
    )


async def walk(
    conn: AsyncConn,
    instance_id: uuid.UUID,
    *events: str,
    actor: Actor = GONE_WORKER,
    patch: Mapping[str, Any] | None = None,
) -> DictRow:
    """Move an instance through `events` on the transition path (the last one with `patch`)."""
    cursor = await conn.execute("SELECT * FROM instances WHERE id = %s", (instance_id,))
    row = await cursor.fetchone()
    assert row is not None
    for i, event in enumerate(events):
        row = await transition(
            conn,
            "instance",
            instance_id,
            event,
            row["state_version"],
            expected_state=row["state"],
            actor=actor,
            patch=patch if i == len(events) - 1 else None,
        )
    return row


# An event row written behind the transition path but on the entity's chain (its hash, its link,
# the row's head moved), so that a test of the replay check sees only what it planted.
APPEND_EVENT = """
WITH head AS (
    SELECT id, COALESCE(chain_seq, -1) + 1 AS seq, chain_head AS prev,
           COALESCE(%(at)s::timestamptz, now() - make_interval(secs => %(age_s)s::float8)) AS at
    FROM {table} WHERE id = %(id)s FOR UPDATE
), ev AS (
    SELECT head.*, cp_event_hash('{entity}', id, seq, prev, %(from_state)s, %(to_state)s, %(event)s,
                                 %(actor_kind)s, %(actor_id)s, %(reason)s, %(detail)s::jsonb, NULL,
                                 %(state_version)s, at) AS hash
    FROM head
), moved AS (
    UPDATE {table} t SET chain_seq = ev.seq, chain_head = ev.hash FROM ev WHERE t.id = ev.id RETURNING t.id
)
INSERT INTO {events} ({fk}, from_state, to_state, event, actor_kind, actor_id, reason, detail,
                      state_version, at, seq, prev_hash, hash)
SELECT ev.id, %(from_state)s, %(to_state)s, %(event)s, %(actor_kind)s, %(actor_id)s, %(reason)s,
       %(detail)s::jsonb, %(state_version)s, ev.at, ev.seq, ev.prev, ev.hash
FROM ev JOIN moved ON moved.id = ev.id
RETURNING id
"""
OPERATOR = Actor("operator", "someone")
EVENT_TABLES = {
    "instance": ("instances", "instance_events", "instance_id"),
    "job": ("jobs", "job_events", "job_id"),
}


async def append_event(
    conn: AsyncConn,
    entity: str,
    entity_id: uuid.UUID,
    from_state: str | None,
    to_state: str,
    event: str,
    state_version: int,
    *,
    actor: Actor = OPERATOR,
    reason: str | None = None,
    age_s: float = 0.0,
    at: datetime | None = None,
    detail: Mapping[str, Any] | None = None,
) -> int:
    """Append an event to an entity's log (and chain) directly; return the event's id."""
    table, events, fk = EVENT_TABLES[entity]
    cursor = await conn.execute(
        APPEND_EVENT.format(table=table, events=events, fk=fk, entity=entity),
        {
            "id": entity_id,
            "from_state": from_state,
            "to_state": to_state,
            "event": event,
            "actor_kind": actor.kind,
            "actor_id": actor.id,
            "reason": reason,
            "detail": json.dumps(dict(detail or {})),
            "state_version": state_version,
            "age_s": age_s,
            "at": at,
        },
    )
    row = await cursor.fetchone()
    assert row is not None
    event_id: int = row["id"]
    return event_id
