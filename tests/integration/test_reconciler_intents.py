"""Deferred intents through the reconciler: a deletion requested mid-provisioning, billing holds and
their release, and read-only re-enforced on a suspended instance made writable behind our back."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import TypeVar

from psycopg.rows import DictRow

from controlplane.audit import verify as audit
from controlplane.core.kinds import DEPROVISION, HEAL, PROVISION, RESUME, SUSPEND, UPDATE
from controlplane.core.step_errors import PermanentError
from controlplane.db import connection as db
from controlplane.db.connection import AsyncConn
from controlplane.queue.registry import JobRegistry
from controlplane.runtime.settings import Settings
from provisioners.base import InstanceSpec, Observation
from provisioners.faults import FaultyProvisioner
from provisioners.local import LocalProvisioner
from tests.factories import make_instance, make_org, walk
from tests.operations_support import (
    Condition,
    enqueue,
    instance,
    instance_in,
    job_finished,
    ready_instance,
    registry_for,
    run_until,
)
from tests.provisioning_support import credentials
from tests.reconciler_support import (
    RECONCILER_ID,
    ScriptedProvisioner,
    enqueued_by,
    instance_events,
    live_jobs,
    next_fence,
    passes_until,
    read_only,
    reconciling,
    to_ready,
    working,
)

T = TypeVar("T")
RECONCILER = f"reconciler:{RECONCILER_ID}"
# What DELETE /v1/instances/{id} records for an instance that cannot start deprovisioning yet.
REQUEST_DELETION = (
    "UPDATE instances SET deletion_requested_at = now(), skip_final_backup = false, updated_at = now()"
    " WHERE id = %s"
)


def settled(instance_id: uuid.UUID, state: str) -> Condition:
    """In `state` with no job left working on it."""

    async def check(conn: AsyncConn) -> bool:
        return await instance_in(instance_id, state)(conn) and not await live_jobs(conn, instance_id)

    return check


class DeletedMidway(FaultyProvisioner):
    """The local provisioner, with a customer's DELETE arriving while the network is configured."""

    def __init__(self, inner: LocalProvisioner, url: str) -> None:
        super().__init__(inner, [])
        self.url = url
        self.requested_in: list[str] = []

    async def _around(self, step: str, work: Callable[[], Awaitable[T]]) -> T:
        if step == "configure_network" and not self.requested_in:
            conn = await db.connect(self.url)
            async with conn:
                cursor = await conn.execute("SELECT id, state FROM instances")
                (row,) = await cursor.fetchall()
                await conn.execute(REQUEST_DELETION, (row["id"],))
            self.requested_in.append(row["state"])
        return await work()


async def test_a_deletion_requested_while_provisioning_runs_once_the_instance_is_ready(
    conn: AsyncConn, local_settings: Settings
) -> None:
    assert local_settings.database.url_value is not None
    local = LocalProvisioner(local_settings)
    midway = DeletedMidway(local, local_settings.database.url_value)
    iid = (await make_instance(conn))["id"]
    await enqueue(conn, PROVISION, iid)
    async with reconciling(local_settings, midway) as rec, working(local_settings, registry_for(midway)):
        await passes_until(rec, settled(iid, "deleted"))
    assert midway.requested_in == ["provisioning"]
    assert [(f, t, e, a.split(":")[0]) for f, t, e, a in await instance_events(conn, iid)] == [
        (None, "pending", "create", "system"),
        ("pending", "provisioning", "start_provisioning", "worker"),
        ("provisioning", "ready", "provisioned", "worker"),
        ("ready", "deprovisioning", "deprovision", "worker"),
        ("deprovisioning", "deleted", "deprovisioned", "worker"),
    ]
    cursor = await conn.execute("SELECT * FROM jobs WHERE instance_id = %s AND kind = %s", (iid, DEPROVISION))
    (deprovision,) = await cursor.fetchall()
    assert await enqueued_by(conn, deprovision["id"]) == RECONCILER
    assert deprovision["payload"]["reason"] == "deletion requested"
    # The final backup, kept in the instance's archive for the plan's retention.
    assert deprovision["verdict"]["backup"] in {b.location for b in await local.list_backups(iid)}
    assert await local.inventory() == []
    assert await audit.verify(conn) == []


