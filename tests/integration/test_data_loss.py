"""A lost data directory is never healed into an empty database that says `ready`: the instance is
degraded with the code data_lost, the loss is audited and counted, and it comes back only with its
data: restored to the end of its continuous archive (from the newest backup held, replaying every
WAL segment archived since), or as someone decides (a backup, or empty, accepted explicitly).
Real servers, a real worker and reconciler, real pgBackRest."""

from __future__ import annotations

import shutil
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from controlplane.api.app import create_app
from controlplane.audit import verify as audit
from controlplane.core import metering
from controlplane.core.kinds import HEAL, RESTORE
from controlplane.db.connection import AsyncConn
from controlplane.queue.registry import JobRegistry
from controlplane.runtime import metrics
from controlplane.runtime.settings import Settings
from controlplane.services import backups, usage
from provisioners.base import ConnectionInfo, DataLost, InstanceSpec, RestorePoint
from provisioners.local import LocalProvisioner
from tests.api_support import Tenant, make_ready, make_tenant
from tests.archive_support import archived_through, clock
from tests.factories import make_instance
from tests.operations_support import Condition, instance, instance_in, ready_instance, registry_for
from tests.provisioning_support import connect, credentials, real_instances
from tests.reconciler_support import instance_events, live_jobs, passes_until, reconciling, working

pytest_plugins = ("tests.api_fixtures",)

DEV = InstanceSpec("dev", 1)


def recovered(instance_id: uuid.UUID) -> Condition:
    async def check(conn: AsyncConn) -> bool:
        return await instance_in(instance_id, "ready")(conn) and not await live_jobs(conn, instance_id)

    return check


def held_backups(instance_id: uuid.UUID, count: int) -> Condition:
    """`count` backups are held and the job that took the last is over (it records the backup,
    then finishes: asking for another before that finds it under way)."""

    async def check(conn: AsyncConn) -> bool:
        held = len(await backups.held(conn, instance_id, limit=100)) >= count
        return held and not await live_jobs(conn, instance_id)

    return check


async def reasons(conn: AsyncConn, instance_id: uuid.UUID, event: str) -> list[str]:
    cursor = await conn.execute(
        "SELECT reason FROM instance_events WHERE instance_id = %s AND event = %s ORDER BY id",
        (instance_id, event),
    )
    return [row["reason"] for row in await cursor.fetchall()]


async def ready_with_kept_rows(
    conn: AsyncConn, settings: Settings, *rows: int
) -> tuple[LocalProvisioner, JobRegistry, Tenant, uuid.UUID, ConnectionInfo]:
    """A ready dev instance of a new tenant on the local provisioner, its table `kept` holding
    `rows`: the provisioner, the registry that runs its jobs, the tenant, its id and credentials."""
    local = LocalProvisioner(settings)
    registry = registry_for(local)
    who = await make_tenant(conn)
    iid = await ready_instance(conn, settings, registry, who.org_id)
    info = credentials(settings, await instance(conn, iid))
    with connect(info) as customer:
        customer.execute("CREATE TABLE kept (x int)")
        for row in rows:
            customer.execute("INSERT INTO kept VALUES (%s)", (row,))
    return local, registry, who, iid, info


