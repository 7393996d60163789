"""Authentication and tenancy over HTTP: deny by default, admin routes, keys, cross-tenant isolation."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx

from controlplane.api.state import KeyCache
from controlplane.db.connection import AsyncConn
from controlplane.runtime.settings import Settings
from controlplane.services.tenants import Principal
from tests.api_support import Tenant, create, deliver, make_ready, make_tenant, serving, stripe_event

pytest_plugins = ("tests.api_fixtures",)


async def test_customer_routes_deny_without_a_valid_key(client: httpx.AsyncClient, tenant: Tenant) -> None:
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic abc"}):
        response = await client.get("/v1/instances", headers=headers)
        assert response.status_code == 401
        assert response.headers["content-type"] == "application/problem+json"
        assert response.headers["www-authenticate"].startswith("Bearer")
        assert response.json()["type"] == "urn:controlplane:problem:unauthorized"


async def test_admin_routes_need_an_admin_key(
    client: httpx.AsyncClient, tenant: Tenant, admin_headers: dict[str, str]
) -> None:
    for path in ("/v1/admin/events", "/v1/admin/jobs", "/v1/admin/stats/dwell"):
        assert (await client.get(path, headers=tenant.headers)).status_code == 403
        assert (await client.get(path, headers=admin_headers)).status_code == 200
    response = await client.post("/v1/orgs", json={"name": "x"}, headers=tenant.headers)
    assert response.status_code == 403 and response.json()["type"] == "urn:controlplane:problem:forbidden"
    # and an admin key is not an organisation's key
    assert (await client.get("/v1/instances", headers=admin_headers)).status_code == 403


async def test_admin_creates_an_org_whose_first_key_works(
    client: httpx.AsyncClient, admin_headers: dict[str, str]
) -> None:
    response = await client.post(
        "/v1/orgs", json={"name": "initech", "stripe_customer_id": "cus_42"}, headers=admin_headers
    )
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["org"]["name"] == "initech" and body["org"]["billing_hold"] is False
    key = body["key"]["key"]
    assert key.startswith("cpk_") and body["key"]["prefix"] in key
    listed = await client.get("/v1/keys", headers={"Authorization": f"Bearer {key}"})
    assert listed.status_code == 200
    assert [k["prefix"] for k in listed.json()["items"]] == [body["key"]["prefix"]]
    assert "key" not in listed.json()["items"][0] and "key_hash" not in listed.json()["items"][0]
    again = await client.post("/v1/orgs", json={"name": "initech"}, headers=admin_headers)
    assert again.status_code == 409
    unknown = await client.post("/v1/orgs", json={"name": "x", "plan": "gold"}, headers=admin_headers)
    assert unknown.status_code == 422 and "body.plan" in unknown.json()["detail"]


async def test_keys_are_created_and_revoked(
    client: httpx.AsyncClient, tenant: Tenant, other_tenant: Tenant, admin_headers: dict[str, str]
) -> None:
    made = await client.post("/v1/keys", json={"name": "ci"}, headers=tenant.headers)
    assert made.status_code == 201
    second = {"Authorization": f"Bearer {made.json()['key']}"}
    assert (await client.get("/v1/instances", headers=second)).status_code == 200
    # another organisation cannot revoke it, nor see it
    assert (
        await client.delete(f"/v1/keys/{made.json()['id']}", headers=other_tenant.headers)
    ).status_code == 404
    assert (await client.delete(f"/v1/keys/{made.json()['id']}", headers=tenant.headers)).status_code == 204
    assert (await client.get("/v1/instances", headers=second)).status_code == 401
    assert (await client.delete(f"/v1/keys/{made.json()['id']}", headers=tenant.headers)).status_code == 404
    by_admin = await client.post(f"/v1/orgs/{other_tenant.org_id}/keys", json={}, headers=admin_headers)
    assert by_admin.status_code == 201
    assert (
        await client.delete(f"/v1/keys/{by_admin.json()['id']}", headers=admin_headers)
    ).status_code == 204
    missing = await client.post(f"/v1/orgs/{uuid.uuid4()}/keys", json={}, headers=admin_headers)
    assert missing.status_code == 404


async def test_every_customer_route_gives_another_org_nothing(
    client: httpx.AsyncClient,
    tenant: Tenant,
    other_tenant: Tenant,
    conn: AsyncConn,
    api_settings: Settings,
) -> None:
    """Broken object-level authorisation: each customer route, called with a second org's key."""
    mine = await create(client, tenant, "orders")
    await make_ready(conn, api_settings, mine["id"], password="tenant-a-password")
    path = f"/v1/instances/{mine['id']}"
    thief = other_tenant.headers

    assert (await client.get(path, headers=thief)).status_code == 404
    assert (await client.patch(path, json={"plan": "small"}, headers=thief)).status_code == 404
    assert (await client.delete(path, headers=thief)).status_code == 404
    assert (await client.get(f"{path}/events", headers=thief)).status_code == 404
    assert (await client.get(f"{path}/watch", headers=thief)).status_code == 404
    listing = await client.get("/v1/instances", headers=thief)
    assert listing.status_code == 200 and listing.json() == {"items": [], "next_cursor": None}
    for state in ("ready", "pending"):
        assert (await client.get(f"/v1/instances?state={state}", headers=thief)).json()["items"] == []
    keys = (await client.get("/v1/keys", headers=thief)).json()["items"]
    assert all(k["prefix"] not in tenant.key for k in keys)
    # creating with the same name is the other org's own business, and touches nothing of the first
    assert (
        await client.post("/v1/instances", json={"name": "orders", "plan": "dev"}, headers=thief)
    ).status_code == 202
    # the first org's instance is untouched
    after = (await client.get(path, headers=tenant.headers)).json()
    assert after["state"] == "ready" and after["spec_generation"] == 1 and not after["deletion_requested"]
    assert after["connection"]["password"] == "tenant-a-password"
    stolen = await client.get(path, headers=thief)
    assert "tenant-a-password" not in stolen.text and "app_owner" not in stolen.text
    listed = await client.get("/v1/instances", headers=thief)
    assert mine["id"] not in listed.text and "tenant-a-password" not in listed.text


