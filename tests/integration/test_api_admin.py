"""SRE routes: the audit log with filters, jobs and operator actions, dwell statistics, health."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from psycopg.rows import DictRow

from controlplane.api.app import create_app
from controlplane.audit import verify as audit
from controlplane.db.connection import AsyncConn
from controlplane.db.transitions import Actor, transition
from controlplane.queue import moves as queue
from controlplane.queue.registry import JobKind, JobRegistry
from controlplane.runtime.settings import Settings
from tests.api_support import WORKER, Tenant, create, drive

pytest_plugins = ("tests.api_fixtures",)


async def _running_job(conn: AsyncConn, kind: str = "provision") -> DictRow:
    (claimed,) = await queue.claim(conn, "w1", [kind], 1)
    result = await queue.start_many(conn, [claimed], WORKER)
    return result.moved[0]


async def _failed_job(conn: AsyncConn) -> DictRow:
    job = await _running_job(conn)
    return await transition(
        conn,
        "job",
        job["id"],
        "error",
        job["state_version"],
        expected_state="running",
        actor=WORKER,
        patch={"last_error": "disk full", "error_kind": "temporary", "delay_s": 3600},
    )


async def test_admin_events_filter_and_paginate(
    client: httpx.AsyncClient,
    tenant: Tenant,
    other_tenant: Tenant,
    admin_headers: dict[str, str],
    conn: AsyncConn,
) -> None:
    a = await create(client, tenant, "a")
    b = await create(client, other_tenant, "b")
    await drive(conn, a["id"], "start_provisioning", "fail")

    async def events(**params: Any) -> list[dict[str, Any]]:
        response = await client.get("/v1/admin/events", params=params, headers=admin_headers)
        assert response.status_code == 200, response.text
        items: list[dict[str, Any]] = response.json()["items"]
        return items

    assert len(await events()) == 4
    assert {e["to_state"] for e in await events(instance=a["id"])} == {"pending", "provisioning", "failed"}
    assert [e["instance_id"] for e in await events(org=str(other_tenant.org_id))] == [b["id"]]
    assert len(await events(actor="customer")) == 2
    assert [e["event"] for e in await events(actor=f"worker:{WORKER.id}")] == ["start_provisioning", "fail"]
    assert [e["instance_id"] for e in await events(to_state="failed")] == [a["id"]]
    assert len(await events(event="create")) == 2
    now = datetime.now(UTC)
    assert len(await events(since=(now - timedelta(minutes=5)).isoformat())) == 4
    assert await events(until=(now - timedelta(minutes=5)).isoformat()) == []
    first = (await client.get("/v1/admin/events?limit=3", headers=admin_headers)).json()
    rest = (
        await client.get("/v1/admin/events", params={"cursor": first["next_cursor"]}, headers=admin_headers)
    ).json()
    assert len(first["items"]) == 3 and len(rest["items"]) == 1 and rest["next_cursor"] is None
    assert {"org_id", "request_id", "state_version"} <= set(rest["items"][0])


async def test_jobs_are_listed_by_state_and_kind(
    client: httpx.AsyncClient, tenant: Tenant, admin_headers: dict[str, str], conn: AsyncConn
) -> None:
    await create(client, tenant, "a")
    await create(client, tenant, "b")
    await _running_job(conn)
    listed = (await client.get("/v1/admin/jobs", headers=admin_headers)).json()["items"]
    assert len(listed) == 2 and all(j["kind"] == "provision" for j in listed)
    running = (await client.get("/v1/admin/jobs?state=running", headers=admin_headers)).json()["items"]
    assert len(running) == 1 and running[0]["claimed_by"] == "w1"
    assert (await client.get("/v1/admin/jobs?kind=heal", headers=admin_headers)).json()["items"] == []
    assert (await client.get("/v1/admin/jobs?state=sleeping", headers=admin_headers)).status_code == 422


async def test_operator_pauses_resumes_and_retries_with_a_reason(
    client: httpx.AsyncClient, tenant: Tenant, admin_headers: dict[str, str], conn: AsyncConn
) -> None:
    await create(client, tenant, "a")
    job = await _running_job(conn)
    url = f"/v1/admin/jobs/{job['id']}"
    response = await client.post(f"{url}/pause", json={"reason": "investigating"}, headers=admin_headers)
    assert response.status_code == 200 and response.json()["state"] == "paused"
    refused = await client.post(f"{url}/retry", json={"reason": "again"}, headers=admin_headers)
    assert refused.status_code == 409
    assert refused.json()["current_state"] == "paused" and refused.json()["allowed_actions"] == [
        "resume",
        "abandon",
    ]
    assert (await client.post(f"{url}/resume", json={"reason": "ok"}, headers=admin_headers)).json()[
        "state"
    ] == ("running")
    no_reason = await client.post(f"{url}/pause", json={"reason": ""}, headers=admin_headers)
    assert no_reason.status_code == 422 and "body.reason" in no_reason.json()["detail"]
    blank = await client.post(f"{url}/pause", json={"reason": "   "}, headers=admin_headers)
    assert blank.status_code == 422
    missing = await client.post(
        f"/v1/admin/jobs/{uuid.uuid4()}/pause", json={"reason": "x"}, headers=admin_headers
    )
    assert missing.status_code == 404
    bad_action = await client.post(f"{url}/explode", json={"reason": "x"}, headers=admin_headers)
    assert bad_action.status_code == 422
    cursor = await conn.execute(
        "SELECT event, actor_kind, reason FROM job_events"
        " WHERE job_id = %s AND actor_kind = 'operator' ORDER BY id",
        (job["id"],),
    )
    assert [(r["event"], r["reason"]) for r in await cursor.fetchall()] == [
        ("pause", "investigating"),
        ("resume", "ok"),
    ]
    failed = await _failed_job_after(conn, client, tenant)
    retried = await client.post(
        f"/v1/admin/jobs/{failed['id']}/retry", json={"reason": "disk freed"}, headers=admin_headers
    )
    assert retried.status_code == 200 and retried.json()["state"] == "queued"
    assert await audit.verify(conn) == []


async def _failed_job_after(conn: AsyncConn, client: httpx.AsyncClient, tenant: Tenant) -> DictRow:
    await create(client, tenant, "c")
    return await _failed_job(conn)


@pytest.fixture
async def client_with_registry(api_settings: Settings) -> AsyncIterator[tuple[httpx.AsyncClient, list[str]]]:
    hooked: list[str] = []

    async def handler(_: Any) -> dict[str, str]:
        return {"result": "nothing to do"}

    async def on_abandoned(conn: AsyncConn, job: DictRow, actor: Actor) -> None:
        hooked.append(f"{job['kind']}:{actor}")

    registry = JobRegistry([JobKind("provision", handler, on_abandoned=on_abandoned)])
    app = create_app(api_settings, job_registry=registry)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            yield http, hooked


async def test_abandon_runs_the_kinds_hook_and_needs_the_kind(
    client: httpx.AsyncClient,
    client_with_registry: tuple[httpx.AsyncClient, list[str]],
    tenant: Tenant,
    admin_headers: dict[str, str],
    conn: AsyncConn,
) -> None:
    await create(client, tenant, "a")
    failed = await _failed_job(conn)
    url = f"/v1/admin/jobs/{failed['id']}/abandon"
    refused = await client.post(url, json={"reason": "give up"}, headers=admin_headers)
    assert refused.status_code == 409 and "not registered" in refused.json()["detail"]
    with_kinds, hooked = client_with_registry
    response = await with_kinds.post(url, json={"reason": "give up"}, headers=admin_headers)
    assert response.status_code == 200, response.text
    assert response.json()["state"] == "abandoned"
    assert len(hooked) == 1 and hooked[0].startswith("provision:operator:")


async def test_dwell_stats_per_state(
    client: httpx.AsyncClient, tenant: Tenant, admin_headers: dict[str, str], conn: AsyncConn
) -> None:
    made = await create(client, tenant, "a")
    await drive(conn, made["id"], "start_provisioning")
    stats = (await client.get("/v1/admin/stats/dwell?entity=instance", headers=admin_headers)).json()
    by_state = {s["state"]: s for s in stats["states"]}
    assert stats["entity"] == "instance" and set(by_state) == {"pending", "provisioning"}
    assert by_state["pending"]["count"] == 1 and by_state["provisioning"]["current"] == 1
    assert by_state["pending"]["p50_s"] <= by_state["pending"]["p95_s"] <= by_state["pending"]["max_s"]
    jobs = (await client.get("/v1/admin/stats/dwell?entity=job", headers=admin_headers)).json()
    assert [s["state"] for s in jobs["states"]] == ["queued"]
    assert (await client.get("/v1/admin/stats/dwell?entity=org", headers=admin_headers)).status_code == 422


async def test_health_readiness_and_metrics(client: httpx.AsyncClient, conn: AsyncConn) -> None:
    assert (await client.get("/healthz")).json() == {"status": "ok", "detail": None}
    ready = await client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    metrics = await client.get("/metrics")
    assert metrics.status_code == 200 and "controlplane_transitions_total" in metrics.text
    await conn.execute("UPDATE alembic_version SET version_num = 'old'")
    behind = await client.get("/readyz")
    assert behind.status_code == 503 and "old" in behind.json()["detail"]
    assert behind.headers["content-type"] == "application/problem+json"


async def test_an_sre_switchover_is_an_update_job_with_who_asked_and_why(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn, admin_headers: dict[str, str]
) -> None:
    ha = await create(client, tenant, "orders", plan="small")
    single = await create(client, tenant, "notes")
    reason = {"reason": "host maintenance"}
    # Not ready yet: refused with the state; a customer's key is refused outright.
    early = await client.post("/v1/admin/instances/orders/switchover", json=reason, headers=admin_headers)
    assert early.status_code == 409 and early.json()["current_state"] == "pending"
    assert (
        await client.post("/v1/admin/instances/orders/switchover", json=reason, headers=tenant.headers)
    ).status_code == 403
    await drive(conn, ha["id"], "start_provisioning", "provisioned")
    await drive(conn, single["id"], "start_provisioning", "provisioned")
    one_server = await client.post(
        f"/v1/admin/instances/{single['id']}/switchover", json=reason, headers=admin_headers
    )
    assert one_server.status_code == 422 and "one server" in one_server.json()["detail"]

    asked = await client.post("/v1/admin/instances/orders/switchover", json=reason, headers=admin_headers)
    assert asked.status_code == 202, asked.text
    job = asked.json()
    assert (job["kind"], job["state"], job["instance_id"]) == ("update", "queued", ha["id"])
    cursor = await conn.execute("SELECT payload FROM jobs WHERE id = %s", (job["id"],))
    row = await cursor.fetchone()
    assert row is not None and row["payload"]["switchover"] is True
    assert row["payload"]["reason"].startswith("switchover asked by admin:") and "host maintenance" in str(
        row
    )
    # A second one while the first is under way is a conflict.
    again = await client.post(
        f"/v1/admin/instances/{ha['id']}/switchover", json=reason, headers=admin_headers
    )
    assert again.status_code == 409
