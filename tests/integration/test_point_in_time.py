"""Point-in-time restore into a new instance, from a live or a deleted instance's continuous archive,
and an archive that fails: real servers, real pgBackRest, a real worker, reconciler and API."""

from __future__ import annotations

import os
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import psycopg

from controlplane.audit import verify as audit
from controlplane.db.connection import AsyncConn
from controlplane.runtime.settings import Settings
from controlplane.services import backups
from provisioners.local import LocalProvisioner
from tests.api_support import Tenant, make_tenant
from tests.archive_support import clock, has_backup, window_covers
from tests.console_support import PAGE, signed_in, text_of
from tests.operations_support import Condition, instance, instance_in, ready_instance, registry_for
from tests.provisioning_support import connect, credentials
from tests.reconciler_support import live_jobs, passes_until, reconciling, working
from tests.support import eventually

pytest_plugins = ("tests.api_fixtures",)


def settled(instance_id: uuid.UUID, state: str) -> Condition:
    async def check(conn: AsyncConn) -> bool:
        return await instance_in(instance_id, state)(conn) and not await live_jobs(conn, instance_id)

    return check


def rows(local_settings: Settings, row: Any) -> list[int]:
    with connect(credentials(local_settings, row)) as customer:
        found = customer.execute("SELECT id FROM orders ORDER BY id").fetchall()
    return [r[0] for r in found]


async def restore_into_new(
    local_app: httpx.AsyncClient, who: Tenant, name: str, restore_from: dict[str, Any]
) -> httpx.Response:
    return await local_app.post(
        "/v1/instances", json={"name": name, "plan": "dev", "restore_from": restore_from}, headers=who.headers
    )


async def test_a_moment_of_the_archive_is_restored_into_a_new_instance_exactly(
    conn: AsyncConn, local_settings: Settings, local_app: httpx.AsyncClient
) -> None:
    # Rows A, the moment noted, rows B: that moment restored into a new instance holds exactly A.
    local = LocalProvisioner(local_settings)
    registry = registry_for(local)
    who = await make_tenant(conn)
    source = await ready_instance(conn, local_settings, registry, who.org_id)
    path = f"/v1/instances/{source}/recovery"
    async with reconciling(local_settings, local) as rec, working(local_settings, registry):
        await passes_until(rec, lambda c: has_backup(c, source))
        info = credentials(local_settings, await instance(conn, source))
        with connect(info) as customer:
            # The window opens a second after the first backup ended (its stop time has seconds only).
            earliest = (await backups.window(conn, source)).earliest_at  # type: ignore[union-attr]
            await eventually(lambda: _after(customer, earliest), "the window's start")
            customer.execute("CREATE TABLE orders (id int PRIMARY KEY)")
            customer.execute("INSERT INTO orders SELECT generate_series(1, 5)")  # A
            noted = clock(customer)
            customer.execute("INSERT INTO orders SELECT generate_series(6, 10)")  # B
        await passes_until(rec, window_covers(source, noted))

        shown = (await local_app.get(path, headers=who.headers)).json()
        earliest, latest = datetime.fromisoformat(shown["earliest"]), datetime.fromisoformat(shown["latest"])
        assert earliest <= noted <= latest
        assert shown["archive"]["healthy"] is True and shown["archive"]["lag_s"] >= 0
        assert [b["kind"] for b in shown["backups"]] == ["scheduled"] and "detail" not in shown["archive"]

        # A point outside the window is refused, naming the window.
        for outside in (earliest - timedelta(minutes=5), latest + timedelta(hours=1)):
            refused = await restore_into_new(
                local_app, who, "too-far", {"instance_id": str(source), "point_in_time": outside.isoformat()}
            )
            assert refused.status_code == 422, refused.text
            problem = refused.json()
            assert problem["errors"][0]["field"] == "body.restore_from.point_in_time"
            assert problem["recoverable_window"]["earliest"] == shown["earliest"].replace("+00:00", "Z")
            assert "outside the recoverable window" in problem["detail"]
        # Another organisation cannot name it.
        other = await make_tenant(conn)
        stranger = await restore_into_new(
            local_app, other, "theirs", {"instance_id": str(source), "point_in_time": noted.isoformat()}
        )
        assert stranger.status_code == 404

        created = await restore_into_new(
            local_app, who, "as-of-a", {"instance_id": str(source), "point_in_time": noted.isoformat()}
        )
        assert created.status_code == 202, created.text
        copy = uuid.UUID(created.json()["id"])
        assert created.json()["restore_from"]["point_in_time"] is not None
        await passes_until(rec, settled(copy, "ready"), timeout_s=180)
        # Its own archive runs at once: its first backup is taken, its window opens.
        await passes_until(rec, lambda c: has_backup(c, copy), timeout_s=120)

    assert rows(local_settings, await instance(conn, copy)) == [1, 2, 3, 4, 5]
    assert rows(local_settings, await instance(conn, source)) == list(range(1, 11))
    copied = await instance(conn, copy)
    with connect(credentials(local_settings, copied)) as customer:  # the new owner owns the tables
        customer.execute("INSERT INTO orders VALUES (100)")
    assert await audit.verify(conn) == []


async def _after(customer: psycopg.Connection[Any], moment: datetime | None) -> bool:
    return moment is not None and clock(customer) > moment


