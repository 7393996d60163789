"""Rows the workloads start from, made through the product's own creation and transition paths."""

from __future__ import annotations

import uuid

from controlplane.db import connection as db
from controlplane.db.instance_rows import create_instance
from controlplane.db.transitions import Actor, Move, transition_many

BENCH_ACTOR = Actor("system", "bench")


async def make_org(conn: db.AsyncConn, name: str | None = None) -> uuid.UUID:
    cursor = await conn.execute(
        "INSERT INTO organisations (name) VALUES (%s) RETURNING id",
        (name or f"bench-{uuid.uuid4().hex[:8]}",),
    )
    row = await cursor.fetchone()
    assert row is not None
    org_id: uuid.UUID = row["id"]
    return org_id


async def ready_instances(url: str, count: int) -> list[uuid.UUID]:
    """`count` instances created pending and moved to ready (state_version 2) by legal moves."""
    conn = await db.connect(url)
    async with conn:
        org = await make_org(conn)
        ids = []
        for n in range(count):
            row = await create_instance(
                conn, org, f"bench-{n}", {"plan": "dev", "region": "local"}, BENCH_ACTOR, deadline_s=3600
            )
            ids.append(row["id"])
        steps: tuple[tuple[str, int, str, dict[str, int]], ...] = (
            ("pending", 0, "start_provisioning", {}),
            # As the provisioning handler does: the spec it provisioned is now observed.
            ("provisioning", 1, "provisioned", {"observed_generation": 1}),
        )
        for expected, version, event, patch in steps:
            result = await transition_many(
                conn, "instance", [Move(i, expected, version, event, patch=patch) for i in ids], BENCH_ACTOR
            )
            if result.failed:
                raise RuntimeError(f"seeding instances failed: {result.failed[0]}")
    return ids
