"""Fixtures and helpers of the API tests: the app in-process over a fresh database, orgs and keys."""

from __future__ import annotations

import base64
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import stripe

from controlplane.api.app import create_app
from controlplane.db.connection import AsyncConn
from controlplane.db.transitions import Actor
from controlplane.runtime.secretbox import load_box
from controlplane.runtime.settings import Settings
from controlplane.services import tenants
from tests.factories import walk

WEBHOOK_SECRET = "whsec_test_secret_for_api_tests"
WORKER = Actor("worker", "test-worker")


@dataclass(frozen=True)
class Tenant:
    org_id: uuid.UUID
    key: str
    stripe_customer_id: str | None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@contextlib.asynccontextmanager
async def serving(settings: Settings, **changes: Any) -> AsyncIterator[httpx.AsyncClient]:
    """The API in-process over `settings` with `changes` (and the tests' webhook secret), and a
    client of it."""
    app = create_app(settings.replace(stripe_webhook_secret=WEBHOOK_SECRET, **changes))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            yield client


async def make_tenant(conn: AsyncConn, name: str | None = None) -> Tenant:
    customer = f"cus_{uuid.uuid4().hex[:12]}"
    org, key = await tenants.create_org(conn, name or f"org-{uuid.uuid4().hex[:8]}", customer)
    return Tenant(org["id"], key.plaintext, customer)


async def create(client: httpx.AsyncClient, who: Tenant, name: str, plan: str = "dev", **extra: Any) -> Any:
    response = await client.post(
        "/v1/instances", json={"name": name, "plan": plan, **extra}, headers=who.headers
    )
    assert response.status_code == 202, response.text
    return response.json()


async def drive(conn: AsyncConn, instance_id: uuid.UUID | str, *events: str, **patch: Any) -> Any:
    """Apply lifecycle events to an instance as a worker would (the last one carries `patch`)."""
    return await walk(conn, uuid.UUID(str(instance_id)), *events, actor=WORKER, patch=patch)


def ready_patch(
    settings: Settings, password: str, port: int = 15432, ca: str | None = None
) -> dict[str, Any]:
    """The patch a provisioner's last step writes: connection details (with `ca`, TLS verified
    against that CA) and the encrypted password."""
    secret = load_box(settings).encrypt(password)
    connection: dict[str, Any] = {"host": "127.0.0.1", "port": port, "dbname": "app", "user": "app_owner"}
    if ca is not None:
        connection |= {"sslmode": "verify-full", "ca_certificate": ca}
    return {
        "connection": connection,
        "secret": base64.b64encode(secret).decode(),
        "observed_generation": 1,
        "observed_spec": {"plan": "dev", "region": "local"},
    }


async def make_ready(
    conn: AsyncConn, settings: Settings, instance_id: Any, password: str = "pw", ca: str | None = None
) -> Any:
    return await drive(
        conn, instance_id, "start_provisioning", "provisioned", **ready_patch(settings, password, ca=ca)
    )


def stripe_event(
    event_id: str,
    customer: str | None,
    status: str | None,
    created: int,
    event_type: str = "customer.subscription.updated",
) -> bytes:
    obj: dict[str, Any] = {"id": f"sub_{event_id}", "object": "subscription"}
    if customer is not None:
        obj["customer"] = customer
    if status is not None:
        obj["status"] = status
    event = {
        "id": event_id,
        "object": "event",
        "type": event_type,
        "created": created,
        "data": {"object": obj},
    }
    return json.dumps(event).encode()


def sign(payload: bytes, secret: str = WEBHOOK_SECRET, timestamp: int | None = None) -> str:
    ts = int(time.time()) if timestamp is None else timestamp
    header: str = stripe.WebhookSignature.generate_signature_header(payload.decode(), secret, ts)
    return header


async def deliver(client: httpx.AsyncClient, payload: bytes, signature: str | None = None) -> httpx.Response:
    headers = {"Content-Type": "application/json", "Stripe-Signature": signature or sign(payload)}
    return await client.post("/v1/webhooks/stripe", content=payload, headers=headers)
