"""Every header the OpenAPI document declares on an answer is sent with it (the ones it says are
sent only sometimes aside): a generated client that reads a declared header finds it."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from controlplane.db.connection import AsyncConn
from controlplane.runtime.settings import Settings
from tests.api_support import WEBHOOK_SECRET, Tenant, create, drive

pytest_plugins = ("tests.api_fixtures",)

# Declared, and sent only sometimes (as their descriptions say): on a replay, with a password.
SOMETIMES = {"Idempotent-Replayed", "Cache-Control"}


@pytest.fixture
def api_settings(settings: Settings) -> Settings:
    """With the per-key limit on (it sends the RateLimit headers), far above the requests made."""
    return settings.replace(
        stripe_webhook_secret=WEBHOOK_SECRET, max_body_bytes=4096, api_rate_limit=1_000_000
    )


def _declared(document: dict[str, Any], path: str, method: str, status: int) -> set[str]:
    answer = document["paths"][path][method]["responses"][str(status)]
    return set(answer.get("headers", {})) - SOMETIMES


async def test_every_declared_header_of_an_answer_is_sent(
    app: FastAPI, client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn
) -> None:
    document = app.openapi()
    made = await create(client, tenant, "orders")
    failed = await create(client, tenant, "flaky")
    await drive(conn, failed["id"], "fail")
    one = f"/v1/instances/{made['id']}"
    asked: list[tuple[str, str, str, dict[str, Any], int]] = [
        ("/healthz", "get", "/healthz", {}, 200),
        ("/readyz", "get", "/readyz", {}, 200),
        ("/metrics", "get", "/metrics", {}, 200),
        ("/v1/plans", "get", "/v1/plans", {}, 200),
        ("/v1/lifecycle", "get", "/v1/lifecycle", {}, 200),
        ("/v1/instances", "get", "/v1/instances", {}, 200),
        ("/v1/instances/{instance_id}", "get", one, {}, 200),
        ("/v1/instances/{instance_id}", "patch", one, {"json": {"plan": "small"}}, 202),
        ("/v1/instances/{instance_id}/retry", "post", f"/v1/instances/{failed['id']}/retry", {}, 202),
        ("/v1/instances/{instance_id}", "delete", one, {}, 202),
        ("/v1/instances", "post", "/v1/instances", {"json": {"name": "more", "plan": "dev"}}, 202),
    ]
    missing = {}
    for path, method, url, extra, status in asked:
        response = await client.request(method.upper(), url, headers=tenant.headers, **extra)
        assert response.status_code == status, (method, url, response.text)
        absent = {name for name in _declared(document, path, method, status) if name not in response.headers}
        if absent:
            missing[f"{method} {path} {status}"] = absent
    assert missing == {}
    # A problem too: its declared headers are sent.
    refused = await client.get("/v1/instances/no-such-name", headers=tenant.headers)
    assert refused.status_code == 404
    declared = _declared(document, "/v1/instances/{instance_id}", "get", 404)
    assert declared and {name for name in declared if name not in refused.headers} == set()
