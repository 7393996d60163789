"""Problem responses: shapes, validation, size limit, unknown routes, and no trace of a crash."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI

from controlplane.db.connection import AsyncConn
from tests.api_support import Tenant

pytest_plugins = ("tests.api_fixtures",)

PROBLEM_KEYS = {"type", "title", "status", "detail", "instance"}


def assert_problem(response: httpx.Response, status: int, kind: str) -> dict[str, object]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body: dict[str, object] = response.json()
    assert set(body) >= PROBLEM_KEYS
    assert body["type"] == f"urn:controlplane:problem:{kind}" and body["status"] == status
    assert body["request_id"] == response.headers["x-request-id"]
    return body


async def test_unknown_body_field_is_422_naming_it(client: httpx.AsyncClient, tenant: Tenant) -> None:
    response = await client.post(
        "/v1/instances", json={"name": "a", "plan": "dev", "size": "huge"}, headers=tenant.headers
    )
    body = assert_problem(response, 422, "validation")
    assert body["errors"] == [{"field": "body.size", "message": "unknown field"}]


async def test_malformed_json_is_422(client: httpx.AsyncClient, tenant: Tenant) -> None:
    response = await client.post(
        "/v1/instances",
        content=b"{not json",
        headers={**tenant.headers, "Content-Type": "application/json"},
    )
    assert_problem(response, 422, "validation")


async def test_body_over_the_limit_is_413(client: httpx.AsyncClient, tenant: Tenant) -> None:
    big = {"name": "a", "plan": "dev", "region": "x" * 5000}
    response = await client.post("/v1/instances", json=big, headers=tenant.headers)
    assert_problem(response, 413, "payload-too-large")

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(10):
            yield b" " * 1000  # no Content-Length: counted as it streams

    response = await client.post(
        "/v1/instances", content=chunks(), headers={**tenant.headers, "Content-Type": "application/json"}
    )
    assert_problem(response, 413, "payload-too-large")


async def test_unknown_route_and_method_are_problems(client: httpx.AsyncClient, tenant: Tenant) -> None:
    assert_problem(await client.get("/v1/nothing-here", headers=tenant.headers), 404, "not-found")
    assert_problem(await client.put("/v1/instances", headers=tenant.headers), 405, "method-not-allowed")


async def test_a_crash_is_a_500_problem_without_a_trace(
    app: FastAPI, client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    async def explode() -> None:
        raise RuntimeError("secret internals: /srv/app/module.py line 42")

    app.add_api_route("/test-only/explode", explode)
    with caplog.at_level(logging.ERROR):
        response = await client.get("/test-only/explode", headers={"X-Request-ID": "crash-1"})
    body = assert_problem(response, 500, "internal")
    assert "secret internals" not in response.text and "Traceback" not in response.text
    assert "module.py" not in response.text and body["request_id"] == "crash-1"
    logged = [r for r in caplog.records if r.exc_info and "crash-1" in r.getMessage()]
    assert logged and "secret internals" in str(logged[0].exc_info[1])  # type: ignore[index]


async def test_unknown_query_parameter_is_422_naming_it(client: httpx.AsyncClient, tenant: Tenant) -> None:
    response = await client.get("/v1/instances?colour=red&limit=2", headers=tenant.headers)
    body = assert_problem(response, 422, "validation")
    assert body["errors"] == [{"field": "query.colour", "message": "unknown parameter"}]


async def test_a_connection_lost_to_a_database_restart_is_a_503_then_recovers(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn
) -> None:
    assert (await client.get("/v1/instances", headers=tenant.headers)).status_code == 200
    await conn.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
    )
    lost = await client.get("/v1/instances", headers=tenant.headers)
    assert lost.status_code == 503
    assert lost.headers["content-type"] == "application/problem+json"
    assert lost.headers["retry-after"] == "1"
    assert lost.json()["type"].endswith(":unavailable")
    statuses = [(await client.get("/v1/instances", headers=tenant.headers)).status_code for _ in range(3)]
    assert statuses[-1] == 200


async def test_a_nul_character_is_a_422_and_nothing_is_written(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn
) -> None:
    answer = await client.post("/v1/keys", headers=tenant.headers, json={"name": "bad\u0000name"})
    assert answer.status_code == 422
    assert answer.headers["content-type"] == "application/problem+json"
    assert "NUL" in answer.json()["detail"]
    cursor = await conn.execute("SELECT count(*) AS n FROM api_keys WHERE org_id = %s", (tenant.org_id,))
    assert (await cursor.fetchone()) == {"n": 1}