async def test_a_billing_hold_suspends_its_release_resumes_and_read_only_is_re_enforced(
    conn: AsyncConn, local_settings: Settings
) -> None:
    local = LocalProvisioner(local_settings)
    registry = registry_for(local)
    org = await make_org(conn)
    iid = await ready_instance(conn, local_settings, registry, org)
    info = credentials(local_settings, await instance(conn, iid))
    async with reconciling(local_settings, local) as rec:
        # The hold is recorded on the organisation (as the Stripe webhook does); the pass suspends.
        await conn.execute(
            "UPDATE organisations SET billing_hold = true, billing_status = 'unpaid' WHERE id = %s", (org,)
        )
        assert (await rec.run_once()).actions == {"enqueue_suspend": 1}
        (suspend,) = await live_jobs(conn, iid)
        assert suspend["kind"] == SUSPEND and suspend["payload"] == {
            "reason": "billing hold",
            "billing": True,
        }
        async with working(local_settings, registry):
            await passes_until(rec, settled(iid, "suspended"))
        assert (await instance(conn, iid))["suspended_by_billing"] is True
        assert read_only(info)

        # Writable again behind the control plane's back: read-only is enforced again.
        await local.resume(iid, InstanceSpec(), await next_fence(conn))
        assert not read_only(info)
        assert (await rec.run_once()).actions == {"enqueue_suspend": 1}
        (again,) = await live_jobs(conn, iid)
        assert again["payload"]["reason"] == "suspended but writable: enforce read-only"
        async with working(local_settings, registry):
            await passes_until(rec, settled(iid, "suspended"))
        assert read_only(info)

        # Its server killed while suspended: suspended again, so it runs read-only again.
        pid = int((local.datadir(iid) / "postmaster.pid").read_text().split()[0])
        os.kill(pid, signal.SIGKILL)
        local._server(iid).wait_until_down()
        assert (await rec.run_once()).actions == {"enqueue_suspend": 1}
        (restart,) = await live_jobs(conn, iid)
        assert restart["payload"]["reason"] == "suspended but not running: restart read-only"
        async with working(local_settings, registry):
            await passes_until(rec, settled(iid, "suspended"))
        assert (await local.observe(iid)).running and read_only(info)

        # The hold is released: the instance suspended by billing resumes.
        await conn.execute(
            "UPDATE organisations SET billing_hold = false, billing_status = 'active' WHERE id = %s", (org,)
        )
        assert (await rec.run_once()).actions == {"enqueue_resume": 1}
        async with working(local_settings, registry):
            await passes_until(rec, settled(iid, "ready"))
    row = await instance(conn, iid)
    assert row["suspended_by_billing"] is False
    assert not read_only(info)
    cursor = await conn.execute(
        "SELECT from_state, to_state, actor_kind, reason FROM instance_events"
        " WHERE instance_id = %s ORDER BY id",
        (iid,),
    )
    assert [tuple(r.values()) for r in await cursor.fetchall()][3:] == [
        ("ready", "suspended", "worker", "billing hold"),
        ("suspended", "ready", "worker", "billing hold released"),
    ]
    assert await audit.verify(conn) == []


async def test_holds_and_releases_pick_the_right_instances(conn: AsyncConn, settings: Settings) -> None:
    scripted = ScriptedProvisioner()
    held, paying = await make_org(conn), await make_org(conn)
    await conn.execute("UPDATE organisations SET billing_hold = true WHERE id = %s", (held,))

    async def made(org: uuid.UUID, *, suspended_by: str | None = None) -> uuid.UUID:
        iid: uuid.UUID = (await make_instance(conn, org))["id"]
        await to_ready(conn, iid)
        if suspended_by is not None:
            await walk(conn, iid, "suspend", patch={"suspended_by_billing": suspended_by == "billing"})
            scripted.seen[iid] = Observation(True, running=True, healthy=True, read_only=True)
        return iid

    held_ready = await made(held)
    held_suspended = await made(held, suspended_by="billing")
    paying_ready = await made(paying)
    paying_suspended_by_customer = await made(paying, suspended_by="customer")
    paying_released = await made(paying, suspended_by="billing")
    async with reconciling(settings, scripted) as rec:
        summary = await rec.run_once()
    assert summary.actions == {"enqueue_suspend": 1, "enqueue_resume": 1}
    jobs = {
        iid: [j["kind"] for j in await live_jobs(conn, iid)]
        for iid in (held_ready, held_suspended, paying_ready, paying_suspended_by_customer, paying_released)
    }
    assert jobs == {
        held_ready: [SUSPEND],
        held_suspended: [],
        paying_ready: [],
        paying_suspended_by_customer: [],
        paying_released: [RESUME],
    }


