from __future__ import annotations

import json
import os
import shutil
import signal
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import psycopg
import pytest

from controlplane.audit import verify as audit
from controlplane.core.faultspec import parse_faults
from controlplane.core.kinds import DEPROVISION, HEAL, PROVISION, RESTORE, RESUME, SUSPEND, UPDATE
from controlplane.db import connection as db
from controlplane.db.connection import AsyncConn
from controlplane.db.transitions import Actor, transition
from controlplane.runtime.settings import Settings
from provisioners.faults import FaultyProvisioner
from provisioners.local import LocalProvisioner
from provisioners.noop import NoopProvisioner
from tests.factories import make_instance
from tests.operations_support import (
    enqueue,
    instance,
    instance_in,
    job,
    job_finished,
    ready_instance,
    registry_for,
    run_until,
)
from tests.provisioning_support import connect, credentials

T = TypeVar("T")
RECONCILER = Actor("reconciler", "tests")


class Watching(FaultyProvisioner):
    """Records, as each step starts, the instance's state and progress as a customer would see them."""

    def __init__(self, inner: LocalProvisioner, url: str) -> None:
        super().__init__(inner, [])
        self.url = url
        self.seen: list[tuple[str, str, str | None]] = []

    async def _around(self, step: str, work: Callable[[], Awaitable[T]]) -> T:
        if step != "observe":
            conn = await db.connect(self.url)
            async with conn:
                cursor = await conn.execute("SELECT state, progress FROM instances")
                row = await cursor.fetchone()
            assert row is not None
            self.seen.append((step, row["state"], row["progress"]))
        return await work()


async def events(conn: AsyncConn, instance_id: uuid.UUID) -> list[tuple[str | None, str, str]]:
    cursor = await conn.execute(
        "SELECT from_state, to_state, actor_kind FROM instance_events WHERE instance_id = %s ORDER BY id",
        (instance_id,),
    )
    return [(r["from_state"], r["to_state"], r["actor_kind"]) for r in await cursor.fetchall()]


async def test_an_instance_is_provisioned_suspended_resumed_resized_and_deleted(
    conn: AsyncConn, local_settings: Settings
) -> None:
    assert local_settings.database.url_value is not None
    local = LocalProvisioner(local_settings)
    watching = Watching(local, local_settings.database.url_value)
    registry = registry_for(watching)
    inst = await make_instance(conn)
    iid = inst["id"]

    provision_job = await enqueue(conn, PROVISION, iid)
    await run_until(local_settings, registry, instance_in(iid, "ready"))
    row = await instance(conn, iid)
    assert row["connection"]["port"] in range(
        local_settings.provisioner.local_port_min, local_settings.provisioner.local_port_max + 1
    )
    assert "password" not in row["connection"] and row["secret"] is not None
    assert (row["observed_generation"], row["progress"], row["deadline_at"]) == (1, None, None)
    assert watching.seen == [
        ("allocate_storage", "provisioning", "allocate_storage"),
        ("configure_network", "provisioning", "configure_network"),
        ("initialize_database", "provisioning", "initialize_database"),
        ("configure_archive", "provisioning", "configure_archive"),
    ]
    info = credentials(local_settings, row)
    with connect(info) as customer:
        customer.execute("CREATE TABLE notes (body text)")
        customer.execute("INSERT INTO notes VALUES ('provisioned')")
    finished = await job(conn, provision_job["id"])
    assert finished["verdict"]["result"] == "ready"

    # A second provision job finds nothing to do.
    again = await enqueue(conn, PROVISION, iid)
    await run_until(local_settings, registry, job_finished(again["id"]))
    assert (await job(conn, again["id"]))["verdict"] == {"result": "nothing to do"}

    # Billing suspends (the organisation is on hold): reads work, writes do not.
    await conn.execute("UPDATE organisations SET billing_hold = true")
    await enqueue(conn, SUSPEND, iid, billing=True)
    await run_until(local_settings, registry, instance_in(iid, "suspended"))
    assert (await instance(conn, iid))["suspended_by_billing"] is True
    with connect(info) as customer:
        assert customer.execute("SELECT count(*) FROM notes").fetchone() == (1,)
        customer.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE")
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            customer.execute("INSERT INTO notes VALUES ('suspended')")

    resume_job = await enqueue(conn, RESUME, iid)
    await run_until(local_settings, registry, job_finished(resume_job["id"]))
    row = await instance(conn, iid)
    assert (row["state"], row["suspended_by_billing"], row["progress"]) == ("ready", False, None)
    with connect(info) as customer:
        customer.execute("INSERT INTO notes VALUES ('resumed')")

    # A new spec generation: the plan is applied and observed.
    await conn.execute(
        'UPDATE instances SET spec = spec || \'{"plan": "small"}\', spec_generation = spec_generation + 1'
        " WHERE id = %s",
        (iid,),
    )
    update_job = await enqueue(conn, UPDATE, iid)
    await run_until(local_settings, registry, job_finished(update_job["id"]))
    row = await instance(conn, iid)
    assert (row["state"], row["observed_generation"], row["spec_generation"]) == ("ready", 2, 2)
    with connect(info) as customer:
        assert customer.execute("SHOW max_connections").fetchone() == ("50",)
    # Onto an HA plan: the pooled endpoint recorded, and beside it the read-only one, where the
    # standby serves the rows and refuses a write.
    ha = credentials(local_settings, row)
    assert ha.pool_mode == "transaction" and ha.read_only == (ha.host, ha.port, "app_readonly")
    reads = {**ha.libpq(), "dbname": "app_readonly"}
    with psycopg.connect(**reads, autocommit=True, connect_timeout=5, prepare_threshold=None) as customer:
        assert customer.execute("SELECT count(*) FROM notes").fetchone() == (2,)
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            customer.execute("INSERT INTO notes VALUES ('read-only')")

    # Deletion: a final backup, everything removed, the credential wiped.
    delete_job = await enqueue(conn, DEPROVISION, iid)
    await run_until(local_settings, registry, instance_in(iid, "deleted"))
    row = await instance(conn, iid)
    assert row["secret"] is None and row["deadline_at"] is None
    verdict = (await job(conn, delete_job["id"]))["verdict"]
    # The final backup is a backup of the instance's archive, kept for the plan's retention.
    assert verdict["result"] == "deleted" and verdict["backup"] in {
        b.location for b in await local.list_backups(iid)
    }
    assert await local.inventory() == []

    assert [(f, t) for f, t, _ in await events(conn, iid)] == [
        (None, "pending"),
        ("pending", "provisioning"),
        ("provisioning", "ready"),
        ("ready", "suspended"),
        ("suspended", "ready"),
        ("ready", "updating"),
        ("updating", "ready"),
        ("ready", "deprovisioning"),
        ("deprovisioning", "deleted"),
    ]
    assert {actor for _, _, actor in (await events(conn, iid))[1:]} == {"worker"}
    assert await audit.verify(conn) == []


