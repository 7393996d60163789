"""Faults with the reconciler loop running: a worker killed mid-provision, a job that always fails."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from controlplane.audit import verify as audit
from controlplane.core.faultspec import parse_faults
from controlplane.core.kinds import DEPROVISION, PROVISION
from controlplane.db.connection import AsyncConn
from controlplane.db.job_rows import NewJob, enqueue
from controlplane.runtime.settings import Settings
from provisioners.faults import FaultyProvisioner
from provisioners.local import LocalProvisioner
from tests.factories import TEST_ACTOR, make_instance
from tests.operations_support import Condition, instance, instance_in, job, registry_for
from tests.provisioning_support import WORKER_SCRIPT, connect, credentials, real_instances, worker_env
from tests.queue_kinds import until
from tests.reconciler_support import RECONCILER_ID, instance_events, looping, reconciling, working

INTERVAL_S = 0.25


@pytest.fixture
def fault_settings(pg_root: Path, fresh_database: str) -> Iterator[Settings]:
    with real_instances(
        pg_root,
        fresh_database,
        heartbeat_interval_s=0.2,
        reclaim_after_intervals=5,
        retry_base_delay_s=0.1,
        retry_max_delay_s=1.0,
        poll_interval_s=0.1,
        shutdown_grace_s=0.5,
        reconcile_interval_s=INTERVAL_S,
    ) as settings:
        yield settings


def claimed_by(job_id: object, worker: str) -> Condition:
    async def check(conn: AsyncConn) -> bool:
        row = await job(conn, job_id)  # type: ignore[arg-type]
        return bool(row["state"] == "running" and row["claimed_by"] == worker)

    return check


async def test_a_worker_killed_mid_provision_is_reclaimed_by_the_reconciler_and_the_instance_gets_ready(
    conn: AsyncConn, fault_settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="reconciler.maintenance")
    assert fault_settings.database.url_value is not None
    url = fault_settings.database.url_value
    local = LocalProvisioner(fault_settings)
    iid = (await make_instance(conn))["id"]
    provision = (await enqueue(conn, NewJob(PROVISION, iid), TEST_ACTOR)).job
    async with reconciling(fault_settings, local) as rec, looping(rec):
        doomed = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            WORKER_SCRIPT,
            env=worker_env(fault_settings, "initialize_database:kill:1:0.1", "doomed-worker"),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        await until(
            url, claimed_by(provision["id"], "doomed-worker"), channels=("cp_job_running",), timeout=30
        )
        # A second worker is ready before the first dies: only the reclaim can give it the job.
        async with working(fault_settings, registry_for(local), "second-worker"):
            _, stderr = await asyncio.wait_for(doomed.communicate(), timeout=60)
            killed_at, killed = datetime.now(UTC), time.monotonic()
            assert doomed.returncode == -9, stderr.decode()[-2000:]
            last_heartbeat = (await job(conn, provision["id"]))["heartbeat_at"]
            assert (await instance(conn, iid))["state"] == "provisioning"
            await until(url, instance_in(iid, "ready"), channels=("cp_instance_ready",), timeout=60)
            to_ready = time.monotonic() - killed
    cursor = await conn.execute(
        "SELECT at, actor_kind, actor_id, reason FROM job_events WHERE job_id = %s AND event = 'reclaim'",
        (provision["id"],),
    )
    (reclaim,) = await cursor.fetchall()
    assert (reclaim["actor_kind"], reclaim["actor_id"]) == ("supervisor", RECONCILER_ID)
    to_reclaim = (reclaim["at"] - killed_at).total_seconds()
    bound = fault_settings.worker.reclaim_after_s + INTERVAL_S
    print(
        f"\nkill -9 mid-provision: reclaimed by the reconciler after {to_reclaim:.2f}s,"
        f" ready after {to_ready:.2f}s (reclaim threshold {fault_settings.worker.reclaim_after_s:g}s"
        f" + one pass interval {INTERVAL_S}s = {bound:g}s)"
    )
    # The first pass that could see the heartbeat stale reclaimed the job: no pass's maintenance
    # started after the threshold and finished before the reclaim without doing it (the loop's
    # own clock).
    stale_at = (last_heartbeat + timedelta(seconds=fault_settings.worker.reclaim_after_s)).timestamp()
    passes = [r for r in caplog.records if r.getMessage() == "reconciler maintenance"]
    (reclaiming,) = [r for r in passes if r.__dict__["jobs_reclaimed"]]
    missed = [
        r
        for r in passes
        if r.created - r.__dict__["duration_s"] > stale_at and r.created < reclaiming.created
    ]
    assert missed == [], f"{len(missed)} passes after the threshold left the job alone"
    done = await job(conn, provision["id"])
    assert (done["state"], done["attempt"], done["claimed_by"]) == ("completed", 2, "second-worker")
    with connect(credentials(fault_settings, await instance(conn, iid))) as customer:
        customer.execute("CREATE TABLE after_the_crash (x int)")
    assert [r.kind for r in await local.inventory()] == ["data_directory", "server", "port"]
    assert await audit.verify(conn) == []


async def test_a_job_that_always_fails_is_retried_with_backoff_abandoned_and_fails_its_instance(
    conn: AsyncConn, fault_settings: Settings
) -> None:
    assert fault_settings.database.url_value is not None
    faulty = FaultyProvisioner(LocalProvisioner(fault_settings), parse_faults("allocate_storage:fail:*"))
    iid = (await make_instance(conn))["id"]
    provision = (await enqueue(conn, NewJob(PROVISION, iid, max_attempts=3), TEST_ACTOR)).job
    async with (
        reconciling(fault_settings, faulty) as rec,
        looping(rec),
        working(fault_settings, registry_for(faulty)),
    ):
        await until(
            fault_settings.database.url_value,
            instance_in(iid, "failed"),
            channels=("cp_instance_failed",),
            timeout=30,
        )
        cursor = await conn.execute(
            "SELECT id FROM jobs WHERE instance_id = %s AND kind = %s", (iid, DEPROVISION)
        )
        (cleanup,) = await cursor.fetchall()

        async def cleaned(c: AsyncConn) -> bool:
            return bool((await job(c, cleanup["id"]))["state"] == "completed")

        await until(fault_settings.database.url_value, cleaned, channels=("cp_job_completed",), timeout=30)

    cursor = await conn.execute(
        "SELECT event, actor_kind, actor_id, detail, at FROM job_events WHERE job_id = %s ORDER BY id",
        (provision["id"],),
    )
    events = await cursor.fetchall()
    assert [e["event"] for e in events] == [
        "enqueue",
        *["claim", "start", "error", "retry"] * 2,
        "claim",
        "start",
        "error",
        "abandon",
    ]
    errors = [e for e in events if e["event"] == "error"]
    retries = [e for e in events if e["event"] == "retry"]
    delays = [e["detail"]["retry_in_s"] for e in errors[:2]]
    assert [e["detail"]["why"] for e in errors] == [
        "backoff after attempt 1",
        "backoff after attempt 2",
        "attempt 3 of 3 failed",
    ]
    # Equal jitter: attempt n waits between half and all of base * 2**(n-1).
    assert 0.05 <= delays[0] <= 0.1 and 0.1 <= delays[1] <= 0.2
    for error, retry, delay in zip(errors, retries, delays, strict=False):
        assert (retry["at"] - error["at"]).total_seconds() >= delay - 0.001  # the backoff was waited out
        assert (retry["actor_kind"], retry["actor_id"]) == ("supervisor", RECONCILER_ID)
    assert (events[-1]["actor_kind"], events[-1]["actor_id"]) == ("supervisor", RECONCILER_ID)

    row = await instance(conn, iid)
    reason = (
        "provision failed after 3 attempt(s): allocate_storage: "
        "injected fault at allocate_storage (allocate_storage:fail:*:before)"
    )
    assert (row["state"], row["failure_reason"]) == ("failed", reason)
    assert [(f, t, e, a) for f, t, e, a in await instance_events(conn, iid)] == [
        (None, "pending", "create", "system:tests"),
        ("pending", "provisioning", "start_provisioning", "worker:worker-test"),
        ("provisioning", "failed", "fail", f"supervisor:{RECONCILER_ID}"),
    ]
    assert (await job(conn, cleanup["id"]))["verdict"]["result"] == "cleaned up"
    assert await audit.verify(conn) == []
