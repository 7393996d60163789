"""Faults of the network between a client and PostgreSQL, through a TCP proxy on loopback: a
partition longer than a worker's lease (F5), an ambiguous COMMIT (F6)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from controlplane.audit import verify as audit
from controlplane.db import connection as db
from controlplane.db.connection import AsyncConn
from controlplane.db.job_rows import NewJob, enqueue
from controlplane.queue.supervisor import Supervisor
from controlplane.queue.worker import Worker
from controlplane.runtime.settings import Settings
from tests.api_support import create, make_ready, make_tenant, serving
from tests.factories import TEST_ACTOR
from tests.operations_support import scalar
from tests.queue_kinds import build_registry, create_tables
from tests.support import eventually
from tests.tcp_proxy import Proxy

pytestmark = pytest.mark.timeout(120)


@contextlib.asynccontextmanager
async def proxied(database_url: str) -> AsyncIterator[tuple[Proxy, str]]:
    port = int(database_url.rsplit(":", 1)[1].split("/", 1)[0])
    proxy = await Proxy(port).start()
    try:
        yield proxy, proxy.url(database_url)
    finally:
        await proxy.stop()


@contextlib.asynccontextmanager
async def running(worker: Worker) -> AsyncIterator[Worker]:
    task = asyncio.create_task(worker.run())
    try:
        yield worker
    finally:
        worker.request_stop()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(task, timeout=20)


async def test_f5_partition_longer_than_the_lease(
    conn: AsyncConn, fresh_database: str, settings: Settings
) -> None:
    """Worker A loses the database for longer than its lease while its job runs: it stops the job by
    its own clock; the supervisor reclaims it and worker B runs it; once the partition heals, what A
    had in flight (its heartbeat) changes nothing, and A never writes the job's effect."""
    await create_tables(conn)
    tuned = settings.replace(heartbeat_interval_s=0.2, reclaim_after_intervals=5, shutdown_grace_s=0.5)
    job = (await enqueue(conn, NewJob("record", payload={"seconds": 6, "slow_attempts": 1}), TEST_ACTOR)).job
    async with proxied(fresh_database) as (proxy, through_proxy):
        pool_a = db.pool(through_proxy, max_size=6, name="worker-a")
        pool_b = db.pool(fresh_database, max_size=6, name="worker-b")
        async with pool_a, pool_b:
            worker_a = Worker("worker-a", tuned.replace(database_url=through_proxy), pool_a, build_registry())
            async with running(worker_a):
                await eventually(lambda: _executions(conn, "worker-a", 1), "A runs the job", 20)
                proxy.blackhole()  # A's handler now sleeps; its heartbeats cannot get through
                await eventually(
                    lambda: _true(worker_a.counts["lease_expired"] == 1), "A stops by its clock", 10
                )
                assert worker_a.counts["lost"] == 1 and not worker_a.held_ids()
                supervisor = Supervisor(pool_b, tuned, build_registry(), supervisor_id="sup")
                await eventually(lambda: _reclaimed(conn, supervisor, job["id"]), "the job is reclaimed", 10)
                worker_b = Worker("worker-b", tuned, pool_b, build_registry())
                async with running(worker_b):
                    await eventually(lambda: _state(conn, job["id"], "completed"), "B finishes the job", 20)
                beats = worker_a.counts["heartbeats"]
                proxy.heal()  # what A had sent is delivered now, for a job it no longer holds
                await eventually(lambda: _executions(conn, "worker-b", 1), "B's effect recorded", 5)
    assert beats == worker_a.counts["heartbeats"] or not worker_a.held_ids()
    row = await _job(conn, job["id"])
    assert (row["state"], row["attempt"], row["claimed_by"]) == ("completed", 2, "worker-b")
    assert (
        await scalar(
            conn, "SELECT count(*) FROM job_events WHERE job_id = %s AND event = 'finish'", (job["id"],)
        )
        == 1
    )
    cursor = await conn.execute(
        "SELECT event, actor_id FROM job_events WHERE job_id = %s ORDER BY id", (job["id"],)
    )
    events = [(r["event"], r["actor_id"]) for r in await cursor.fetchall()]
    assert events[-4:] == [
        ("reclaim", "sup"),
        ("claim", "worker-b"),
        ("start", "worker-b"),
        ("finish", "worker-b"),
    ]
    assert all(actor != "worker-a" for _, actor in events[events.index(("reclaim", "sup")) :])
    cursor = await conn.execute("SELECT worker_id, attempt FROM test_executions ORDER BY id")
    assert [(r["worker_id"], r["attempt"]) for r in await cursor.fetchall()] == [
        ("worker-a", 1),
        ("worker-b", 2),
    ]
    assert await audit.verify(conn) == []


