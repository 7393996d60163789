"""The instance routes against a real database: create, read, list, change, delete, events."""

from __future__ import annotations

import uuid

import httpx

from controlplane.api.models import Instance
from controlplane.audit import verify as audit
from controlplane.db.connection import AsyncConn
from controlplane.queue import steps
from controlplane.runtime.settings import Settings
from controlplane.services import instances
from tests.api_support import Tenant, create, drive, make_ready, ready_patch

pytest_plugins = ("tests.api_fixtures",)


async def _jobs(conn: AsyncConn, instance_id: str) -> list[tuple[str, str]]:
    cursor = await conn.execute(
        "SELECT kind, state FROM jobs WHERE instance_id = %s ORDER BY created_at", (instance_id,)
    )
    return [(r["kind"], r["state"]) for r in await cursor.fetchall()]


async def test_create_returns_pending_with_location_and_provision_job(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn
) -> None:
    response = await client.post(
        "/v1/instances",
        json={"name": "orders", "plan": "dev", "deletion_protection": True},
        headers={**tenant.headers, "X-Request-ID": "req-create-1"},
    )
    assert response.status_code == 202, response.text
    body = response.json()
    assert response.headers["location"] == f"/v1/instances/{body['id']}"
    assert response.headers["etag"] == '"0.1.1.0"'  # state_version, spec_generation, protection, deletion
    assert response.headers["x-request-id"] == "req-create-1"
    assert body["state"] == "pending" and body["state_version"] == 0
    assert body["plan"] == "dev" and body["region"] == "local"
    assert body["connection"] is None and body["deletion_protection"] is True
    assert body["allowed_actions"] == ["resize", "set_deletion_protection"]
    assert body["spec_generation"] == 1 and body["observed_generation"] == 0
    assert body["observed_plan"] is None and body["failed_generation"] is None  # nothing applied yet
    assert body["deadline_at"] is not None and body["time_in_state_s"] >= 0
    assert await _jobs(conn, body["id"]) == [("provision", "queued")]
    cursor = await conn.execute(
        "SELECT request_id, actor_kind FROM instance_events WHERE instance_id = %s", (body["id"],)
    )
    assert await cursor.fetchall() == [{"request_id": "req-create-1", "actor_kind": "customer"}]
    cursor = await conn.execute(
        "SELECT e.request_id FROM job_events e JOIN jobs j ON j.id = e.job_id WHERE j.instance_id = %s",
        (body["id"],),
    )
    assert [r["request_id"] for r in await cursor.fetchall()] == ["req-create-1"]
    # Its progress, known without reading it, is what reading it gives: the job queued, no step run.
    inst = await instances.load(conn, None, uuid.UUID(body["id"]))
    read = (await steps.progress_of(conn, [inst]))[inst.id]
    job_id = await conn.execute("SELECT id FROM jobs WHERE instance_id = %s", (body["id"],))
    assert (
        body["progress"]
        == Instance.model_validate({**body, "progress": read}).model_dump(mode="json")["progress"]
    )
    assert body["progress"]["job_id"] == str((await job_id.fetchone() or {})["id"])
    assert body["progress"]["attempt"] == 0 and body["progress"]["current_step"] is None
    assert {s["state"] for s in body["progress"]["steps"]} == {"pending"}


async def test_request_id_is_generated_when_absent_or_malformed(
    client: httpx.AsyncClient, tenant: Tenant
) -> None:
    response = await client.get("/v1/instances", headers=tenant.headers)
    assert len(response.headers["x-request-id"]) == 32
    response = await client.get("/v1/instances", headers={**tenant.headers, "X-Request-ID": "bad id\t!"})
    assert response.headers["x-request-id"] != "bad id\t!"