async def test_a_lost_data_directory_is_restored_to_the_end_of_its_archive(
    conn: AsyncConn, local_settings: Settings, local_app: httpx.AsyncClient
) -> None:
    # Rows A before the first backup, B and C after it: once the archive has caught up with C, the
    # data directory goes, and the instance comes back ready with A, B and C, by itself.
    local, registry, who, iid, info = await ready_with_kept_rows(conn, local_settings, 1, 2)

    async with reconciling(local_settings, local) as rec:
        # The first backup is taken at once (a restore starts from one), then on the plan's schedule.
        assert (await rec.run_once()).actions == {"enqueue_backup": 1}
        async with working(local_settings, registry):
            await passes_until(rec, held_backups(iid, 1))
            # And one on demand (asked twice: one backup job).
            path = f"/v1/instances/{iid}/backups"
            asked = [(await local_app.post(path, headers=who.headers)).json() for _ in range(2)]
            assert [a["created"] for a in asked] == [True, False] and asked[0]["job_id"] == asked[1]["job_id"]
            await passes_until(rec, held_backups(iid, 2))
        newest = (await backups.held(conn, iid, limit=1))[0].taken_at
        assert (await rec.run_once(newest + timedelta(hours=23))).actions == {}  # the dev plan: daily
        listed = (await local_app.get(path, headers=who.headers)).json()["items"]
        assert [b["kind"] for b in listed] == ["on_demand", "scheduled"] and listed[0]["size_bytes"] > 0
        assert [b["type"] for b in listed] == ["full", "full"]  # dev: a full backup every day
        assert "location" not in listed[0]  # where it is kept is for SREs only
        paged = (await local_app.get(path, params={"limit": 1}, headers=who.headers)).json()
        rest = (
            await local_app.get(path, params={"cursor": paged["next_cursor"]}, headers=who.headers)
        ).json()
        assert [b["id"] for b in paged["items"] + rest["items"]] == [b["id"] for b in listed]

        with connect(info) as customer:
            customer.execute("INSERT INTO kept VALUES (3)")  # B
            customer.execute("CREATE TABLE written_after_the_backups (x int)")
            customer.execute("INSERT INTO written_after_the_backups VALUES (4)")  # C
            written = clock(customer)
        # The archive catches up with C (a segment is closed within a second of a write).
        await passes_until(rec, archived_through(iid, written))

        # The data directory removed behind the control plane's back.
        shutil.rmtree(local.datadir(iid))
        lost_before = metrics.DATA_LOSS._value.get()
        async with working(local_settings, registry):
            summary = await rec.run_once()
            assert summary.actions["degrade"] == 1 and summary.actions["enqueue_restore"] == 1
            assert metrics.DATA_LOSS._value.get() == lost_before + 1
            assert await reasons(conn, iid, "degrade") == ["data lost: data directory missing"]
            await passes_until(rec, recovered(iid))

    row = await instance(conn, iid)
    assert (row["state"], row["failure_code"], row["failure_reason"]) == ("ready", None, None)
    cursor = await conn.execute(
        "SELECT reason, detail FROM instance_events WHERE instance_id = %s AND event = 'recover'", (iid,)
    )
    (recovery,) = await cursor.fetchall()
    assert recovery["reason"].startswith("restored to the end of its continuous archive")
    assert recovery["reason"].endswith("; 0 s of writes before the loss could not be recovered (by policy)")
    detail = recovery["detail"]
    assert (detail["code"], detail["restored_from"], detail["seconds_lost"]) == ("data_lost", "archive", 0)
    assert datetime.fromisoformat(detail["recovered_to"]) <= written
    with connect(credentials(local_settings, row)) as customer:
        assert customer.execute("SELECT array_agg(x ORDER BY x) FROM kept").fetchone() == ([1, 2, 3],)
        assert customer.execute("SELECT x FROM written_after_the_backups").fetchall() == [(4,)]
    # The time it spent degraded for its lost data, with no server, is billed as storage only.
    cursor = await conn.execute(
        "SELECT event, at, detail FROM instance_events"
        " WHERE instance_id = %s AND event IN ('degrade', 'recover') ORDER BY id",
        (iid,),
    )
    degrade, recover = await cursor.fetchall()
    assert degrade["detail"] == {"code": "data_lost"}
    created = row["created_at"]
    lines = await usage.usage_of_org(conn, who.org_id, created, recover["at"], now=recover["at"])
    totals = metering.totals_by(lines, "billing")
    assert totals[("storage_only",)] == pytest.approx((recover["at"] - degrade["at"]).total_seconds())
    billed = (degrade["at"] - row["created_at"]).total_seconds() - totals[("not_billed",)]
    assert totals[("billed",)] == pytest.approx(billed)
    assert await audit.verify(conn) == []


async def test_a_backup_its_repository_holds_but_no_record_names_still_restores_lost_data(
    conn: AsyncConn, local_settings: Settings
) -> None:
    # A backup job interrupted between its backup and its record (the control plane's database
    # away): the repository holds the backup and the recorded window starts at it, but no backup
    # row names it. The loss of the data directory is restored all the same, and the restore
    # records what the repository holds before it starts.
    local, registry, _, iid, info = await ready_with_kept_rows(conn, local_settings, 1)
    async with reconciling(local_settings, local) as rec:
        async with working(local_settings, registry):
            await rec.run_once()
            await passes_until(rec, held_backups(iid, 1))
        with connect(info) as customer:
            customer.execute("INSERT INTO kept VALUES (2)")
            written = clock(customer)
        await passes_until(rec, archived_through(iid, written))
        await conn.execute("DELETE FROM backups WHERE instance_id = %s", (iid,))
        assert await backups.held(conn, iid, limit=1) == []

        shutil.rmtree(local.datadir(iid))
        async with working(local_settings, registry):
            summary = await rec.run_once()
            assert summary.actions["degrade"] == 1 and summary.actions["enqueue_restore"] == 1
            await passes_until(rec, recovered(iid))
    assert len(await backups.held(conn, iid, limit=10)) == 1  # recorded by the restore
    with connect(credentials(local_settings, await instance(conn, iid))) as customer:
        assert customer.execute("SELECT array_agg(x ORDER BY x) FROM kept").fetchone() == ([1, 2],)


