"""Health and drift through the real local provisioner: real PostgreSQL servers broken or changed
behind the control plane's back, found by a reconciler pass and repaired by the real worker."""

from __future__ import annotations

import os
import shutil
import signal
import uuid

from controlplane.audit import verify as audit
from controlplane.core.kinds import HEAL, RESUME, UPDATE
from controlplane.db.connection import AsyncConn
from controlplane.runtime.settings import Settings
from provisioners.base import InstanceSpec
from provisioners.local import LocalProvisioner
from tests.archive_support import archived_through, server_clock
from tests.operations_support import (
    Condition,
    instance,
    instance_in,
    ready_instance,
    registry_for,
)
from tests.provisioning_support import connect, credentials
from tests.reconciler_support import (
    RECONCILER_ID,
    enqueued_by,
    instance_events,
    live_jobs,
    next_fence,
    passes_until,
    reconciling,
    working,
)

RECONCILER = f"reconciler:{RECONCILER_ID}"


def recovered(instance_id: uuid.UUID) -> Condition:
    """Ready again with no job left: whatever repaired it has finished."""

    async def check(conn: AsyncConn) -> bool:
        return await instance_in(instance_id, "ready")(conn) and not await live_jobs(conn, instance_id)

    return check


async def test_a_killed_server_and_a_removed_data_directory_are_degraded_and_healed(
    conn: AsyncConn, local_settings: Settings
) -> None:
    local = LocalProvisioner(local_settings)
    registry = registry_for(local)
    iid = await ready_instance(conn, local_settings, registry)
    async with reconciling(local_settings, local) as rec:
        summary = await rec.run_once()
        # Healthy: nothing to repair; its first backup is due at once (restores start from one).
        assert (summary.observed, summary.actions) == (1, {"enqueue_backup": 1})

        # kill -9 of the postmaster, behind the control plane's back.
        pid = int((local.datadir(iid) / "postmaster.pid").read_text().split()[0])
        os.kill(pid, signal.SIGKILL)
        local._server(iid).wait_until_down()
        summary = await rec.run_once()
        assert summary.actions == {"degrade": 1, "enqueue_heal": 1}
        row = await instance(conn, iid)
        assert (row["state"], row["failure_reason"]) == ("degraded", "observed server not running")
        (heal,) = [j for j in await live_jobs(conn, iid) if j["kind"] != "backup"]
        assert heal["kind"] == HEAL and await enqueued_by(conn, heal["id"]) == RECONCILER
        async with working(local_settings, registry):
            await passes_until(rec, recovered(iid))
        row = await instance(conn, iid)
        assert row["failure_reason"] is None
        with connect(credentials(local_settings, row)) as customer:
            customer.execute("CREATE TABLE before_the_loss (x int)")

        # The data directory removed, behind the control plane's back: degraded as data lost, and
        # never healed into an empty database: restored to the end of its archive (a backup is held).
        written = server_clock(credentials(local_settings, row))
        async with working(local_settings, registry):  # its first backup, if the kill cut it short
            await passes_until(rec, archived_through(iid, written))
        shutil.rmtree(local.datadir(iid))
        summary = await rec.run_once()
        assert summary.actions == {"degrade": 1, "enqueue_restore": 1}
        row = await instance(conn, iid)
        assert (row["state"], row["failure_code"]) == ("degraded", "data_lost")
        assert row["failure_reason"] == "data lost: data directory missing"
        async with working(local_settings, registry):
            await passes_until(rec, recovered(iid))
        with connect(credentials(local_settings, await instance(conn, iid))) as customer:
            assert customer.execute("SELECT to_regclass('before_the_loss')::text").fetchone() == (
                "before_the_loss",
            )
        cursor = await conn.execute(
            "SELECT count(*) AS n FROM jobs WHERE instance_id = %s AND kind = %s", (iid, HEAL)
        )
        assert (await cursor.fetchone() or {})["n"] == 1  # the lost data was never healed
    assert [(f, t, a.split(":")[0]) for f, t, _, a in await instance_events(conn, iid)][3:] == [
        ("ready", "degraded", "reconciler"),
        ("degraded", "ready", "worker"),
        ("ready", "degraded", "reconciler"),
        ("degraded", "ready", "worker"),
    ]
    cursor = await conn.execute(
        "SELECT reason, detail FROM instance_events WHERE instance_id = %s AND event = 'recover' ORDER BY id",
        (iid,),
    )
    # The provisioner's words (they may name servers and paths) are kept for SREs only.
    recoveries = await cursor.fetchall()
    repairs = [(r["reason"], r["detail"]["sre"]["before"]["detail"]) for r in recoveries[:1]]
    assert repairs == [("repaired", "server not running")]
    assert recoveries[1]["reason"].startswith("restored to the end of its continuous archive")
    assert await audit.verify(conn) == []


async def test_read_only_drift_and_a_spec_ahead_are_corrected(
    conn: AsyncConn, local_settings: Settings
) -> None:
    local = LocalProvisioner(local_settings)
    registry = registry_for(local)
    iid = await ready_instance(conn, local_settings, registry)
    info = credentials(local_settings, await instance(conn, iid))
    async with reconciling(local_settings, local) as rec:
        # Read-only switched on behind the control plane's back, no hold: resumed.
        await local.suspend(iid, InstanceSpec(), await next_fence(conn))
        summary = await rec.run_once()
        assert summary.actions == {"enqueue_resume": 1}
        (resume,) = await live_jobs(conn, iid)
        assert resume["kind"] == RESUME and resume["payload"]["reason"].startswith("ready but read-only")
        async with working(local_settings, registry):
            await passes_until(rec, recovered(iid))
        assert (await local.observe(iid)).read_only is False
        with connect(info) as customer:
            customer.execute("CREATE TABLE writable_again (x int)")

        # A new spec generation on a ready instance: an update job, applied.
        await conn.execute(
            'UPDATE instances SET spec = spec || \'{"plan": "small"}\', spec_generation = 2 WHERE id = %s',
            (iid,),
        )
        summary = await rec.run_once()
        assert summary.actions == {"enqueue_update": 1}
        (update,) = await live_jobs(conn, iid)
        assert update["kind"] == UPDATE and await enqueued_by(conn, update["id"]) == RECONCILER
        async with working(local_settings, registry):
            await passes_until(rec, recovered(iid))
    row = await instance(conn, iid)
    assert (row["state"], row["spec_generation"], row["observed_generation"]) == ("ready", 2, 2)
    with connect(info) as customer:
        assert customer.execute("SHOW max_connections").fetchone() == ("50",)
        customer.execute("INSERT INTO writable_again VALUES (1)")
    assert [(f, t) for f, t, _, _ in await instance_events(conn, iid)][3:] == [
        ("ready", "updating"),
        ("updating", "ready"),
    ]
    assert await audit.verify(conn) == []