async def test_bad_names_and_plans_are_422_naming_the_field(
    client: httpx.AsyncClient, tenant: Tenant
) -> None:
    for body, field in [
        ({"name": "Bad_Name", "plan": "dev"}, "body.name"),
        ({"name": "-x", "plan": "dev"}, "body.name"),
        ({"name": "a" * 64, "plan": "dev"}, "body.name"),
        ({"name": "ok", "plan": "gigantic"}, "body.plan"),
        ({"name": "ok"}, "body.plan"),
        ({"name": "ok", "plan": "dev", "colour": "red"}, "body.colour"),
    ]:
        response = await client.post("/v1/instances", json=body, headers=tenant.headers)
        assert response.status_code == 422, body
        assert response.headers["content-type"] == "application/problem+json"
        problem = response.json()
        assert problem["type"] == "urn:controlplane:problem:validation"
        assert field in problem["detail"] and problem["errors"][0]["field"] == field


async def test_duplicate_live_name_is_409_and_free_again_after_deletion(
    client: httpx.AsyncClient, tenant: Tenant, other_tenant: Tenant, conn: AsyncConn
) -> None:
    first = await create(client, tenant, "orders")
    response = await client.post(
        "/v1/instances", json={"name": "orders", "plan": "small"}, headers=tenant.headers
    )
    assert response.status_code == 409
    assert response.json()["type"] == "urn:controlplane:problem:name-taken"
    await create(client, other_tenant, "orders")  # names are per organisation
    await drive(conn, first["id"], "fail")
    await create(client, tenant, "orders")


async def test_get_shows_connection_with_password_once_ready(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn, api_settings: Settings
) -> None:
    made = await create(client, tenant, "orders")
    await make_ready(conn, api_settings, made["id"], password="s3cret/with:chars")
    response = await client.get(f"/v1/instances/{made['id']}", headers=tenant.headers)
    assert response.status_code == 200
    body = response.json()
    assert response.headers["etag"] == '"2.1.0.0"'
    assert body["state"] == "ready" and body["allowed_actions"] == [
        "resize",
        "set_deletion_protection",
        "delete",
        "backup",
    ]
    assert body["connection"] == {
        "host": "127.0.0.1",
        "port": 15432,
        "dbname": "app",
        "user": "app_owner",
        "password": "s3cret/with:chars",
        "sslmode": None,
        "ca_certificate": None,
        "sslrootcert": None,
        "uri": "postgresql://app_owner:s3cret%2Fwith%3Achars@127.0.0.1:15432/app",
        "pool_mode": None,
        "direct": None,
        "read_only": None,
    }
    listed = (await client.get("/v1/instances", headers=tenant.headers)).json()["items"][0]
    assert listed["connection"]["password"] is None
    assert listed["connection"]["uri"] == "postgresql://app_owner@127.0.0.1:15432/app"


async def test_a_verified_connection_uri_names_the_ca_file_to_save(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn, api_settings: Settings
) -> None:
    """What a customer pastes first names the CA's file: psql then fails with that file's name
    until ca_certificate is saved under it, and connects once it is."""
    made = await create(client, tenant, "orders")
    await make_ready(conn, api_settings, made["id"], password="pw", ca="-----BEGIN CERTIFICATE-----\n")
    got = await client.get(f"/v1/instances/{made['id']}", headers=tenant.headers)
    connection = got.json()["connection"]
    assert connection["sslrootcert"] == "controlplane-ca.pem"
    assert connection["uri"] == (
        "postgresql://app_owner:pw@127.0.0.1:15432/app?sslmode=verify-full&sslrootcert=controlplane-ca.pem"
    )
    listed = (await client.get("/v1/instances", headers=tenant.headers)).json()["items"][0]
    assert listed["connection"]["uri"].endswith("/app?sslmode=verify-full&sslrootcert=controlplane-ca.pem")


