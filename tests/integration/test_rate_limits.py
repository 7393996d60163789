"""Rate limits per key on the running app: 429 with Retry-After, RateLimit headers on every
answer, the webhook route counted apart, probes not counted."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from controlplane.api.app import create_app
from controlplane.runtime.settings import Settings
from tests.api_support import Tenant, deliver, sign, stripe_event

pytest_plugins = ("tests.api_fixtures",)


@pytest.fixture
def clock() -> list[float]:
    """The limits' time, moved by the test only (never the machine's: how many requests fit in a
    real window depends on how fast it is)."""
    return [1000.0]


@pytest.fixture
async def limited(api_settings: Settings, clock: list[float]) -> AsyncIterator[httpx.AsyncClient]:
    settings = api_settings.replace(api_rate_limit=3, api_rate_window_s=3600, api_webhook_rate_limit=2)
    app = create_app(settings, clock=lambda: clock[0])
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            yield http


async def test_a_key_beyond_its_limit_gets_429_with_retry_after(
    limited: httpx.AsyncClient, tenant: Tenant, other_tenant: Tenant, clock: list[float]
) -> None:
    answers = [await limited.get("/v1/instances", headers=tenant.headers) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert answers[0].headers["RateLimit-Policy"] == "3;w=3600"
    assert [a.headers["RateLimit"].split(", ")[1] for a in answers] == [
        "remaining=2",
        "remaining=1",
        "remaining=0",
    ]
    refused = await limited.get("/v1/instances", headers=tenant.headers)
    assert refused.status_code == 429
    assert refused.headers["content-type"] == "application/problem+json"
    assert refused.json()["type"] == "urn:controlplane:problem:rate-limited"
    assert refused.headers["Retry-After"] == "3600"
    clock[0] += 3599.5
    assert (await limited.get("/v1/instances", headers=tenant.headers)).headers["Retry-After"] == "1"
    assert refused.headers["X-Request-ID"] == refused.json()["request_id"]
    # Another key, the probes and the webhook route are counted apart.
    assert (await limited.get("/v1/instances", headers=other_tenant.headers)).status_code == 200
    assert [(await limited.get("/healthz")).status_code for _ in range(5)] == [200] * 5
    assert "RateLimit" not in (await limited.get("/healthz")).headers
    # A new window: the key is served again.
    clock[0] += 0.5
    assert (await limited.get("/v1/instances", headers=tenant.headers)).status_code == 200


async def test_the_webhook_route_has_its_own_limit(limited: httpx.AsyncClient, tenant: Tenant) -> None:
    for _ in range(3):
        await limited.get("/v1/plans", headers=tenant.headers)
    assert (await limited.get("/v1/plans", headers=tenant.headers)).status_code == 429
    payloads = [
        stripe_event(f"evt_rl{n}", tenant.stripe_customer_id, "active", 1_700_000_000 + n) for n in range(3)
    ]
    answers = [await deliver(limited, payload, sign(payload)) for payload in payloads]
    assert [a.status_code for a in answers][:2] == [200, 200]
    assert answers[2].status_code == 429 and answers[2].headers["RateLimit-Policy"] == "2;w=3600"
