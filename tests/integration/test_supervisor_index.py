"""The supervisor's scans are served by partial indexes on a table of 20,000 terminal jobs (the 20
live rows each scan finds, not the whole table)."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

from controlplane.core.retry import RetryDecision
from controlplane.db import connection as db
from controlplane.db import sql
from controlplane.db.job_rows import NewJob, enqueue_many
from controlplane.db.transitions import Actor
from controlplane.queue import moves as queue
from controlplane.runtime.settings import Settings
from tests.factories import TEST_ACTOR
from tests.queue_kinds import db_now, running_job, states

TERMINAL_JOBS = 20_000
BATCH = 10_000
LOADER = Actor("worker", "loader")


async def load_terminal_jobs(url: str, n: int, loaders: int = 2) -> None:
    """n completed jobs through the product's own statements (triggers and event rows included),
    in batches of BATCH moves per statement, on `loaders` connections side by side."""

    async def load(kind: str, batches: int) -> None:
        conn = await db.connect(url)
        async with conn:
            for _ in range(batches):
                await enqueue_many(conn, [NewJob(kind) for _ in range(BATCH)], TEST_ACTOR)
                # Statistics as a live table has them, so batches of this size get hash joins.
                await conn.execute("ANALYZE jobs")
                claimed = await queue.claim(conn, "loader", [kind], BATCH)
                started = await queue.start_many(conn, claimed, LOADER)
                done = await queue.finish_many(conn, [(r, {"result": "ok"}) for r in started.moved], LOADER)
                assert len(done.moved) == BATCH

    per_loader = n // BATCH // loaders
    await asyncio.gather(*(load(f"bulk{i}", per_loader) for i in range(loaders)))


def plan_text(rows: list[dict[str, str]]) -> str:
    return "\n".join(row["QUERY PLAN"] for row in rows)


async def test_supervisor_scans_use_the_partial_indexes(
    fresh_database: str, conn: db.AsyncConn, settings: Settings
) -> None:
    began = time.monotonic()
    await load_terminal_jobs(fresh_database, TERMINAL_JOBS)
    for _ in range(20):
        await running_job(conn)
    for _ in range(20):
        row = await running_job(conn)
        await queue.error(
            conn,
            queue.JobFailure(row, "boom", "temporary", RetryDecision("retry", 5, "test")),
            LOADER,
        )
    await conn.execute("VACUUM ANALYZE jobs")
    print(f"\nloaded {TERMINAL_JOBS} terminal jobs in {time.monotonic() - began:.1f}s")
    assert (await states(conn))["completed"] == TERMINAL_JOBS

    params = {
        "now": await db_now(conn) + timedelta(seconds=60),
        "stale_after_s": settings.worker.reclaim_after_s,
        "limit": settings.reconciler.batch_size,
    }
    for statement, index in [
        (sql.SCAN_STALE_JOBS, "ix_jobs_live_heartbeat"),
        (sql.SCAN_DUE_FAILED_JOBS, "ix_jobs_failed_run_at"),
    ]:
        cursor = await conn.execute("EXPLAIN " + statement, params)
        plan = plan_text(await cursor.fetchall())
        assert f"Index Scan using {index}" in plan or f"Bitmap Index Scan on {index}" in plan, plan
        assert "Seq Scan" not in plan, plan
        cursor = await conn.execute(statement, params)
        assert len(await cursor.fetchall()) == 20