async def test_public_routes_need_no_key(client: httpx.AsyncClient) -> None:
    for path in ("/healthz", "/readyz", "/metrics", "/v1/lifecycle", "/v1/plans", "/openapi.json"):
        assert (await client.get(path)).status_code == 200, path


async def test_webhook_route_needs_a_signature_not_a_key(client: httpx.AsyncClient) -> None:
    response = await deliver(client, stripe_event("evt_x", None, None, 1), signature="t=1,v1=00")
    assert response.status_code == 400


def test_the_key_cache_expires_and_forgets() -> None:
    now = [100.0]
    cache = KeyCache(5.0, clock=lambda: now[0])
    who = Principal(uuid.uuid4(), uuid.uuid4(), False)
    cache.put(b"h", who)
    assert cache.get(b"h") == who
    now[0] += 5.0
    assert cache.get(b"h") is None
    cache.put(b"h", who)
    cache.forget(who.key_id)
    assert cache.get(b"h") is None
    disabled = KeyCache(0.0, clock=lambda: now[0])
    disabled.put(b"h", who)
    assert disabled.get(b"h") is None


async def test_a_key_revoked_through_the_api_is_refused_at_once_despite_the_cache(
    client: httpx.AsyncClient, conn: AsyncConn
) -> None:
    victim = await make_tenant(conn, "revoked-co")
    assert (await client.get("/v1/instances", headers=victim.headers)).status_code == 200
    (key,) = (await client.get("/v1/keys", headers=victim.headers)).json()["items"]
    key_id = key["id"]
    assert (await client.delete(f"/v1/keys/{key_id}", headers=victim.headers)).status_code == 204
    assert (await client.get("/v1/instances", headers=victim.headers)).status_code == 401


async def test_an_organisation_holds_at_most_the_configured_live_keys_listed_page_by_page(
    api_settings: Settings, tenant: Tenant, admin_headers: dict[str, str]
) -> None:
    async with serving(api_settings, api_max_keys_per_org=4) as client:
        # The first key and, racing, ten requests for more: three get one, seven are refused.
        made = await asyncio.gather(
            *(client.post("/v1/keys", json={"name": f"k{i}"}, headers=tenant.headers) for i in range(10))
        )
        statuses = sorted(r.status_code for r in made)
        assert statuses == [201] * 3 + [409] * 7, statuses
        refused = next(r for r in made if r.status_code == 409)
        assert refused.headers["content-type"] == "application/problem+json"
        assert refused.json()["type"] == "urn:controlplane:problem:limit-reached"
        assert "revoke one" in refused.json()["detail"]
        by_admin = await client.post(f"/v1/orgs/{tenant.org_id}/keys", json={}, headers=admin_headers)
        assert by_admin.status_code == 409  # the cap is the organisation's, whoever asks

        # Revoking one makes room for one.
        some = next(r.json()["id"] for r in made if r.status_code == 201)
        assert (await client.delete(f"/v1/keys/{some}", headers=tenant.headers)).status_code == 204
        assert (await client.post("/v1/keys", json={}, headers=tenant.headers)).status_code == 201
        assert (await client.post("/v1/keys", json={}, headers=tenant.headers)).status_code == 409

        # Five keys in all (one revoked), two by two: every key once, oldest first.
        seen: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            params: dict[str, Any] = {"limit": 2, **({"cursor": cursor} if cursor else {})}
            page = (await client.get("/v1/keys", params=params, headers=tenant.headers)).json()
            assert len(page["items"]) <= 2
            seen += page["items"]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert len(seen) == 5 and len({k["id"] for k in seen}) == 5
        assert [k["created_at"] for k in seen] == sorted(k["created_at"] for k in seen)
        assert sum(k["revoked_at"] is not None for k in seen) == 1
        bad = await client.get("/v1/keys", params={"cursor": "nope"}, headers=tenant.headers)
        assert bad.status_code == 422
