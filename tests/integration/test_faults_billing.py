"""Faults of the Stripe side: clocks apart (F10), one event delivered 50 times at once (F16), an event
for a customer not yet linked to an organisation (F18)."""

from __future__ import annotations

import asyncio
import time

import httpx

from controlplane.audit import verify as audit
from controlplane.core import billing_rules as billing
from controlplane.db.connection import AsyncConn
from controlplane.runtime.settings import Settings
from controlplane.services import tenants
from tests.api_support import Tenant, create, deliver, make_ready, sign, stripe_event

pytest_plugins = ("tests.api_fixtures",)

MINUTES_10 = 600
YEAR = 365 * 24 * 3600


async def _stored(conn: AsyncConn, event_id: str) -> list[dict[str, object]]:
    cursor = await conn.execute("SELECT id, outcome, status FROM stripe_events WHERE id = %s", (event_id,))
    return [dict(r) for r in await cursor.fetchall()]


async def _hold(conn: AsyncConn, org_id: object) -> bool:
    cursor = await conn.execute("SELECT billing_hold FROM organisations WHERE id = %s", (org_id,))
    row = await cursor.fetchone()
    assert row is not None
    return bool(row["billing_hold"])


async def test_f10_clock_skew_with_stripe(client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn) -> None:
    """Our clock 10 minutes ahead of Stripe's (its timestamps look old) or behind (they look early):
    both beyond the 300 s tolerance, refused with 400 so that Stripe retries (docs/decisions.md);
    within it, accepted; a signature dated a year ahead is refused (the library would accept it)."""
    now = int(time.time())
    cases = {
        "evt_ahead": now - MINUTES_10,  # our clock is ahead of Stripe's
        "evt_behind": now + MINUTES_10,  # our clock is behind Stripe's
        "evt_year": now + YEAR,
    }
    for event_id, stamp in cases.items():
        payload = stripe_event(event_id, tenant.stripe_customer_id, "unpaid", 100)
        response = await deliver(client, payload, signature=sign(payload, timestamp=stamp))
        assert response.status_code == 400, (event_id, response.text)
        assert response.headers["content-type"] == "application/problem+json"
        assert response.json()["type"] == "urn:controlplane:problem:bad-signature"
        assert await _stored(conn, event_id) == []  # nothing recorded, nothing applied
    assert "ahead of our clock" in response.json()["detail"]
    assert not await _hold(conn, tenant.org_id)
    for event_id, skew in (("evt_early_ok", 200), ("evt_late_ok", -200)):
        payload = stripe_event(event_id, tenant.stripe_customer_id, "active", 100)
        response = await deliver(client, payload, signature=sign(payload, timestamp=now + skew))
        assert response.status_code == 200, response.text
    # The pure check: both directions, one bound, a header without a time.
    assert billing.signature_time_problem(f"t={now},v1=x", now) is None
    assert billing.signature_time_problem(f"t={now + 301},v1=x", now) is not None
    assert billing.signature_time_problem(f"t={now - 301},v1=x", now) is not None
    assert billing.signature_time_problem("v1=x", now) == "the signature has no timestamp"


async def test_f16_same_event_delivered_50_times_concurrently(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn, api_settings: Settings
) -> None:
    """Fifty concurrent deliveries of one hold: every one answered 2xx, one recorded event, one
    effect (one suspend job for the ready instance), the audit log clean."""
    ready = await create(client, tenant, "fifty")
    await make_ready(conn, api_settings, ready["id"])
    payload = stripe_event("evt_fifty", tenant.stripe_customer_id, "unpaid", 100)
    # Each delivery signs anew, as Stripe's retries do.
    responses = await asyncio.gather(*(deliver(client, payload, signature=sign(payload)) for _ in range(50)))
    assert [r.status_code for r in responses] == [200] * 50, {r.text for r in responses}
    outcomes = sorted(r.json()["outcome"] for r in responses)
    assert outcomes == ["duplicate"] * 49 + ["hold"]
    assert await _stored(conn, "evt_fifty") == [{"id": "evt_fifty", "outcome": "hold", "status": "unpaid"}]
    cursor = await conn.execute("SELECT instance_id FROM jobs WHERE kind = 'suspend'")
    assert [str(r["instance_id"]) for r in await cursor.fetchall()] == [ready["id"]]
    cursor = await conn.execute(
        "SELECT count(*) AS n FROM job_events e JOIN jobs j ON j.id = e.job_id WHERE j.kind = 'suspend'"
    )
    assert (await cursor.fetchone() or {})["n"] == 1  # one enqueue row
    assert await audit.verify(conn) == []


async def test_f18_event_before_the_customer_is_mapped(client: httpx.AsyncClient, conn: AsyncConn) -> None:
    """An event for a customer no organisation is linked to is recorded (2xx, `unknown_customer`);
    when an organisation is created for that customer, the newest decisive such event applies
    then (docs/decisions.md): a later `past_due` does not hide an earlier `unpaid`."""
    customer = "cus_not_yet_linked"
    for event_id, status, created in (("evt_u1", "active", 100), ("evt_u2", "unpaid", 200)):
        response = await deliver(client, stripe_event(event_id, customer, status, created))
        assert response.status_code == 200 and response.json()["outcome"] == "unknown_customer"
    response = await deliver(client, stripe_event("evt_u3", customer, "past_due", 300))
    assert response.json()["outcome"] == "unknown_customer"

    org, _ = await tenants.create_org(conn, "linked-late", customer)
    assert org["billing_hold"] is True and org["billing_status"] == "unpaid"
    assert org["billing_event_created"] == 200
    assert await _stored(conn, "evt_u2") == [
        {"id": "evt_u2", "outcome": "hold_on_mapping", "status": "unpaid"}
    ]
    assert (await _stored(conn, "evt_u1"))[0]["outcome"] == "unknown_customer"
    # Applied once: an older event delivered again is a duplicate; a newer release applies as usual.
    assert (await deliver(client, stripe_event("evt_u1", customer, "active", 100))).json()[
        "outcome"
    ] == "duplicate"
    release = await deliver(client, stripe_event("evt_u4", customer, "active", 400))
    assert release.json()["outcome"] == "release" and not await _hold(conn, org["id"])
    # An organisation linked to a customer nobody has heard of starts unheld, as before.
    fresh, _ = await tenants.create_org(conn, "linked-fresh", "cus_brand_new")
    assert fresh["billing_hold"] is False and fresh["billing_event_created"] is None