async def test_a_pooled_endpoint_says_its_pool_mode_and_gives_the_primary_directly_beside_it(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn, api_settings: Settings
) -> None:
    """An HA plan's stable address is its pooler's (transaction pooling); what needs a whole
    session (LISTEN) connects to the primary's own address, with the same credentials and TLS."""
    made = await create(client, tenant, "orders")
    patch = ready_patch(api_settings, "pw", port=16000, ca="-----BEGIN CERTIFICATE-----\n")
    patch["connection"] |= {
        "pool_mode": "transaction",
        "direct": {"host": "127.0.0.1", "port": 16001},
        "read_only": {"host": "127.0.0.1", "port": 16000, "dbname": "app_readonly"},
    }
    await drive(conn, made["id"], "start_provisioning", "provisioned", **patch)
    connection = (await client.get(f"/v1/instances/{made['id']}", headers=tenant.headers)).json()[
        "connection"
    ]
    query = "?sslmode=verify-full&sslrootcert=controlplane-ca.pem"
    assert (connection["port"], connection["pool_mode"]) == (16000, "transaction")
    assert connection["uri"] == f"postgresql://app_owner:pw@127.0.0.1:16000/app{query}"
    assert connection["direct"] == {
        "host": "127.0.0.1",
        "port": 16001,
        "uri": f"postgresql://app_owner:pw@127.0.0.1:16001/app{query}",
    }
    # The read-only endpoint (its standbys): the pooler's address, its own database name.
    assert connection["read_only"] == {
        "host": "127.0.0.1",
        "port": 16000,
        "dbname": "app_readonly",
        "uri": f"postgresql://app_owner:pw@127.0.0.1:16000/app_readonly{query}",
    }
    listed = (await client.get("/v1/instances", headers=tenant.headers)).json()["items"][0]
    assert listed["connection"]["direct"]["uri"] == f"postgresql://app_owner@127.0.0.1:16001/app{query}"
    assert (
        listed["connection"]["read_only"]["uri"]
        == f"postgresql://app_owner@127.0.0.1:16000/app_readonly{query}"
    )


async def test_unknown_instance_is_404_problem(client: httpx.AsyncClient, tenant: Tenant) -> None:
    response = await client.get(f"/v1/instances/{uuid.uuid4()}", headers=tenant.headers)
    assert response.status_code == 404
    problem = response.json()
    assert problem["type"] == "urn:controlplane:problem:not-found" and problem["status"] == 404
    assert problem["title"] and problem["instance"].startswith("/v1/instances/")


async def test_list_filters_by_state_and_paginates_stably(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn
) -> None:
    made = [await create(client, tenant, f"db-{i}") for i in range(7)]
    await drive(conn, made[2]["id"], "fail")
    failed = (await client.get("/v1/instances?state=failed", headers=tenant.headers)).json()
    assert [i["id"] for i in failed["items"]] == [made[2]["id"]] and failed["next_cursor"] is None
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        params = {"limit": "3", **({"cursor": cursor} if cursor else {})}
        page = (await client.get("/v1/instances", params=params, headers=tenant.headers)).json()
        seen += [i["id"] for i in page["items"]]
        pages += 1
        if pages == 1:
            await create(client, tenant, "db-late")  # appears at the end, not in the middle
            await drive(conn, made[0]["id"], "fail")  # a change does not move an item between pages
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert seen == [m["id"] for m in made] + [seen[-1]] and len(set(seen)) == 8
    response = await client.get("/v1/instances?limit=1000", headers=tenant.headers)
    assert len(response.json()["items"]) == 8  # capped at 100, so all fit
    response = await client.get("/v1/instances?cursor=not-a-cursor", headers=tenant.headers)
    assert response.status_code == 422 and "query.cursor" in response.json()["detail"]
    response = await client.get("/v1/instances?state=sleeping", headers=tenant.headers)
    assert response.status_code == 422 and "query.state" in response.json()["detail"]