class RefusesPlans(ScriptedProvisioner):
    """`apply_plan` fails for good while `refusing` is set."""

    refusing = True

    async def apply_plan(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> bool:
        if self.refusing:
            raise PermanentError(f"plan {spec.plan} cannot be applied here")
        return await super().apply_plan(instance_id, spec, fence)


def runs_generation(instance_id: uuid.UUID, generation: int) -> Condition:
    async def check(conn: AsyncConn) -> bool:
        row = await instance(conn, instance_id)
        return bool(row["state"] == "ready" and row["observed_generation"] == generation)

    return check


async def resize_to_small(
    conn: AsyncConn, settings: Settings, registry: JobRegistry, instance_id: uuid.UUID
) -> DictRow:
    """Plan small as generation 2, its update run by a worker to the end; the instance after it."""
    await conn.execute(
        'UPDATE instances SET spec = spec || \'{"plan": "small"}\', spec_generation = 2 WHERE id = %s',
        (instance_id,),
    )
    update = await enqueue(conn, UPDATE, instance_id, spec_generation=2)
    await run_until(settings, registry, job_finished(update["id"]))
    return await instance(conn, instance_id)


async def test_an_update_given_up_is_not_retried_until_the_plan_is_asked_for_again(
    conn: AsyncConn, settings: Settings
) -> None:
    provisioner = RefusesPlans()
    registry = registry_for(provisioner)
    iid = await ready_instance(conn, settings, registry)
    row = await resize_to_small(conn, settings, registry, iid)
    assert (row["state"], row["failed_generation"], row["observed_generation"]) == ("degraded", 2, 1)
    assert row["failure_reason"].startswith("update failed after 1 attempt(s)")
    async with reconciling(settings, provisioner, registry=registry) as rec:
        # Healthy, it recovers to ready; generation 2 is not tried again, pass after pass.
        assert (await rec.run_once()).actions == {"recover": 1}
        for _ in range(3):
            assert (await rec.run_once()).actions == {}
        assert await live_jobs(conn, iid) == []
        # The customer asks again (the API makes generation 3): that one is applied.
        provisioner.refusing = False
        await conn.execute("UPDATE instances SET spec_generation = 3 WHERE id = %s", (iid,))
        assert (await rec.run_once()).actions == {"enqueue_update": 1}
    await run_until(settings, registry, runs_generation(iid, 3))
    kinds = await conn.execute(
        "SELECT kind, state FROM jobs WHERE instance_id = %s AND kind = 'update' ORDER BY created_at", (iid,)
    )
    assert [(r["kind"], r["state"]) for r in await kinds.fetchall()] == [
        (UPDATE, "abandoned"),
        (UPDATE, "completed"),
    ]
    assert await audit.verify(conn) == []


class CannotHeal(ScriptedProvisioner):
    """While `broken`, the first step of every heal (and provision) fails for good."""

    broken = False

    async def allocate_storage(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> None:
        if self.broken:
            raise PermanentError("the volume cannot be attached")
        await super().allocate_storage(instance_id, spec, fence)


async def live_heal(conn: AsyncConn, instance_id: uuid.UUID) -> uuid.UUID:
    (heal,) = [j for j in await live_jobs(conn, instance_id) if j["kind"] == HEAL]
    heal_id: uuid.UUID = heal["id"]
    return heal_id


async def test_heals_given_up_in_a_row_are_retried_after_a_doubling_pause_and_reset_once_ready(
    conn: AsyncConn, settings: Settings
) -> None:
    settings = settings.replace(heal_backoff_base_s=60.0, heal_backoff_max_s=600.0)
    provisioner = CannotHeal()
    registry = registry_for(provisioner)
    iid = await ready_instance(conn, settings, registry)
    provisioner.broken = True
    provisioner.seen[iid] = Observation(True, detail="server not running")
    async with reconciling(settings, provisioner, registry=registry) as rec:
        assert (await rec.run_once()).actions == {"degrade": 1, "enqueue_heal": 1}
        await run_until(settings, registry, job_finished(await live_heal(conn, iid)))
        row = await instance(conn, iid)
        assert (row["state"], row["heal_failures"]) == ("degraded", 1)
        assert row["failure_reason"].startswith("heal failed after 1 attempt(s)")
        given_up = row["heal_given_up_at"]
        # One heal given up: no new heal for 60 s, pass after pass.
        for now in (None, given_up + timedelta(seconds=30), given_up + timedelta(seconds=59)):
            assert (await rec.run_once(now)).actions == {}
        assert (await rec.run_once(given_up + timedelta(seconds=60))).actions == {"enqueue_heal": 1}
        await run_until(settings, registry, job_finished(await live_heal(conn, iid)))
        row = await instance(conn, iid)
        assert row["heal_failures"] == 2
        given_up = row["heal_given_up_at"]
        # Two in a row: the pause doubles.
        assert (await rec.run_once(given_up + timedelta(seconds=119))).actions == {}
        assert (await rec.run_once(given_up + timedelta(seconds=120))).actions == {"enqueue_heal": 1}
        # This heal repairs it.
        provisioner.broken = False
        del provisioner.seen[iid]
        await run_until(settings, registry, instance_in(iid, "ready"))
    row = await instance(conn, iid)
    assert (row["heal_failures"], row["heal_given_up_at"], row["failure_reason"]) == (0, None, None)
    assert await audit.verify(conn) == []


class BreaksOnSmall(ScriptedProvisioner):
    """Applying plan `small` fails for good and leaves the server down; any other plan repairs it."""

    def __init__(self) -> None:
        super().__init__()
        self.applied: list[str] = []

    async def apply_plan(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> bool:
        self.applied.append(spec.plan)
        if spec.plan == "small":
            self.seen[instance_id] = Observation(True, detail="server not running")
            raise PermanentError("the server does not start with plan small")
        self.seen.pop(instance_id, None)
        return await super().apply_plan(instance_id, spec, fence)


async def test_a_plan_change_that_broke_the_server_is_healed_back_to_the_plan_it_ran(
    conn: AsyncConn, settings: Settings
) -> None:
    provisioner = BreaksOnSmall()
    registry = registry_for(provisioner)
    iid = await ready_instance(conn, settings, registry)
    assert (await instance(conn, iid))["observed_spec"]["plan"] == "dev"
    row = await resize_to_small(conn, settings, registry, iid)
    assert (row["state"], row["failed_generation"]) == ("degraded", 2)
    async with reconciling(settings, provisioner, registry=registry) as rec:
        assert (await rec.run_once()).actions == {"enqueue_heal": 1}
        await run_until(settings, registry, instance_in(iid, "ready"))
        assert (await rec.run_once()).actions == {}  # the plan given up is not tried again
    assert provisioner.applied[-2:] == ["small", "dev"]
    row = await instance(conn, iid)
    assert (row["spec"]["plan"], row["observed_spec"]["plan"]) == ("small", "dev")
    assert (row["spec_generation"], row["observed_generation"], row["failed_generation"]) == (2, 1, 2)
    cursor = await conn.execute(
        "SELECT reason, detail FROM instance_events WHERE instance_id = %s AND event = 'recover'", (iid,)
    )
    (recovered,) = await cursor.fetchall()
    assert recovered["reason"].endswith("back on plan dev") and recovered["detail"]["rolled_back"] is True
    assert await audit.verify(conn) == []