async def test_without_a_backup_lost_data_waits_for_an_explicit_audited_decision(
    conn: AsyncConn, local_settings: Settings, local_app: httpx.AsyncClient
) -> None:
    local = LocalProvisioner(local_settings)
    registry = registry_for(local)
    who: Tenant = await make_tenant(conn)
    iid = await ready_instance(conn, local_settings, registry, who.org_id)
    with connect(credentials(local_settings, await instance(conn, iid))) as customer:
        customer.execute("CREATE TABLE precious (x int)")

    async with reconciling(local_settings, local) as rec:
        shutil.rmtree(local.datadir(iid))
        assert (await rec.run_once()).actions == {"degrade": 1}
        # Never healed into an empty database: pass after pass, nothing is done by itself.
        async with working(local_settings, registry):
            for _ in range(3):
                assert (await rec.run_once()).actions == {}
        assert await live_jobs(conn, iid) == []
        cursor = await conn.execute(
            "SELECT count(*) AS n FROM jobs WHERE instance_id = %s AND kind = %s", (iid, HEAL)
        )
        assert (await cursor.fetchone() or {})["n"] == 0
        assert not (local.datadir(iid) / "PG_VERSION").exists()

        shown = (await local_app.get(f"/v1/instances/{iid}", headers=who.headers)).json()
        assert (shown["state"], shown["failure_code"]) == ("degraded", "data_lost")
        assert "restore" in shown["allowed_actions"] and "backup" not in shown["allowed_actions"]

        path = f"/v1/instances/{iid}/restore"
        newest = await local_app.post(path, json={}, headers=who.headers)
        assert newest.status_code == 409 and "no backup" in newest.json()["detail"]
        unknown = await local_app.post(path, json={"backup_id": "20200101T000000000Z"}, headers=who.headers)
        assert unknown.status_code == 422 and unknown.json()["errors"][0]["field"] == "body.backup_id"
        both = await local_app.post(path, json={"backup_id": "x", "empty": True}, headers=who.headers)
        assert both.status_code == 422
        other = await make_tenant(conn)
        assert (await local_app.post(path, json={"empty": True}, headers=other.headers)).status_code == 404

        accepted = await local_app.post(
            path, json={"empty": True, "reason": "no copy exists"}, headers=who.headers
        )
        assert accepted.status_code == 202, accepted.text
        again = await local_app.post(path, json={"empty": True}, headers=who.headers)
        assert again.status_code == 409 and "already under way" in again.json()["detail"]
        async with working(local_settings, registry):
            await passes_until(rec, recovered(iid))

    row = await instance(conn, iid)
    key_id = str(
        (
            await (await conn.execute("SELECT id FROM api_keys WHERE org_id = %s", (who.org_id,))).fetchone()
            or {}
        )["id"]
    )
    (recovery,) = await reasons(conn, iid, "recover")
    assert (
        recovery == f"re-initialised empty: the loss of its data was accepted (decided by customer:{key_id})"
    )
    cursor = await conn.execute(
        "SELECT e.actor_kind, e.actor_id, j.payload FROM job_events e JOIN jobs j ON j.id = e.job_id"
        " WHERE j.instance_id = %s AND j.kind = %s AND e.event = 'enqueue'",
        (iid, RESTORE),
    )
    (enqueued,) = await cursor.fetchall()
    assert (enqueued["actor_kind"], enqueued["actor_id"]) == ("customer", key_id)
    assert enqueued["payload"]["reason"] == "no copy exists"
    with connect(credentials(local_settings, row)) as customer:  # empty, as accepted
        assert customer.execute("SELECT to_regclass('precious')").fetchone() == (None,)
    # The data is back (empty): no more restore to accept.
    done = await local_app.post(f"/v1/instances/{iid}/restore", json={"empty": True}, headers=who.headers)
    assert done.status_code == 409
    assert [(f, t) for f, t, _, _ in await instance_events(conn, iid)][3:] == [
        ("ready", "degraded"),
        ("degraded", "ready"),
    ]
    assert await audit.verify(conn) == []