async def test_patch_plan_bumps_generation_and_enqueues_update_only_when_ready(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn, api_settings: Settings
) -> None:
    made = await create(client, tenant, "orders")
    response = await client.patch(
        f"/v1/instances/{made['id']}", json={"plan": "small"}, headers=tenant.headers
    )
    assert response.status_code == 202
    assert response.json()["spec_generation"] == 2 and response.json()["plan"] == "small"
    assert await _jobs(conn, made["id"]) == [("provision", "queued")]  # pending: intent only
    await make_ready(conn, api_settings, made["id"])
    response = await client.patch(
        f"/v1/instances/{made['id']}",
        json={"plan": "medium"},
        headers={**tenant.headers, "If-Match": '"2.2.0.0"'},
    )
    assert response.status_code == 202 and response.json()["spec_generation"] == 3
    assert ("update", "queued") in await _jobs(conn, made["id"])
    cursor = await conn.execute(
        "SELECT payload FROM jobs WHERE instance_id = %s AND kind = 'update'", (made["id"],)
    )
    assert (await cursor.fetchone()) == {"payload": {"spec_generation": 3}}
    same = await client.patch(f"/v1/instances/{made['id']}", json={"plan": "medium"}, headers=tenant.headers)
    assert same.status_code == 202 and same.json()["spec_generation"] == 3  # no change, no bump
    assert same.json()["failed_generation"] is None


async def test_patch_asks_again_for_a_plan_whose_update_was_given_up(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn, api_settings: Settings
) -> None:
    made = await create(client, tenant, "orders")
    await make_ready(conn, api_settings, made["id"])
    # Generation 2 (plan small) was given up: the update job abandoned, the instance recovered.
    await conn.execute(
        'UPDATE instances SET spec = spec || \'{"plan": "small"}\', spec_generation = 2,'
        " failed_generation = 2 WHERE id = %s",
        (made["id"],),
    )
    shown = (await client.get(f"/v1/instances/{made['id']}", headers=tenant.headers)).json()
    assert (shown["plan"], shown["spec_generation"], shown["failed_generation"]) == ("small", 2, 2)
    assert shown["observed_plan"] == "dev"  # what it runs
    again = await client.patch(f"/v1/instances/{made['id']}", json={"plan": "small"}, headers=tenant.headers)
    assert again.status_code == 202
    assert (again.json()["spec_generation"], again.json()["failed_generation"]) == (3, 2)
    cursor = await conn.execute(
        "SELECT payload FROM jobs WHERE instance_id = %s AND kind = 'update'", (made["id"],)
    )
    assert (await cursor.fetchone()) == {"payload": {"spec_generation": 3}}
    # Generation 3 is not given up: the same plan once more changes nothing.
    same = await client.patch(f"/v1/instances/{made['id']}", json={"plan": "small"}, headers=tenant.headers)
    assert same.json()["spec_generation"] == 3


async def test_patch_if_match_mismatch_is_412(client: httpx.AsyncClient, tenant: Tenant) -> None:
    made = await create(client, tenant, "orders")
    response = await client.patch(
        f"/v1/instances/{made['id']}", json={"plan": "small"}, headers={**tenant.headers, "If-Match": '"7"'}
    )
    assert response.status_code == 412
    assert response.json()["type"] == "urn:controlplane:problem:precondition-failed"
    for tag in ('"0.1.0.0"', 'W/"0.1.1.0"', "*", '"7", 0.1.0.0'):
        ok = await client.patch(
            f"/v1/instances/{made['id']}",
            json={"deletion_protection": tag != "*"},
            headers={**tenant.headers, "If-Match": tag},
        )
        assert ok.status_code == 202, tag


async def test_patch_on_terminal_instance_is_409_with_state_and_actions(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn
) -> None:
    made = await create(client, tenant, "orders")
    await drive(conn, made["id"], "fail")
    response = await client.patch(
        f"/v1/instances/{made['id']}", json={"plan": "small"}, headers=tenant.headers
    )
    assert response.status_code == 409
    problem = response.json()
    assert problem["type"] == "urn:controlplane:problem:invalid-state"
    # A failed instance changes no more: it can only be retried (a new one) or deleted (archived).
    assert problem["current_state"] == "failed" and problem["allowed_actions"] == ["retry", "delete"]


