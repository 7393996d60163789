"""Step progress against real PostgreSQL: the watch stream's step events, step records that only the
job's holder can write, and an overdue step shown as such before its deadline fails the instance."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta

import httpx
import psycopg
import pytest
from fastapi import FastAPI

from controlplane.api import watch
from controlplane.api.state import AppState
from controlplane.core import failures
from controlplane.core.faultspec import parse_faults
from controlplane.core.kinds import PROVISION, STEP_LABELS
from controlplane.db.connection import AsyncConn
from controlplane.queue import steps
from controlplane.queue.registry import JobContext
from controlplane.runtime.settings import Settings
from controlplane.services import instances
from provisioners.faults import FaultyProvisioner
from provisioners.noop import NoopProvisioner
from tests.api_support import Tenant, create, drive
from tests.integration.test_api_watch import parse_sse
from tests.operations_support import instance_in, registry_for, run_until, scalar
from tests.queue_kinds import db_now
from tests.reconciler_support import finish_job, reconciling, working

pytest_plugins = ("tests.api_fixtures",)


class Listening:
    """The request of a client that stays connected."""

    async def is_disconnected(self) -> bool:
        return False


async def test_the_watch_stream_carries_each_step_with_the_progress_after_it(
    app: FastAPI, client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn, api_settings: Settings
) -> None:
    made = await create(client, tenant, "orders")
    iid = uuid.UUID(made["id"])
    state: AppState = app.state.controlplane
    stream = watch.instance_stream(state, Listening(), iid, tenant.org_id)  # type: ignore[arg-type]
    events = parse_sse((await anext(stream)).decode())
    # Provisioning runs up to the last step, which hangs: the instance stays provisioning.
    hanging = registry_for(FaultyProvisioner(NoopProvisioner(), parse_faults("initialize_database:hang:*")))
    async with working(api_settings.replace(shutdown_grace_s=0), hanging):
        while not any(k == "step" and d["step"] == "initialize_database" for k, d in events):
            events += parse_sse((await asyncio.wait_for(anext(stream), timeout=10)).decode())
    await drive(conn, iid, "fail")  # ends the stream
    events += parse_sse(b"".join([chunk async for chunk in stream]).decode())

    assert events[0][0] == "instance" and events[0][1]["progress"]["operation"] == "provision"
    stepped = [(d["step"], d["event"]) for kind, d in events if kind == "step"]
    assert stepped == [
        ("allocate_storage", "started"),
        ("allocate_storage", "finished"),
        ("configure_network", "started"),
        ("configure_network", "finished"),
        ("initialize_database", "started"),
    ]
    # Each step event carries the progress as of that event.
    shown = {"started": "running", "finished": "done"}
    for kind, data in events:
        if kind != "step":
            continue
        assert data["operation"] == PROVISION and data["attempt"] == 1 and data["failure"] is None
        assert data["label"] == STEP_LABELS[data["step"]]
        assert (data["duration_s"] is None) == (data["event"] == "started")
        by_name = {s["name"]: s["state"] for s in data["progress"]["steps"]}
        assert by_name[data["step"]] == shown[data["event"]]
        assert data["progress"]["current_step"] == (data["step"] if data["event"] == "started" else None)
    last = events[-2][1]["progress"]
    assert [s["state"] for s in last["steps"]] == ["done", "done", "running", "pending"]
    assert events[-1] == ("transition", {"id": str(iid), "state": "failed", "state_version": 2})


async def test_step_records_are_append_only_and_refused_to_a_job_no_longer_held(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn, api_settings: Settings
) -> None:
    made = await create(client, tenant, "orders")
    await run_until(
        api_settings, registry_for(NoopProvisioner()), instance_in(uuid.UUID(made["id"]), "ready")
    )
    for statement in (
        "UPDATE job_steps SET error = 'rewritten'",
        "DELETE FROM job_steps",
        "TRUNCATE job_steps",
    ):
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="append-only"):
            await conn.execute(statement)
    # The finished job's fence no longer admits a step record (a worker that lost its job).
    cursor = await conn.execute("SELECT * FROM jobs WHERE instance_id = %s", (made["id"],))
    job = await cursor.fetchone()
    assert job is not None and job["state"] == "completed"
    context = JobContext(job=job, worker_id="late", pool=None, settings=api_settings)  # type: ignore[arg-type]
    inst = await instances.load(conn, tenant.org_id, uuid.UUID(made["id"]))
    with pytest.raises(steps.NotHeld):
        await steps.started(conn, context, inst, "allocate_storage")
    assert not await steps.ended(conn, context, inst.id, "allocate_storage")
    assert await scalar(conn, "SELECT count(*) FROM job_steps WHERE worker = 'late'") == 0


async def test_an_overdue_step_shows_overdue_before_the_deadline_fails_it(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn, api_settings: Settings
) -> None:
    settings = api_settings.replace(deadline_max_retries=0, shutdown_grace_s=0)
    # A history: one instance provisioned in well under a second a step.
    first = await create(client, tenant, "first")
    await run_until(settings, registry_for(NoopProvisioner()), instance_in(uuid.UUID(first["id"]), "ready"))

    made = await create(client, tenant, "orders")
    iid = uuid.UUID(made["id"])
    hanging = FaultyProvisioner(NoopProvisioner(), parse_faults("configure_network:hang:*"))

    async def step_started(c: AsyncConn) -> bool:
        return bool(
            await scalar(
                c,
                "SELECT count(*) FROM job_steps WHERE instance_id = %s AND step = 'configure_network'",
                (iid,),
            )
        )

    async with working(settings, registry_for(hanging)):
        await run_until(settings, registry_for(hanging), step_started, worker=False)
        inst = await instances.load(conn, tenant.org_id, iid)
        assert inst.deadline_at is not None
        started = await scalar(
            conn, "SELECT at FROM job_steps WHERE instance_id = %s AND step = 'configure_network'", (iid,)
        )
        on_time = (await steps.progress_of(conn, [inst], now=started))[iid]
        assert on_time["overdue"] is False and on_time["current_step"] == "configure_network"
        late_at = on_time["expected_by"] + timedelta(seconds=1)
        assert late_at < inst.deadline_at
        late = (await steps.progress_of(conn, [inst], now=late_at))[iid]
        assert late["overdue"] is True and late["steps"][1]["state"] == "running"
        assert late["steps"][1]["expected_s"] is not None and late["steps"][1]["expected_s"] < 1
        # The reconciler at that moment leaves it be: overdue is not failed.
        async with reconciling(settings, NoopProvisioner()) as rec:
            await rec.run_once(late_at)
        assert (await instances.load(conn, tenant.org_id, iid)).state == "provisioning"
    # The worker stopped: its job was handed back. Suppose it then ended without moving the instance
    # (a worker of an older version, say): past the deadline, the reconciler fails it, typed.
    job_id = await scalar(conn, "SELECT id FROM jobs WHERE instance_id = %s AND kind = 'provision'", (iid,))
    await finish_job(conn, job_id, {"result": "deferred"})
    past = inst.deadline_at + timedelta(seconds=1)
    async with reconciling(settings, NoopProvisioner()) as rec:
        await rec.run_once(past)
    failed = (await client.get(f"/v1/instances/{iid}", headers=tenant.headers)).json()
    assert failed["state"] == "failed" and failed["failure"] == failures.REASONS["init_timeout"].as_dict()
    assert await db_now(conn) < past  # all of it without waiting for the deadline
