"""Idempotency-Key on POST /v1/instances: replay, mismatch, in-flight duplicate, per-org scope, expiry."""

from __future__ import annotations

import asyncio

import httpx

from controlplane.db import connection as db
from controlplane.db.connection import AsyncConn
from controlplane.services import idempotency
from tests.api_support import Tenant

pytest_plugins = ("tests.api_fixtures",)

BODY = {"name": "orders", "plan": "dev"}


def _with_key(tenant: Tenant, key: str) -> dict[str, str]:
    return {**tenant.headers, "Idempotency-Key": key}


async def _count(conn: AsyncConn, table: str) -> int:
    cursor = await conn.execute(f"SELECT count(*) AS n FROM {table}")
    row = await cursor.fetchone()
    assert row is not None
    return int(row["n"])


async def test_same_key_and_body_returns_the_stored_response(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn
) -> None:
    first = await client.post("/v1/instances", json=BODY, headers=_with_key(tenant, "k-1"))
    second = await client.post("/v1/instances", json=BODY, headers=_with_key(tenant, "k-1"))
    assert first.status_code == second.status_code == 202
    assert second.json() == first.json()
    assert second.headers["location"] == first.headers["location"]
    assert second.headers["idempotent-replayed"] == "true"
    assert await _count(conn, "instances") == 1 and await _count(conn, "jobs") == 1
    # key order and whitespace do not make a different request
    reordered = await client.post(
        "/v1/instances",
        content=b'{ "plan": "dev",  "name": "orders" }',
        headers={**_with_key(tenant, "k-1"), "Content-Type": "application/json"},
    )
    assert reordered.status_code == 202 and reordered.json()["id"] == first.json()["id"]


async def test_same_key_other_body_is_422(client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn) -> None:
    await client.post("/v1/instances", json=BODY, headers=_with_key(tenant, "k-2"))
    response = await client.post(
        "/v1/instances", json={**BODY, "plan": "small"}, headers=_with_key(tenant, "k-2")
    )
    assert response.status_code == 422
    assert response.json()["type"] == "urn:controlplane:problem:idempotency-mismatch"
    assert await _count(conn, "instances") == 1


async def test_keys_are_scoped_per_organisation(
    client: httpx.AsyncClient, tenant: Tenant, other_tenant: Tenant
) -> None:
    mine = await client.post("/v1/instances", json=BODY, headers=_with_key(tenant, "shared"))
    theirs = await client.post(
        "/v1/instances", json={**BODY, "plan": "small"}, headers=_with_key(other_tenant, "shared")
    )
    assert mine.status_code == theirs.status_code == 202
    assert theirs.json()["id"] != mine.json()["id"] and theirs.json()["plan"] == "small"


async def test_a_failed_request_stores_nothing(client: httpx.AsyncClient, tenant: Tenant) -> None:
    await client.post("/v1/instances", json=BODY, headers=tenant.headers)
    taken = await client.post("/v1/instances", json=BODY, headers=_with_key(tenant, "k-3"))
    assert taken.status_code == 409
    renamed = await client.post(
        "/v1/instances", json={**BODY, "name": "orders-2"}, headers=_with_key(tenant, "k-3")
    )
    assert renamed.status_code == 202


async def test_in_flight_duplicate_is_409(
    client: httpx.AsyncClient, tenant: Tenant, fresh_database: str
) -> None:
    """While one transaction holds the key, a second request with it is refused, not run twice."""
    holder = await db.connect(fresh_database)
    async with holder, holder.transaction():
        await idempotency.begin(holder, tenant.org_id, "k-4", "digest")
        response = await client.post("/v1/instances", json=BODY, headers=_with_key(tenant, "k-4"))
        assert response.status_code == 409
        assert response.json()["type"] == "urn:controlplane:problem:idempotency-in-flight"
    done = await client.post("/v1/instances", json=BODY, headers=_with_key(tenant, "k-4"))
    assert done.status_code == 202


async def test_concurrent_duplicates_create_one_instance(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn
) -> None:
    responses = await asyncio.gather(
        *[client.post("/v1/instances", json=BODY, headers=_with_key(tenant, "k-5")) for _ in range(5)]
    )
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) <= {202, 409} and 202 in statuses
    assert len({r.json()["id"] for r in responses if r.status_code == 202}) == 1
    assert await _count(conn, "instances") == 1


async def test_expired_keys_are_purged_and_reusable(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn
) -> None:
    first = await client.post("/v1/instances", json=BODY, headers=_with_key(tenant, "k-6"))
    await conn.execute("UPDATE idempotency_keys SET created_at = now() - interval '25 hours'")
    again = await client.post(
        "/v1/instances", json={**BODY, "name": "orders-2"}, headers=_with_key(tenant, "k-6")
    )
    assert again.status_code == 202 and again.json()["id"] != first.json()["id"]
    cursor = await conn.execute(
        "SELECT count(*) AS n FROM idempotency_keys WHERE created_at < now() - interval '1 hour'"
    )
    assert (await cursor.fetchone()) == {"n": 0}


async def test_a_bad_key_is_422(client: httpx.AsyncClient, tenant: Tenant) -> None:
    response = await client.post("/v1/instances", json=BODY, headers=_with_key(tenant, "x" * 300))
    assert response.status_code == 422