async def test_delete_protected_is_409_then_allowed_after_unprotecting(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn, api_settings: Settings
) -> None:
    made = await create(client, tenant, "orders", deletion_protection=True)
    await make_ready(conn, api_settings, made["id"])
    response = await client.delete(f"/v1/instances/{made['id']}", headers=tenant.headers)
    assert response.status_code == 409
    problem = response.json()
    assert problem["type"] == "urn:controlplane:problem:deletion-protected"
    assert problem["current_state"] == "ready" and "delete" not in problem["allowed_actions"]
    await client.patch(
        f"/v1/instances/{made['id']}", json={"deletion_protection": False}, headers=tenant.headers
    )
    response = await client.delete(
        f"/v1/instances/{made['id']}?skip_final_backup=true", headers=tenant.headers
    )
    assert response.status_code == 202
    assert response.json()["deletion_requested"] is True and response.json()["allowed_actions"] == []
    assert ("deprovision", "queued") in await _jobs(conn, made["id"])
    cursor = await conn.execute(
        "SELECT payload FROM jobs WHERE instance_id = %s AND kind = 'deprovision'", (made["id"],)
    )
    assert (await cursor.fetchone()) == {"payload": {"skip_final_backup": True}}
    cursor = await conn.execute("SELECT skip_final_backup FROM instances WHERE id = %s", (made["id"],))
    assert (await cursor.fetchone()) == {"skip_final_backup": True}
    again = await client.delete(f"/v1/instances/{made['id']}", headers=tenant.headers)
    assert again.status_code == 202  # idempotent
    assert [k for k, _ in await _jobs(conn, made["id"])].count("deprovision") == 1


async def test_delete_of_pending_records_the_intent_only(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn
) -> None:
    made = await create(client, tenant, "orders")
    response = await client.delete(f"/v1/instances/{made['id']}", headers=tenant.headers)
    assert response.status_code == 202
    assert response.json()["state"] == "pending" and response.json()["deletion_requested"] is True
    assert await _jobs(conn, made["id"]) == [("provision", "queued")]
    cursor = await conn.execute(
        "SELECT deletion_requested_at IS NOT NULL AS requested, skip_final_backup"
        " FROM instances WHERE id = %s",
        (made["id"],),
    )
    assert (await cursor.fetchone()) == {"requested": True, "skip_final_backup": False}
    response = await client.patch(
        f"/v1/instances/{made['id']}", json={"plan": "small"}, headers=tenant.headers
    )
    assert response.status_code == 409 and "deletion" in response.json()["detail"]


async def test_delete_of_deleted_is_409_naming_the_state(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn
) -> None:
    made = await create(client, tenant, "orders")
    await drive(conn, made["id"], "start_provisioning", "provisioned", "deprovision", "deprovisioned")
    response = await client.delete(f"/v1/instances/{made['id']}", headers=tenant.headers)
    assert response.status_code == 409
    assert response.json()["current_state"] == "deleted" and "deleted" in response.json()["detail"]


async def test_events_are_the_audit_log_oldest_first_with_cursor(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn, api_settings: Settings
) -> None:
    made = await create(client, tenant, "orders")
    await make_ready(conn, api_settings, made["id"])
    first = (await client.get(f"/v1/instances/{made['id']}/events?limit=2", headers=tenant.headers)).json()
    assert [e["to_state"] for e in first["items"]] == ["pending", "provisioning"]
    assert first["items"][0]["actor"]["kind"] == "customer" and first["items"][0]["from_state"] is None
    rest = (
        await client.get(
            f"/v1/instances/{made['id']}/events",
            params={"cursor": first["next_cursor"]},
            headers=tenant.headers,
        )
    ).json()
    assert [e["event"] for e in rest["items"]] == ["provisioned"] and rest["next_cursor"] is None
    assert set(rest["items"][0]) == {
        "id",
        "at",
        "from_state",
        "to_state",
        "event",
        "label",
        "actor",
        "reason",
        "detail",
        "seq",
        "hash",
    }
    assert rest["items"][0]["label"] == "Created"
    # The instance's chain as the API shows it: seq 0, 1, 2, each hash the one in the log.
    assert [e["seq"] for e in first["items"] + rest["items"]] == [0, 1, 2]
    cursor = await conn.execute(
        "SELECT hash FROM instance_events WHERE instance_id = %s ORDER BY seq", (made["id"],)
    )
    stored = [bytes(row["hash"]).hex() for row in await cursor.fetchall()]
    assert [e["hash"] for e in first["items"] + rest["items"]] == stored
    assert await audit.verify(conn) == []