async def degrade(conn: AsyncConn, instance_id: uuid.UUID, why: str) -> None:
    row = await instance(conn, instance_id)
    await transition(
        conn,
        "instance",
        instance_id,
        "degrade",
        row["state_version"],
        expected_state="ready",
        actor=RECONCILER,
        reason=why,
        patch={"failure_reason": why},
    )


async def test_heal_restarts_a_killed_server_but_never_rebuilds_lost_data(
    conn: AsyncConn, local_settings: Settings
) -> None:
    local = LocalProvisioner(local_settings)
    registry = registry_for(local)
    iid = await ready_instance(conn, local_settings, registry)
    info = credentials(local_settings, await instance(conn, iid))

    pid = local._server(iid).pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    local._server(iid).wait_until_down()
    assert (await local.observe(iid)).running is False
    await degrade(conn, iid, "server not running")
    await enqueue(conn, HEAL, iid)
    await run_until(local_settings, registry, instance_in(iid, "ready"))
    row = await instance(conn, iid)
    assert row["failure_reason"] is None and credentials(local_settings, row) == info
    with connect(info) as customer:
        customer.execute("CREATE TABLE after_restart (x int)")

    shutil.rmtree(local.datadir(iid))
    assert (await local.observe(iid)).data_lost
    await degrade(conn, iid, "data directory missing")
    heal_job = await enqueue(conn, HEAL, iid)
    await run_until(local_settings, registry, job_finished(heal_job["id"]))
    healed = await job(conn, heal_job["id"])
    assert healed["state"] == "abandoned" and "data is lost" in healed["last_error"]
    assert (await instance(conn, iid))["state"] == "degraded"
    assert not (local.datadir(iid) / "PG_VERSION").exists()  # no empty database in its place

    # Accepted (here by an operator): re-created empty, same id, port, role and password.
    await conn.execute("UPDATE instances SET failure_code = 'data_lost' WHERE id = %s", (iid,))
    restore = await enqueue(conn, RESTORE, iid, empty=True, accepted_by="operator:tests")
    await run_until(local_settings, registry, job_finished(restore["id"]))
    row = await instance(conn, iid)
    assert row["state"] == "ready" and credentials(local_settings, row) == info
    assert (await job(conn, restore["id"]))["verdict"] == {
        "result": "ready",
        "restored_from": None,
        "empty": True,
    }
    with connect(info) as customer:
        customer.execute("CREATE TABLE rebuilt (x int)")
    assert [r.kind for r in await local.inventory()] == ["data_directory", "server", "port"]
    assert await audit.verify(conn) == []