async def test_a_deleted_instance_is_restored_into_a_new_one_within_its_retention(
    conn: AsyncConn, local_settings: Settings, local_app: httpx.AsyncClient
) -> None:
    local = LocalProvisioner(local_settings)
    registry = registry_for(local)
    who = await make_tenant(conn)
    gone = await ready_instance(conn, local_settings, registry, who.org_id)
    with connect(credentials(local_settings, await instance(conn, gone))) as customer:
        customer.execute("CREATE TABLE orders (id int PRIMARY KEY)")
        customer.execute("INSERT INTO orders SELECT generate_series(1, 3)")
    async with reconciling(local_settings, local) as rec, working(local_settings, registry):
        deleted = await local_app.delete(f"/v1/instances/{gone}", headers=who.headers)
        assert deleted.status_code == 202, deleted.text
        await passes_until(rec, instance_in(gone, "deleted"), timeout_s=120)
        shown = (await local_app.get(f"/v1/instances/{gone}/recovery", headers=who.headers)).json()
        assert shown["retained_until"] is not None and shown["earliest"] is not None
        assert [b["kind"] for b in shown["backups"]] == ["final"]

        created = await restore_into_new(local_app, who, "undeleted", {"instance_id": str(gone)})
        assert created.status_code == 202, created.text
        back = uuid.UUID(created.json()["id"])
        await passes_until(rec, settled(back, "ready"), timeout_s=180)
        # From its final backup by name, too.
        final = shown["backups"][0]["id"]
        named = await restore_into_new(
            local_app, who, "from-final", {"instance_id": str(gone), "backup": final}
        )
        assert named.status_code == 202, named.text
        await passes_until(rec, settled(uuid.UUID(named.json()["id"]), "ready"), timeout_s=180)
        unknown = await restore_into_new(
            local_app, who, "nothing", {"instance_id": str(gone), "backup": "x1"}
        )
        assert (
            unknown.status_code == 422 and unknown.json()["errors"][0]["field"] == "body.restore_from.backup"
        )

        # The console's page of the deleted database shows its window and restores it the same way.
        csrf = await signed_in(local_app, who.key)
        page = await local_app.get(f"/instances/{gone}", headers=PAGE)
        words = text_of(page.text)
        assert "Restorable from" in words and "Restore to a point in time" in words and final in words
        form = {"csrf_token": csrf, "request_key": "k1", "name": "console-copy", "plan": "dev"}
        too_late = {**form, "point_in_time": (datetime.now(UTC) + timedelta(days=1)).isoformat()}
        refused = await local_app.post(f"/instances/{gone}/restore-to-new", data=too_late, headers=PAGE)
        assert refused.status_code == 422 and "outside the recoverable window" in text_of(refused.text)
        again = {**form, "request_key": "k2"}
        made = await local_app.post(f"/instances/{gone}/restore-to-new", data=again, headers=PAGE)
        assert made.status_code == 303, made.text
        console_copy = uuid.UUID(made.headers["location"].split("/")[2].split("?")[0])
        await passes_until(rec, settled(console_copy, "ready"), timeout_s=180)

    assert rows(local_settings, await instance(conn, back)) == [1, 2, 3]
    assert rows(local_settings, await instance(conn, uuid.UUID(named.json()["id"]))) == [1, 2, 3]
    assert rows(local_settings, await instance(conn, console_copy)) == [1, 2, 3]


async def test_an_archive_that_fails_makes_the_instance_degraded_until_it_works_again(
    conn: AsyncConn, local_settings: Settings, local_app: httpx.AsyncClient, admin_headers: dict[str, str]
) -> None:
    local = LocalProvisioner(local_settings)
    registry = registry_for(local)
    who = await make_tenant(conn)
    iid = await ready_instance(conn, local_settings, registry, who.org_id)
    archive = Path(local.repository.repo) / "archive" / str(iid)
    async with reconciling(local_settings, local) as rec:
        assert (await rec.run_once()).actions == {"enqueue_backup": 1}
        # The repository breaks (unwritable, as a full or failed disk would be); the database goes on.
        mode = os.stat(archive).st_mode
        os.chmod(archive, 0)
        try:
            with connect(credentials(local_settings, await instance(conn, iid))) as customer:
                customer.execute("CREATE TABLE orders (id int)")
                customer.execute("INSERT INTO orders VALUES (1)")
            await passes_until(rec, instance_in(iid, "degraded"))
            row = await instance(conn, iid)
            assert (row["failure_code"], row["state"]) == ("archive_failing", "degraded")
            assert row["failure_reason"].startswith("archive failing: ")
            shown = (await local_app.get(f"/v1/instances/{iid}", headers=who.headers)).json()
            assert shown["failure"]["code"] == "archive_failing" and "archive failing" not in str(shown)
            window = (await local_app.get(f"/v1/instances/{iid}/recovery", headers=who.headers)).json()
            assert window["archive"]["healthy"] is False and window["archive"]["failing_since"] is not None
            sre = await local_app.get(f"/v1/admin/instances/{iid}/recovery", headers=admin_headers)
            assert sre.json()["archive"]["detail"]
            assert {j["kind"] for j in await live_jobs(conn, iid)} >= {"heal"}
        finally:
            os.chmod(archive, mode)
        # Repaired: the heal checks the archive again, and the instance is ready.
        async with working(local_settings, registry):
            await passes_until(rec, settled(iid, "ready"), timeout_s=180)
    window = await backups.window(conn, iid)
    assert window is not None and window.archive_healthy is True