async def _true(value: bool) -> bool:
    return value


async def _executions(conn: AsyncConn, worker: str, n: int) -> bool:
    return bool(
        await scalar(conn, "SELECT count(*) = %s FROM test_executions WHERE worker_id = %s", (n, worker))
    )


async def _job(conn: AsyncConn, job_id: Any) -> Any:
    cursor = await conn.execute("SELECT * FROM jobs WHERE id = %s", (job_id,))
    return await cursor.fetchone()


async def _state(conn: AsyncConn, job_id: Any, state: str) -> bool:
    return bool((await _job(conn, job_id))["state"] == state)


async def _reclaimed(conn: AsyncConn, supervisor: Supervisor, job_id: Any) -> bool:
    await supervisor.run_once()
    return await _state(conn, job_id, "queued")


async def test_f6_ambiguous_commit_then_the_client_retries(
    conn: AsyncConn, fresh_database: str, settings: Settings
) -> None:
    """The API's COMMIT of a plan change reaches PostgreSQL and its reply is lost: the client gets a
    503 problem with Retry-After and sends the change again; exactly one change is recorded (one
    spec generation, one update job, one enqueue row), and the log replays clean."""
    tenant = await make_tenant(conn, "ambiguous")
    async with (
        proxied(fresh_database) as (proxy, through_proxy),
        serving(settings, database_url=through_proxy) as client,
    ):
        made = await create(client, tenant, "ambiguous")
        await make_ready(conn, settings, made["id"])
        proxy.drop_reply_to(b"COMMIT")
        lost = await client.patch(
            f"/v1/instances/{made['id']}", json={"plan": "small"}, headers=tenant.headers
        )
        assert proxy.dropped_replies == 1
        assert lost.status_code == 503, lost.text
        assert lost.headers["content-type"] == "application/problem+json" and "retry-after" in lost.headers
        retried = await client.patch(
            f"/v1/instances/{made['id']}", json={"plan": "small"}, headers=tenant.headers
        )
        assert retried.status_code == 202, retried.text
    row = await conn.execute("SELECT spec, spec_generation FROM instances WHERE id = %s", (made["id"],))
    instance = await row.fetchone()
    assert instance is not None and instance["spec"]["plan"] == "small" and instance["spec_generation"] == 2
    assert await scalar(conn, "SELECT count(*) FROM jobs WHERE kind = 'update'") == 1
    enqueues = await scalar(
        conn,
        "SELECT count(*) FROM job_events e JOIN jobs j ON j.id = e.job_id WHERE j.kind = 'update'"
        " AND e.event = 'enqueue'",
    )
    assert enqueues == 1
    assert await audit.verify(conn) == []


async def test_a_standby_reconciler_outlives_the_database_going_away_during_its_lock_attempt(
    fresh_database: str,
) -> None:
    """Found by the chaos soak: the server died between a standby's connect and its try of the
    leader lock, and the reconciler process exited. The attempt is now a failed round."""
    from reconciler.leader import LeaderElection

    async with proxied(fresh_database) as (proxy, through_proxy):
        election = LeaderElection(through_proxy)
        proxy.drop_reply_to(b"pg_try_advisory_lock")
        assert await election.ensure() is False and proxy.dropped_replies == 1
        assert await election.ensure() is True  # the next round takes the lock
        await election.release()