async def test_lifecycle_and_plans_are_public(client: httpx.AsyncClient) -> None:
    tables = (await client.get("/v1/lifecycle")).json()
    assert len(tables["instance"]["transitions"]) == 18 and len(tables["job"]["transitions"]) == 11
    assert set(tables["customer_actions"]) == {
        "resize",
        "set_deletion_protection",
        "delete",
        "backup",
        "restore",
        "retry",
    }
    plans = (await client.get("/v1/plans")).json()["items"]
    assert {"dev", "small"} <= {p["name"] for p in plans}
    by_name = {p["name"]: p for p in plans}
    assert (by_name["dev"]["instances"], by_name["dev"]["storage_gb"]) == (1, 1)
    assert by_name["medium"]["instances"] == 3 and by_name["medium"]["memory"] == "1Gi"
    dev = next(p for p in plans if p["name"] == "dev")
    assert dev["backups"] == {"interval_s": 86400.0, "keep": 3, "full_every": 1}


async def test_the_etag_covers_the_spec_and_flags_so_two_changes_against_one_etag_cannot_both_win(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn, api_settings: Settings
) -> None:
    made = await create(client, tenant, "orders")
    await make_ready(conn, api_settings, made["id"])
    path = f"/v1/instances/{made['id']}"
    seen = (await client.get(path, headers=tenant.headers)).headers["etag"]
    # Two clients read the same ETag and change the plan: the second one did not see the first.
    first = await client.patch(path, json={"plan": "small"}, headers={**tenant.headers, "If-Match": seen})
    second = await client.patch(path, json={"plan": "medium"}, headers={**tenant.headers, "If-Match": seen})
    assert first.status_code == 202 and first.headers["etag"] != seen
    assert second.status_code == 412, second.text
    assert second.headers["content-type"] == "application/problem+json"
    shown = await client.get(path, headers=tenant.headers)
    assert shown.json()["plan"] == "small" and shown.json()["state_version"] == 2  # no transition moved
    # Deletion protection moves it too (it is not a transition either), and so does a deletion.
    now = shown.headers["etag"]
    protect = await client.patch(
        path, json={"deletion_protection": True}, headers={**tenant.headers, "If-Match": now}
    )
    assert protect.status_code == 202 and protect.headers["etag"] != now
    stale = await client.patch(
        path, json={"deletion_protection": False}, headers={**tenant.headers, "If-Match": now}
    )
    assert stale.status_code == 412
    assert (await client.get(path, headers=tenant.headers)).json()["deletion_protection"] is True
    unprotect = await client.patch(
        path,
        json={"deletion_protection": False},
        headers={**tenant.headers, "If-Match": protect.headers["etag"]},
    )
    deleted = await client.delete(path, headers={**tenant.headers, "If-Match": unprotect.headers["etag"]})
    assert deleted.status_code == 202 and deleted.headers["etag"] != unprotect.headers["etag"]


async def test_if_none_match_answers_304_while_the_instance_is_unchanged(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn, api_settings: Settings
) -> None:
    made = await create(client, tenant, "orders")
    path = f"/v1/instances/{made['id']}"
    tag = (await client.get(path, headers=tenant.headers)).headers["etag"]
    for asked in (tag, f'"other", {tag}', f"W/{tag}", "*"):
        unchanged = await client.get(path, headers={**tenant.headers, "If-None-Match": asked})
        assert unchanged.status_code == 304, asked
        assert unchanged.content == b"" and unchanged.headers["etag"] == tag
    await client.patch(path, json={"plan": "small"}, headers=tenant.headers)
    changed = await client.get(path, headers={**tenant.headers, "If-None-Match": tag})
    assert changed.status_code == 200 and changed.json()["plan"] == "small"
    assert changed.headers["etag"] != tag


