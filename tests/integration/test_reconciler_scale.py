"""A pass over 200,000 terminal instances and 100 live ones: partial indexes, and only live rows touched."""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.db.transitions import Move, transition_many
from controlplane.runtime.settings import Settings
from provisioners.noop import NoopProvisioner
from tests.factories import GONE_WORKER, make_org
from tests.operations_support import scalar
from tests.queue_kinds import db_now
from tests.reconciler_support import reconciling

TERMINAL = 200_000
LIVE = 100
LIVE_INDEX = "ix_instances_live_state"


async def load(conn: AsyncConn, org: uuid.UUID) -> list[uuid.UUID]:
    """TERMINAL failed instances (set-based, each a legal pending -> failed edge) and LIVE ready ones."""
    await conn.execute(
        "INSERT INTO instances (org_id, name, spec, state)"
        " SELECT %s, 'gone-' || g, '{\"plan\": \"dev\"}', 'pending' FROM generate_series(1, %s) AS g",
        (org, TERMINAL),
    )
    await conn.execute(
        "UPDATE instances SET state = 'failed', state_version = 1, failure_reason = 'bulk'"
        " WHERE name LIKE 'gone-%'"
    )
    cursor = await conn.execute(
        "INSERT INTO instances (org_id, name, spec, state, deadline_at)"
        " SELECT %s, 'live-' || g, '{\"plan\": \"dev\"}', 'pending', now() + interval '5 minutes'"
        " FROM generate_series(1, %s) AS g RETURNING id",
        (org, LIVE),
    )
    ids = [row["id"] for row in await cursor.fetchall()]
    # The live ones go to ready on the transition path, 100 moves per statement.
    for version, (state, event) in enumerate(
        (("pending", "start_provisioning"), ("provisioning", "provisioned"))
    ):
        patch = {"observed_generation": 1} if event == "provisioned" else {}
        moved = await transition_many(
            conn, "instance", [Move(i, state, version, event, patch=patch) for i in ids], GONE_WORKER
        )
        assert len(moved.moved) == LIVE
    await conn.execute("VACUUM ANALYZE instances")
    return ids


def plan_text(rows: list[dict[str, str]]) -> str:
    return "\n".join(row["QUERY PLAN"] for row in rows)


async def test_a_pass_over_200000_terminal_instances_touches_only_the_100_live_ones(
    conn: AsyncConn, settings: Settings
) -> None:
    began = time.monotonic()
    live = await load(conn, await make_org(conn))
    print(f"\nloaded {TERMINAL} terminal and {LIVE} live instances in {time.monotonic() - began:.1f}s")
    assert await scalar(conn, "SELECT count(*) FROM instances WHERE state = 'failed'") == TERMINAL

    params = {
        "now": await db_now(conn) + timedelta(seconds=1),
        "limit": settings.reconciler.batch_size,
        "shards": None,
        "shard_count": 1,
    }
    for statement, args in ((sql.SCAN_LIVE_INSTANCES, params), (sql.COUNT_LIVE_INSTANCES, None)):
        cursor = await conn.execute("EXPLAIN " + statement, args)
        plan = plan_text(await cursor.fetchall())
        assert (
            f"Index Scan using {LIVE_INDEX}" in plan
            or f"Bitmap Index Scan on {LIVE_INDEX}" in plan
            or (f"Index Only Scan using {LIVE_INDEX}" in plan)
        ), plan
        assert "Seq Scan on instances" not in plan, plan
    cursor = await conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql.SCAN_LIVE_INSTANCES, params)
    analyzed = plan_text(await cursor.fetchall())
    print(analyzed)

    settings = settings.replace(provisioner="noop")
    async with reconciling(settings, NoopProvisioner()) as rec:
        await rec.run_once()  # warm: connections, prepared statements
        await conn.execute("UPDATE instances SET last_reconciled_at = NULL WHERE id = ANY(%s)", (live,))
        started = time.monotonic()
        summary = await rec.run_once()
        took = time.monotonic() - started
    print(
        f"pass over {LIVE} live instances among {TERMINAL} terminal ones"
        f" (noop provisioner): {took * 1000:.1f} ms"
    )
    assert (summary.scanned, summary.observed, summary.actions) == (LIVE, LIVE, {})
    touched = await scalar(conn, "SELECT array_agg(id) FROM instances WHERE last_reconciled_at IS NOT NULL")
    assert sorted(touched) == sorted(live)