async def test_a_permanent_failure_fails_the_instance_and_cleans_up(
    conn: AsyncConn, local_settings: Settings
) -> None:
    local = LocalProvisioner(local_settings)
    faulty = FaultyProvisioner(local, parse_faults("initialize_database:fail_permanent:*"))
    registry = registry_for(faulty)
    iid = (await make_instance(conn))["id"]
    await enqueue(conn, PROVISION, iid)
    await run_until(local_settings, registry, instance_in(iid, "failed"))
    row = await instance(conn, iid)
    assert row["failure_reason"].startswith("provision failed after 1 attempt(s): initialize_database: ")
    assert "injected fault at initialize_database" in row["failure_reason"]
    cursor = await conn.execute("SELECT * FROM jobs WHERE instance_id = %s AND kind = %s", (iid, DEPROVISION))
    cleanup = await cursor.fetchone()
    assert cleanup is not None and cleanup["payload"] == {"cleanup": True, "skip_final_backup": True}
    await run_until(local_settings, registry, job_finished(cleanup["id"]))
    assert (await job(conn, cleanup["id"]))["verdict"]["result"] == "cleaned up"
    assert await local.inventory() == []
    assert not list(local.root.glob("*-*-*-*-*"))
    assert (await instance(conn, iid))["state"] == "failed"
    assert not (Path(local_settings.data_dir) / "backups").exists()
    assert await audit.verify(conn) == []


async def test_a_failed_suspend_lands_in_degraded_and_heal_brings_it_back(
    conn: AsyncConn, local_settings: Settings
) -> None:
    local = LocalProvisioner(local_settings)
    faulty = FaultyProvisioner(local, parse_faults("suspend:fail_permanent:*"))
    registry = registry_for(faulty)
    iid = await ready_instance(conn, local_settings, registry)
    await enqueue(conn, SUSPEND, iid)
    await run_until(local_settings, registry, instance_in(iid, "degraded"))
    row = await instance(conn, iid)
    assert row["failure_reason"].startswith("suspend failed after 1 attempt(s): suspend: injected fault")
    await enqueue(conn, HEAL, iid)
    await run_until(local_settings, registry, instance_in(iid, "ready"))
    with connect(credentials(local_settings, await instance(conn, iid))) as customer:
        customer.execute("CREATE TABLE healed (x int)")
    assert [(f, t) for f, t, _ in await events(conn, iid)][-2:] == [
        ("ready", "degraded"),
        ("degraded", "ready"),
    ]


async def test_a_billing_suspend_whose_hold_was_released_before_it_ran_does_nothing(
    conn: AsyncConn, local_settings: Settings
) -> None:
    registry = registry_for(NoopProvisioner())
    iid = await ready_instance(conn, local_settings, registry)
    stale = await enqueue(conn, SUSPEND, iid, billing=True)
    await run_until(local_settings, registry, job_finished(stale["id"]))
    assert (await job(conn, stale["id"]))["verdict"]["result"] == "nothing to do"
    assert (await instance(conn, iid))["state"] == "ready"
    await conn.execute("UPDATE organisations SET billing_hold = true")
    held = await enqueue(conn, SUSPEND, iid, billing=True)
    await run_until(local_settings, registry, job_finished(held["id"]))
    row = await instance(conn, iid)
    assert row["state"] == "suspended" and row["suspended_by_billing"]


async def test_an_update_onto_one_server_drops_the_read_only_endpoint_from_the_details(
    conn: AsyncConn, local_settings: Settings
) -> None:
    registry = registry_for(NoopProvisioner())
    iid = await ready_instance(conn, local_settings, registry)
    before = (await instance(conn, iid))["connection"]
    # As an HA plan's details were recorded (its standbys' endpoint beside them), now back on dev.
    reads = {"host": "noop.invalid", "port": 5432, "dbname": "app_readonly"}
    await conn.execute(
        "UPDATE instances SET connection = connection || jsonb_build_object('read_only', %s::jsonb),"
        " spec_generation = spec_generation + 1 WHERE id = %s",
        (json.dumps(reads), iid),
    )
    done = await enqueue(conn, UPDATE, iid)
    await run_until(local_settings, registry, job_finished(done["id"]))
    row = await instance(conn, iid)
    assert (row["state"], row["observed_generation"]) == ("ready", 2)
    assert row["connection"] == before and "read_only" not in row["connection"]