async def test_the_local_provisioner_backs_up_expires_and_restores_a_lost_instance_directory(
    pg_root: Path,
) -> None:
    with real_instances(pg_root, local_archive_timeout_s=1) as settings:
        local = LocalProvisioner(settings)
        iid = uuid.uuid4()
        await local.allocate_storage(iid, DEV, 1)
        await local.configure_network(iid, DEV, 1)
        info = await local.initialize_database(iid, DEV, 1)
        await local.configure_archive(iid, DEV, 1)
        with connect(info) as customer:
            customer.execute("CREATE TABLE t1 (x int)")
        first = await local.take_backup(iid, DEV, 2, kind="scheduled")
        with connect(info) as customer:
            customer.execute("CREATE TABLE t2 (x int)")
        second = await local.take_backup(iid, DEV, 2, kind="on_demand")
        later = [await local.take_backup(iid, DEV, 2, kind="scheduled") for _ in range(2)]
        # Retention: the dev plan keeps 3 full backups, the oldest goes (pgBackRest expires it).
        held = await local.list_backups(iid)
        assert [b.name for b in held] == [second.name, *(b.name for b in later)]
        assert (held[0].kind, held[0].type) == ("on_demand", "full") and first.name not in {
            b.name for b in held
        }
        with connect(info) as customer:
            customer.execute("CREATE TABLE t3 (x int)")

        # The whole instance directory goes, its state (and the admin password) with it; a backup
        # chosen by name brings it back as it was then (its stanza's record knows the password).
        shutil.rmtree(local.instance_dir(iid))
        seen = await local.observe(iid)
        assert seen.data_lost and not seen.exists
        with pytest.raises(DataLost):
            await local.allocate_storage(iid, DEV, 3)
        restored = await local.restore(iid, DEV, 3, point=RestorePoint(backup=second.name))
        assert restored.backup == second.name
        await local.configure_network(iid, DEV, 3)
        again = await local.initialize_database(iid, DEV, 3, password=info.password)
        assert (again.port, again.user, again.password) == (info.port, info.user, info.password)
        await local.configure_archive(iid, DEV, 3)
        with connect(again) as customer:
            tables = customer.execute(
                "SELECT relname FROM pg_class WHERE relname LIKE 't_' ORDER BY 1"
            ).fetchall()
            assert tables == [("t1",), ("t2",)]
        assert (await local.observe(iid)).healthy

        # Deleting the instance takes a final backup; the archive and backups stay for the retention.
        result = await local.deprovision(iid, DEV, 4)
        assert result.backup is not None and result.backup in {
            b.location for b in await local.list_backups(iid)
        }
        window = await local.recovery_window(iid)
        assert window is not None and window.retained_until is not None
        assert await local.expire(iid) is False  # not yet
        # Once the retention ran out, the maintenance removes the stanza: nothing is left.
        assert local.backups.expire(iid, datetime.now(UTC) + timedelta(days=30)) is True
        assert await local.list_backups(iid) == [] and await local.recovery_window(iid) is None

        # A deletion that skips its final backup keeps nothing.
        other = uuid.uuid4()
        await local.allocate_storage(other, DEV, 5)
        await local.configure_network(other, DEV, 5)
        await local.initialize_database(other, DEV, 5)
        await local.configure_archive(other, DEV, 5)
        assert local.repository.has_stanza(other)
        await local.deprovision(other, DEV, 6, skip_backup=True)
        assert not local.repository.has_stanza(other) and await local.recovery_window(other) is None


async def test_backups_are_refused_where_the_provisioner_takes_none(
    conn: AsyncConn, local_settings: Settings
) -> None:
    who = await make_tenant(conn)
    iid = (await make_instance(conn, who.org_id))["id"]
    await make_ready(conn, local_settings, iid)
    application = create_app(local_settings.replace(provisioner="noop"))
    async with application.router.lifespan_context(application):
        transport = httpx.ASGITransport(app=application, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            refused = await http.post(f"/v1/instances/{iid}/backups", headers=who.headers)
            assert refused.status_code == 409 and "takes no backups" in refused.json()["detail"]
            assert (await http.get("/v1/ca.pem")).status_code == 404  # and issues no certificates
    assert await live_jobs(conn, iid) == []
