"""The supervisor pass with injected time: reclaim stale jobs, retry after backoff, abandon with the hook."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from controlplane.audit import verify as audit
from controlplane.core.retry import RetryPolicy
from controlplane.db import connection as db
from controlplane.db.job_rows import NewJob, enqueue, get_job
from controlplane.db.transitions import Actor
from controlplane.queue import moves as queue
from controlplane.queue.registry import JobKind, JobRegistry
from controlplane.queue.supervisor import Supervisor
from controlplane.runtime.settings import Settings
from tests.factories import TEST_ACTOR
from tests.queue_kinds import WORKER, build_registry, db_now, events_of, running_job

ACTOR = Actor("worker", WORKER)


def supervisor(conn: db.AsyncConn, settings: Settings, registry: JobRegistry | None = None) -> Supervisor:
    return Supervisor(
        conn,
        settings,
        registry or build_registry(),
        supervisor_id="sup-1",
        policy=RetryPolicy(base_delay_s=1.0, max_delay_s=10.0, rand=lambda: 0.5),
    )


async def fail(conn: db.AsyncConn, row: Any, kind: str, sup: Supervisor, message: str = "boom") -> Any:
    decision = sup.policy.decide(attempt=row["attempt"], max_attempts=row["max_attempts"], error_kind=kind)
    return await queue.error(conn, queue.JobFailure(row, message, kind, decision), ACTOR)  # type: ignore[arg-type]


async def test_stale_claimed_and_running_jobs_are_reclaimed(conn: db.AsyncConn, settings: Settings) -> None:
    running = await running_job(conn)
    await enqueue(conn, NewJob("noop"), TEST_ACTOR)
    (claimed,) = await queue.claim(conn, WORKER, ["noop"], 1)
    sup = supervisor(conn, settings)
    now = await db_now(conn)
    assert (await sup.run_once(now)).reclaimed == []
    assert (await sup.run_once()).reclaimed == []  # the database's own clock: heartbeats are fresh
    later = now + timedelta(seconds=settings.worker.reclaim_after_s + 0.1)
    result = await sup.run_once(later)
    assert sorted(result.reclaimed) == sorted([running["id"], claimed["id"]])
    for job_id in result.reclaimed:
        row = await get_job(conn, job_id)
        assert row is not None and row["state"] == "queued" and row["claimed_by"] is None
        assert (await events_of(conn, job_id))[-1] == ("reclaim", "supervisor", "sup-1")
    assert (await sup.run_once(later)).reclaimed == []
    # The old holder's heartbeat now finds nothing it holds.
    from controlplane.db.transitions import heartbeat

    assert await heartbeat(conn, WORKER, {running["id"]: running["fence"]}) == set()
    assert await audit.verify(conn) == []


async def test_failed_job_is_retried_after_backoff_then_abandoned(
    conn: db.AsyncConn, settings: Settings
) -> None:
    abandoned: list[Any] = []

    async def on_abandoned(c: db.AsyncConn, row: Any, actor: Actor) -> None:
        abandoned.append((row["id"], row["state"], actor))

    registry = JobRegistry([JobKind("noop", build_registry().get("noop").handler, on_abandoned, 3)])  # type: ignore[union-attr]
    sup = supervisor(conn, settings, registry)
    row = await running_job(conn, max_attempts=3)
    for attempt in (1, 2):
        failed = await fail(conn, row, "temporary", sup)
        assert failed["attempt"] == attempt
        now = await db_now(conn)
        assert (await sup.run_once(now)).retried == []  # backoff not over yet
        result = await sup.run_once(now + timedelta(seconds=60))
        assert result.retried == [row["id"]]
        queued = await get_job(conn, row["id"])
        assert queued is not None and queued["state"] == "queued" and queued["run_at"] <= await db_now(conn)
        (claimed,) = await queue.claim(conn, WORKER, ["noop"], 1)
        (row,) = (await queue.start_many(conn, [claimed], ACTOR)).moved
    assert row["attempt"] == 3
    await fail(conn, row, "temporary", sup, "still broken")
    result = await sup.run_once()  # the last attempt failed: abandoned at once
    assert result.abandoned == [row["id"]]
    assert abandoned == [(row["id"], "abandoned", Actor("supervisor", "sup-1"))]
    events = [e for e, _, _ in await events_of(conn, row["id"])]
    assert events == ["enqueue"] + ["claim", "start", "error", "retry"] * 2 + [
        "claim",
        "start",
        "error",
        "abandon",
    ]
    cursor = await conn.execute(
        "SELECT reason FROM job_events WHERE job_id = %s AND event = 'abandon'", (row["id"],)
    )
    reason = await cursor.fetchone()
    assert reason is not None and "still broken" in reason["reason"]
    assert await audit.verify(conn) == []


async def test_permanent_error_abandons_at_once(conn: db.AsyncConn, settings: Settings) -> None:
    sup = supervisor(conn, settings)
    row = await running_job(conn)
    await fail(conn, row, "permanent", sup)
    result = await sup.run_once(await db_now(conn))
    assert result.abandoned == [row["id"]] and result.retried == []
    final = await get_job(conn, row["id"])
    assert final is not None and final["state"] == "abandoned" and final["attempt"] == 1


async def test_abandon_hook_runs_in_the_same_transaction(conn: db.AsyncConn, settings: Settings) -> None:
    await conn.execute("CREATE TABLE hook_log (job_id uuid)")

    async def failing_hook(c: db.AsyncConn, row: Any, actor: Actor) -> None:
        await c.execute("INSERT INTO hook_log VALUES (%s)", (row["id"],))
        raise RuntimeError("hook broke")

    noop = build_registry().get("noop")
    assert noop is not None
    registry = JobRegistry([JobKind("noop", noop.handler, failing_hook)])
    sup = supervisor(conn, settings, registry)
    row = await running_job(conn)
    await fail(conn, row, "permanent", sup)
    result = await sup.run_once()
    assert result.hook_failures == [row["id"]] and result.abandoned == []
    still = await get_job(conn, row["id"])
    assert still is not None and still["state"] == "failed"
    cursor = await conn.execute("SELECT count(*) AS n FROM hook_log")
    assert await cursor.fetchone() == {"n": 0}  # the hook's write went with the abandonment


async def test_a_job_whose_workers_keep_dying_is_failed_then_abandoned(
    conn: db.AsyncConn, settings: Settings
) -> None:
    sup = supervisor(conn, settings)
    row = await running_job(conn, max_attempts=1)
    result = await sup.run_once(await db_now(conn) + timedelta(seconds=60))
    assert result.reclaimed == [row["id"]]  # its one attempt: lost, but reclaimed once more
    (claimed,) = await queue.claim(conn, WORKER, ["noop"], 1)
    (again,) = (await queue.start_many(conn, [claimed], ACTOR)).moved
    assert again["attempt"] == 2
    result = await sup.run_once(await db_now(conn) + timedelta(seconds=60))
    assert result.errored == [row["id"]] and result.abandoned == [row["id"]]
    events = await events_of(conn, row["id"])
    assert [e for e, _, _ in events] == [
        "enqueue",
        "claim",
        "start",
        "reclaim",
        "claim",
        "start",
        "error",
        "abandon",
    ]


async def test_supervisor_takes_a_pool_too(fresh_database: str, settings: Settings) -> None:
    pool = db.pool(fresh_database, max_size=2)
    async with pool:
        async with pool.connection() as conn:
            row = await running_job(conn)
            later = await db_now(conn) + timedelta(seconds=60)
        result = await Supervisor(pool, settings, build_registry()).run_once(later)
        assert result.reclaimed == [row["id"]]


@pytest.mark.parametrize("batch", [3])
async def test_a_pass_works_through_more_than_one_batch(
    conn: db.AsyncConn, settings: Settings, batch: int
) -> None:
    rows = [await running_job(conn) for _ in range(7)]
    sup = Supervisor(conn, settings, build_registry(), batch_size=batch)
    result = await sup.run_once(await db_now(conn) + timedelta(seconds=60))
    assert sorted(result.reclaimed) == sorted(r["id"] for r in rows)
