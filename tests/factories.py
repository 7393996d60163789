"""Rows for tests, made through the product's own creation paths."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from psycopg.rows import DictRow

from controlplane.db import AsyncConn
from controlplane.instances import create_instance
from controlplane.transitions import Actor, transition

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