async def test_a_response_carrying_a_password_is_never_stored_by_a_cache(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn, api_settings: Settings
) -> None:
    made = await create(client, tenant, "orders")
    path = f"/v1/instances/{made['id']}"
    assert "cache-control" not in (await client.get(path, headers=tenant.headers)).headers  # no password yet
    await make_ready(conn, api_settings, made["id"], password="s3cret")
    shown = await client.get(path, headers=tenant.headers)
    assert shown.json()["connection"]["password"] == "s3cret"
    assert shown.headers["cache-control"] == "no-store"
    # The keys a request creates are secrets too: shown once, never stored.
    key = await client.post("/v1/keys", json={"name": "ci"}, headers=tenant.headers)
    assert key.status_code == 201 and key.headers["cache-control"] == "no-store"


async def test_a_restore_once_the_deletion_was_requested_is_refused(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn, api_settings: Settings
) -> None:
    """A lost instance's DELETE, then its restore: 409 (its allowed_actions are empty), no job."""
    made = await create(client, tenant, "lost")
    await make_ready(conn, api_settings, made["id"])
    await drive(conn, made["id"], "degrade", failure_code="data_lost", failure_reason="data lost: gone")
    path = f"/v1/instances/{made['id']}"
    assert "restore" in (await client.get(path, headers=tenant.headers)).json()["allowed_actions"]
    assert (await client.delete(path, headers=tenant.headers)).status_code == 202
    shown = (await client.get(path, headers=tenant.headers)).json()
    assert (shown["state"], shown["allowed_actions"]) == ("degraded", [])
    refused = await client.post(f"{path}/restore", json={"empty": True}, headers=tenant.headers)
    assert refused.status_code == 409, refused.text
    assert refused.headers["content-type"] == "application/problem+json"
    assert "its deletion has been requested" in refused.json()["detail"]
    cursor = await conn.execute("SELECT kind FROM jobs WHERE instance_id = %s ORDER BY kind", (made["id"],))
    assert [row["kind"] for row in await cursor.fetchall()] == ["deprovision", "provision"]  # no restore


async def test_a_202_is_not_settled_until_its_own_change_is_done(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn, api_settings: Settings
) -> None:
    """A client waits for its change (the PATCH's generation, the DELETE's end), not for `ready`,
    which the instance still is when the change is accepted."""
    made = await create(client, tenant, "orders")
    assert made["settled"] is False  # pending
    await make_ready(conn, api_settings, made["id"])
    one = f"/v1/instances/{made['id']}"
    assert (await client.get(one, headers=tenant.headers)).json()["settled"] is True
    protected = (await client.patch(one, json={"deletion_protection": True}, headers=tenant.headers)).json()
    assert protected["settled"] is True and protected["spec_generation"] == 1  # done at once
    await client.patch(one, json={"deletion_protection": False}, headers=tenant.headers)
    resized = await client.patch(one, json={"plan": "small"}, headers=tenant.headers)
    body = resized.json()
    assert resized.status_code == 202 and body["state"] == "ready"  # still ready: that is not the news
    assert body["settled"] is False and (body["spec_generation"], body["observed_generation"]) == (2, 1)
    await drive(conn, made["id"], "update")
    assert (await client.get(one, headers=tenant.headers)).json()["settled"] is False  # updating
    await drive(conn, made["id"], "updated", observed_generation=2, observed_spec={"plan": "small"})
    applied = (await client.get(one, headers=tenant.headers)).json()
    assert applied["settled"] is True and applied["observed_generation"] == 2
    deleting = (await client.delete(one, headers=tenant.headers)).json()
    assert deleting["state"] == "ready" and deleting["settled"] is False  # the deletion waits to run
    await drive(conn, made["id"], "deprovision")
    await drive(conn, made["id"], "deprovisioned")
    assert (await client.get(one, headers=tenant.headers)).json()["settled"] is True  # deleted
