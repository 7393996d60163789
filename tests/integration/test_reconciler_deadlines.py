"""The reconciler pass against real PostgreSQL: job supervision, per-state deadlines, the gauges.

Time is injected (`run_once(now)`) wherever a deadline or a heartbeat must look old.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta

from prometheus_client import REGISTRY
from psycopg.rows import DictRow

from controlplane.audit import verify as audit
from controlplane.core.kinds import DEPROVISION, PROVISION, UPDATE
from controlplane.core.retry import RetryDecision
from controlplane.db.connection import AsyncConn
from controlplane.db.instance_rows import create_instance
from controlplane.db.job_rows import NewJob, enqueue
from controlplane.db.transitions import heartbeat
from controlplane.queue import moves as queue
from controlplane.runtime.settings import Settings
from provisioners.base import DeprovisionResult, InstanceSpec
from provisioners.noop import NoopProvisioner
from reconciler.maintenance import LIVE_INSTANCE_STATES
from tests.factories import GONE_WORKER, TEST_ACTOR, make_instance, make_org, walk
from tests.operations_support import instance, instance_in, job, registry_for, scalar
from tests.queue_kinds import db_now, events_of, until
from tests.reconciler_support import (
    RECONCILER_ID,
    ScriptedProvisioner,
    duties,
    enqueued_by,
    finish_job,
    instance_events,
    live_jobs,
    reconciling,
    to_ready,
    working,
)

RECONCILER = f"reconciler:{RECONCILER_ID}"


async def running(conn: AsyncConn, kind: str, instance_id: uuid.UUID, worker: str = "w-1") -> DictRow:
    """Enqueue a job of `kind` for the instance and move it to running as `worker`."""
    made = await enqueue(conn, NewJob(kind, instance_id), TEST_ACTOR)
    claimed = [r for r in await queue.claim(conn, worker, [kind], 10) if r["id"] == made.job["id"]]
    (row,) = (await queue.start_many(conn, claimed, GONE_WORKER)).moved
    return row


async def test_a_pass_runs_the_supervisor_as_the_reconciler(conn: AsyncConn, settings: Settings) -> None:
    stale = await running(conn, PROVISION, (await make_instance(conn))["id"])
    failing = await running(conn, PROVISION, (await make_instance(conn))["id"])
    await queue.error(
        conn,
        queue.JobFailure(failing, "boom", "temporary", RetryDecision("retry", 5.0, "test backoff")),
        GONE_WORKER,
    )
    async with reconciling(settings, ScriptedProvisioner()) as rec:
        now = await db_now(conn)
        first = await duties(rec).run_once(now)
        assert (first.jobs.reclaimed, first.jobs.retried) == ([], [])  # fresh heartbeat, backoff not over
        later = now + timedelta(seconds=settings.worker.reclaim_after_s + 10)
        summary = await duties(rec).run_once(later)
    assert summary.jobs.reclaimed == [stale["id"]]
    assert summary.jobs.retried == [failing["id"]]
    for job_id, event in ((stale["id"], "reclaim"), (failing["id"], "retry")):
        row = await job(conn, job_id)
        assert row["state"] == "queued" and row["claimed_by"] is None
        assert (await events_of(conn, job_id))[-1] == (event, "supervisor", RECONCILER_ID)
    assert await audit.verify(conn) == []


async def test_pending_past_its_deadline_is_re_enqueued_a_bounded_number_of_times_then_failed(
    conn: AsyncConn, settings: Settings
) -> None:
    settings = settings.replace(deadline_pending_s=30, deadline_max_retries=2)
    iid = (await make_instance(conn))["id"]
    async with reconciling(settings, ScriptedProvisioner()) as rec:
        assert (await rec.run_once()).actions == {}  # before its deadline: nothing
        for retry in (1, 2):
            late = (await instance(conn, iid))["deadline_at"] + timedelta(seconds=1)
            summary = await rec.run_once(late)
            assert summary.actions == {"deadline_retry": 1, "enqueue_provision": 1}
            row = await instance(conn, iid)
            assert (row["state"], row["deadline_retries"]) == ("pending", retry)
            assert row["deadline_at"] > await db_now(conn) + timedelta(seconds=25)  # a new deadline
            (provision,) = await live_jobs(conn, iid)
            assert provision["kind"] == PROVISION and await enqueued_by(conn, provision["id"]) == RECONCILER
            # While that job lives, no amount of time fails the instance.
            assert (await rec.run_once(late + timedelta(hours=1))).actions == {}
            # The job ends without moving the instance (say, its worker found it not ready to act).
            await finish_job(conn, provision["id"], {"result": "deferred", "state": "pending"})
        late = (await instance(conn, iid))["deadline_at"] + timedelta(seconds=1)
        summary = await rec.run_once(late)
        assert summary.actions == {"fail": 1}
        assert (await rec.run_once(late + timedelta(hours=1))).actions == {}  # terminal: never again
    row = await instance(conn, iid)
    reason = "timeout: pending exceeded its deadline after 2 re-enqueue(s)"
    assert (row["state"], row["failure_reason"], row["failure_code"]) == ("failed", reason, "init_timeout")
    assert await live_jobs(conn, iid) == []
    assert (await instance_events(conn, iid))[-1] == ("pending", "failed", "fail", RECONCILER)
    reason_logged = await scalar(
        conn, "SELECT reason FROM instance_events WHERE instance_id = %s ORDER BY id DESC LIMIT 1", (iid,)
    )
    assert reason_logged == reason
    assert await audit.verify(conn) == []


async def test_updating_past_its_deadline_is_degraded_not_failed_and_not_retried_until_asked_again(
    conn: AsyncConn, settings: Settings
) -> None:
    settings = settings.replace(deadline_max_retries=1)
    iid = (await make_instance(conn))["id"]
    await to_ready(conn, iid)
    await conn.execute("UPDATE instances SET spec_generation = 2 WHERE id = %s", (iid,))
    # A worker moved it to updating and died; its job is gone (say, abandoned by an operator).
    await walk(conn, iid, "update", patch={"deadline_s": 60})
    async with reconciling(settings, ScriptedProvisioner()) as rec:
        late = (await instance(conn, iid))["deadline_at"] + timedelta(seconds=1)
        assert (await rec.run_once(late)).actions == {"deadline_retry": 1, "enqueue_update": 1}
        (update,) = await live_jobs(conn, iid)
        await finish_job(conn, update["id"], {"result": "deferred", "state": "updating"})
        late = (await instance(conn, iid))["deadline_at"] + timedelta(seconds=1)
        assert (await rec.run_once(late)).actions == {"degrade": 1}
        row = await instance(conn, iid)
        assert (row["state"], row["failure_reason"]) == (
            "degraded",
            "timeout: updating exceeded its deadline after 1 re-enqueue(s)",
        )
        assert (await instance_events(conn, iid))[-1] == ("updating", "degraded", "degrade", RECONCILER)
        assert row["failed_generation"] == 2
        # Observed healthy, it recovers; the generation given up is not tried again by itself.
        assert (await rec.run_once()).actions == {"recover": 1}
        assert (await rec.run_once()).actions == {}
        assert await live_jobs(conn, iid) == []
        # The customer asks again (a new generation): that one is applied.
        await conn.execute("UPDATE instances SET spec_generation = 3 WHERE id = %s", (iid,))
        assert (await rec.run_once()).actions == {"enqueue_update": 1}
    assert [j["kind"] for j in await live_jobs(conn, iid)] == [UPDATE]
    assert await audit.verify(conn) == []


async def test_a_live_heartbeating_job_keeps_an_instance_from_failing_for_time_alone(
    conn: AsyncConn, settings: Settings
) -> None:
    settings = settings.replace(deadline_max_retries=0)
    iid = (await make_instance(conn))["id"]
    await walk(conn, iid, "start_provisioning", patch={"deadline_s": 60})
    provision = await running(conn, PROVISION, iid, worker="w-alive")
    # Its deadline long past and no retries left: only the job stands between it and `failed`.
    await conn.execute("UPDATE instances SET deadline_at = now() - interval '1 hour' WHERE id = %s", (iid,))
    async with reconciling(settings, ScriptedProvisioner()) as rec:
        for _ in range(3):
            held = await heartbeat(conn, "w-alive", {provision["id"]: provision["fence"]})
            assert held == {provision["id"]}
            maintained = await duties(rec).run_once()  # the database's clock: the heartbeat is fresh
            summary = await rec.run_once()
            assert (summary.actions, maintained.jobs.reclaimed) == ({}, [])
        assert (await instance(conn, iid))["state"] == "provisioning"
        # Its worker goes silent: the job is reclaimed (still live), the instance still not failed.
        silent = await db_now(conn) + timedelta(seconds=settings.worker.reclaim_after_s + 1)
        maintained = await duties(rec).run_once(silent)
        summary = await rec.run_once(silent)
        assert maintained.jobs.reclaimed == [provision["id"]] and summary.actions == {}
        assert (await instance(conn, iid))["state"] == "provisioning"
        # Only once no job is left does the deadline fail it.
        await finish_job(conn, provision["id"], {"result": "deferred", "state": "provisioning"})
        assert (await rec.run_once()).actions == {"fail": 1}
    row = await instance(conn, iid)
    assert row["failure_reason"] == "timeout: provisioning exceeded its deadline after 0 re-enqueue(s)"
    assert row["failure_code"] == "init_timeout"
    assert await audit.verify(conn) == []


async def test_deprovisioning_past_its_deadline_is_re_enqueued_then_failed(
    conn: AsyncConn, settings: Settings
) -> None:
    settings = settings.replace(deadline_max_retries=1)
    iid = (await make_instance(conn))["id"]
    await to_ready(conn, iid)
    await walk(conn, iid, "deprovision", patch={"deadline_s": 60})
    async with reconciling(settings, ScriptedProvisioner()) as rec:
        late = (await instance(conn, iid))["deadline_at"] + timedelta(seconds=1)
        assert (await rec.run_once(late)).actions == {"deadline_retry": 1, "enqueue_deprovision": 1}
        (deprovision,) = await live_jobs(conn, iid)
        await finish_job(conn, deprovision["id"], {"result": "deferred", "state": "deprovisioning"})
        late = (await instance(conn, iid))["deadline_at"] + timedelta(seconds=1)
        assert (await rec.run_once(late)).actions == {"fail": 1}
    row = await instance(conn, iid)
    assert row["failure_reason"] == "timeout: deprovisioning exceeded its deadline after 1 re-enqueue(s)"
    assert row["failure_code"] == "deprovision_timeout"
    assert await audit.verify(conn) == []


class Gated(NoopProvisioner):
    """The noop provisioner, holding the first step of each operation until the test lets it go."""

    def __init__(self) -> None:
        self.entered: asyncio.Queue[str] = asyncio.Queue()
        self.gates = {step: asyncio.Event() for step in ("allocate_storage", "apply_plan", "deprovision")}

    async def _hold(self, step: str) -> None:
        self.entered.put_nowait(step)
        await self.gates[step].wait()

    async def allocate_storage(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> None:
        await self._hold("allocate_storage")

    async def apply_plan(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> bool:
        await self._hold("apply_plan")
        return True

    async def deprovision(
        self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, *, skip_backup: bool = False
    ) -> DeprovisionResult:
        await self._hold("deprovision")
        return DeprovisionResult()


async def test_each_transitional_state_gets_its_configured_deadline_on_entry(
    conn: AsyncConn, settings: Settings
) -> None:
    settings = settings.replace(
        deadline_pending_s=11,
        deadline_provisioning_s=22,
        deadline_updating_s=33,
        deadline_deprovisioning_s=44,
        poll_interval_s=0.1,
    )
    assert settings.database.url_value is not None
    url = settings.database.url_value
    gated = Gated()

    async def deadline_of(state: str) -> float | None:
        row = await instance(conn, iid)
        assert row["state"] == state
        if row["deadline_at"] is None:
            return None
        return float((row["deadline_at"] - row["state_entered_at"]).total_seconds())

    # As the API creates it: pending with the pending deadline.
    iid = (
        await create_instance(
            conn,
            await make_org(conn),
            "db",
            {"plan": "dev"},
            TEST_ACTOR,
            deadline_s=settings.reconciler.deadline_pending_s,
        )
    )["id"]
    assert await deadline_of("pending") == 11
    async with working(settings, registry_for(gated)):
        for kind, step, state, seconds in (
            (PROVISION, "allocate_storage", "provisioning", 22),
            (UPDATE, "apply_plan", "updating", 33),
            (DEPROVISION, "deprovision", "deprovisioning", 44),
        ):
            if kind == UPDATE:
                await conn.execute("UPDATE instances SET spec_generation = 2 WHERE id = %s", (iid,))
            await enqueue(conn, NewJob(kind, iid), TEST_ACTOR)
            assert await asyncio.wait_for(gated.entered.get(), timeout=30) == step
            assert await deadline_of(state) == seconds
            gated.gates[step].set()
            after = "deleted" if kind == DEPROVISION else "ready"
            await until(url, instance_in(iid, after), channels=(f"cp_instance_{after}",), timeout=30)
            assert await deadline_of(after) is None  # a settled state has no deadline
    assert await audit.verify(conn) == []


def gauge(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


async def test_after_a_pass_the_gauges_match_the_database(conn: AsyncConn, settings: Settings) -> None:
    org = await make_org(conn)
    for _ in range(3):
        await make_instance(conn, org)  # pending, deadline ahead
    late = (await make_instance(conn, org))["id"]
    await enqueue(conn, NewJob(PROVISION, late), TEST_ACTOR)  # a live job: it stays over deadline
    await conn.execute(
        "UPDATE instances SET deadline_at = now() - interval '1 minute' WHERE id = %s", (late,)
    )
    await walk(conn, (await make_instance(conn, org))["id"], "start_provisioning", patch={"deadline_s": 600})
    for _ in range(2):
        await to_ready(conn, (await make_instance(conn, org))["id"])
    await walk(conn, (await make_instance(conn, org))["id"], "fail")
    passes_before = gauge("controlplane_reconciler_pass_seconds_count") or 0.0
    async with reconciling(settings, ScriptedProvisioner()) as rec:
        summary = await rec.run_once()
        await duties(rec).run_once()
    assert summary.scanned == 7 and summary.actions == {}
    cursor = await conn.execute("SELECT state, count(*) AS n FROM instances GROUP BY state")
    counts = {r["state"]: r["n"] for r in await cursor.fetchall()}
    assert counts == {"pending": 4, "provisioning": 1, "ready": 2, "failed": 1}
    for state in LIVE_INSTANCE_STATES:
        assert gauge("controlplane_entities", entity="instance", state=state) == counts.get(state, 0), state
    over = await scalar(
        conn,
        "SELECT count(*) FROM instances WHERE state NOT IN ('deleted', 'failed') AND deadline_at < now()",
    )
    assert over == 1 and gauge("controlplane_instances_over_deadline") == over
    assert gauge("controlplane_entities", entity="job", state="queued") == 1
    assert gauge("controlplane_reconciler_pass_seconds_count") == passes_before + 1
    assert (gauge("controlplane_reconciler_last_success_timestamp_seconds") or 0) > 0
