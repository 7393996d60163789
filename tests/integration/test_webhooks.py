"""Stripe webhooks end to end: signatures, de-duplication, ordering, holds and releases."""

from __future__ import annotations

import time

import httpx

from controlplane.audit import verify as audit
from controlplane.db.connection import AsyncConn
from controlplane.runtime.settings import Settings
from tests.api_support import Tenant, create, deliver, drive, make_ready, serving, sign, stripe_event

pytest_plugins = ("tests.api_fixtures",)


async def _org(conn: AsyncConn, tenant: Tenant) -> dict[str, object]:
    cursor = await conn.execute(
        "SELECT billing_hold, billing_status, billing_event_created FROM organisations WHERE id = %s",
        (tenant.org_id,),
    )
    row = await cursor.fetchone()
    assert row is not None
    return dict(row)


async def _jobs(conn: AsyncConn, kind: str) -> list[dict[str, object]]:
    cursor = await conn.execute("SELECT instance_id, payload FROM jobs WHERE kind = %s", (kind,))
    return [dict(r) for r in await cursor.fetchall()]


async def _outcome(conn: AsyncConn, event_id: str) -> str | None:
    cursor = await conn.execute("SELECT outcome FROM stripe_events WHERE id = %s", (event_id,))
    row = await cursor.fetchone()
    return None if row is None else str(row["outcome"])


async def test_bad_missing_or_stale_signatures_are_400(client: httpx.AsyncClient, conn: AsyncConn) -> None:
    payload = stripe_event("evt_sig", "cus_x", "unpaid", 100)
    assert (await deliver(client, payload, signature=sign(payload, secret="whsec_wrong"))).status_code == 400
    stale = sign(payload, timestamp=int(time.time()) - 3600)
    response = await deliver(client, payload, signature=stale)
    assert response.status_code == 400
    assert response.json()["type"] == "urn:controlplane:problem:bad-signature"
    missing = await client.post(
        "/v1/webhooks/stripe", content=payload, headers={"Content-Type": "application/json"}
    )
    assert missing.status_code == 400
    tampered = payload.replace(b"unpaid", b"active")
    assert (await deliver(client, tampered, signature=sign(payload))).status_code == 400
    assert await _outcome(conn, "evt_sig") is None


async def test_hold_suspends_ready_instances_and_release_resumes_those_suspended_by_billing(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn, api_settings: Settings
) -> None:
    ready = await create(client, tenant, "ready-one")
    await make_ready(conn, api_settings, ready["id"])
    pending = await create(client, tenant, "pending-one")
    response = await deliver(client, stripe_event("evt_hold", tenant.stripe_customer_id, "unpaid", 100))
    assert response.status_code == 200 and response.json() == {"received": True, "outcome": "hold"}
    assert await _org(conn, tenant) == {
        "billing_hold": True,
        "billing_status": "unpaid",
        "billing_event_created": 100,
    }
    suspends = await _jobs(conn, "suspend")
    assert [str(j["instance_id"]) for j in suspends] == [ready["id"]]  # the pending one waits for ready
    shown = (await client.get(f"/v1/instances/{pending['id']}", headers=tenant.headers)).json()
    assert shown["billing_hold"] is True
    # the worker suspends it (what the suspend job does)
    await drive(conn, ready["id"], "suspend", suspended_by_billing=True)
    response = await deliver(client, stripe_event("evt_release", tenant.stripe_customer_id, "active", 200))
    assert response.json()["outcome"] == "release"
    assert (await _org(conn, tenant))["billing_hold"] is False
    assert [str(j["instance_id"]) for j in await _jobs(conn, "resume")] == [ready["id"]]
    cursor = await conn.execute(
        "SELECT e.actor_kind, e.actor_id FROM job_events e JOIN jobs j ON j.id = e.job_id"
        " WHERE j.kind = 'resume'"
    )
    assert await cursor.fetchall() == [{"actor_kind": "stripe", "actor_id": "evt_release"}]
    assert await _outcome(conn, "evt_hold") == "hold" and await _outcome(conn, "evt_release") == "release"


async def test_the_same_event_five_times_has_one_effect(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn, api_settings: Settings
) -> None:
    made = await create(client, tenant, "orders")
    await make_ready(conn, api_settings, made["id"])
    payload = stripe_event("evt_dup", tenant.stripe_customer_id, "canceled", 100)
    outcomes = [(await deliver(client, payload)).json()["outcome"] for _ in range(5)]
    assert outcomes == ["hold", "duplicate", "duplicate", "duplicate", "duplicate"]
    cursor = await conn.execute(
        "SELECT count(*) AS n FROM job_events e JOIN jobs j ON j.id = e.job_id WHERE j.kind = 'suspend'"
    )
    assert (await cursor.fetchone()) == {"n": 1}
    cursor = await conn.execute("SELECT count(*) AS n FROM stripe_events")
    assert (await cursor.fetchone()) == {"n": 1}


async def test_out_of_order_delivery_ends_with_the_newest_events_decision(
    client: httpx.AsyncClient, tenant: Tenant, other_tenant: Tenant, conn: AsyncConn
) -> None:
    older_hold = stripe_event("evt_old", tenant.stripe_customer_id, "unpaid", 100)
    newer_release = stripe_event("evt_new", tenant.stripe_customer_id, "active", 200)
    assert (await deliver(client, newer_release)).json()["outcome"] == "release"
    assert (await deliver(client, older_hold)).json()["outcome"] == "stale"
    assert (await _org(conn, tenant))["billing_hold"] is False
    # and the mirror image on another organisation: newest is a hold
    older_release = stripe_event("evt_old2", other_tenant.stripe_customer_id, "active", 100)
    newer_hold = stripe_event("evt_new2", other_tenant.stripe_customer_id, "paused", 200)
    await deliver(client, newer_hold)
    await deliver(client, older_release)
    assert (await _org(conn, other_tenant))["billing_hold"] is True
    assert await _outcome(conn, "evt_old2") == "stale"


async def test_past_due_changes_nothing_and_does_not_hide_an_older_decision(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn
) -> None:
    assert (await deliver(client, stripe_event("e1", tenant.stripe_customer_id, "past_due", 200))).json()[
        "outcome"
    ] == "no_change"
    assert (await _org(conn, tenant))["billing_hold"] is False
    assert (await deliver(client, stripe_event("e2", tenant.stripe_customer_id, "unpaid", 150))).json()[
        "outcome"
    ] == "hold"


async def test_unknown_customers_and_other_types_are_recorded_without_effect(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn
) -> None:
    unknown = await deliver(client, stripe_event("evt_u", "cus_nobody", "unpaid", 100))
    assert unknown.status_code == 200 and unknown.json()["outcome"] == "unknown_customer"
    other = await deliver(
        client, stripe_event("evt_i", tenant.stripe_customer_id, "unpaid", 100, "invoice.paid")
    )
    assert other.status_code == 200 and other.json()["outcome"] == "ignored"
    assert await _outcome(conn, "evt_u") == "unknown_customer" and await _outcome(conn, "evt_i") == "ignored"
    assert (await _org(conn, tenant))["billing_hold"] is False
    assert await audit.verify(conn) == []


async def test_not_a_stripe_event_is_400(client: httpx.AsyncClient) -> None:
    for payload in (b"[1, 2]", b"{}", b"not json"):
        response = await deliver(client, payload)
        assert response.status_code == 400, payload


async def test_hostile_signed_events_are_400_problems_and_nothing_is_recorded(
    api_settings: Settings, conn: AsyncConn, tenant: Tenant
) -> None:
    """A signed body nested 5,000 deep, and event ids or values holding a lone surrogate (JSON can
    spell them, UTF-8 cannot): each refused whole with a 400 problem, none half-recorded."""
    async with serving(api_settings, max_body_bytes=65536) as client:
        await _hostile_events_refused(client, conn, tenant)


async def _hostile_events_refused(client: httpx.AsyncClient, conn: AsyncConn, tenant: Tenant) -> None:
    deep = b'{"id": "evt_deep", "type": "customer.subscription.updated", "data": ' + b'{"a": ' * 5000
    deep += b"1" + b"}" * 5001
    lone = stripe_event("evt_\\ud800", tenant.stripe_customer_id, "unpaid", 100).replace(
        b"evt_\\\\ud800", b"evt_\\ud800"
    )
    assert b'"evt_\\ud800"' in lone
    in_status = stripe_event("evt_status", tenant.stripe_customer_id, "unpaid", 100).replace(
        b'"unpaid"', b'"unpaid\\udfff"'
    )
    for payload in (deep, lone, in_status):
        response = await deliver(client, payload)
        assert response.status_code == 400, response.text
        assert response.headers["content-type"] == "application/problem+json"
        assert response.json()["type"] == "urn:controlplane:problem:bad-request"
    cursor = await conn.execute("SELECT count(*) AS n FROM stripe_events")
    assert await cursor.fetchone() == {"n": 0}
    assert (await _org(conn, tenant))["billing_hold"] is False
    # The endpoint still takes a good event after them.
    good = await deliver(client, stripe_event("evt_good", tenant.stripe_customer_id, "unpaid", 100))
    assert good.status_code == 200 and good.json()["outcome"] == "hold"


async def test_an_event_created_after_its_signature_is_refused_and_later_events_still_apply(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn
) -> None:
    """A validly signed event whose `created` is 10^7 s ahead would become the ordering watermark and
    make every genuine event after it `stale`: it is refused (400 problem), nothing recorded."""
    signed = int(time.time())
    ahead = stripe_event("evt_ahead", tenant.stripe_customer_id, "active", signed + 10**7)
    refused = await deliver(client, ahead, signature=sign(ahead, timestamp=signed))
    assert refused.status_code == 400, refused.text
    assert refused.headers["content-type"] == "application/problem+json"
    assert refused.json()["type"] == "urn:controlplane:problem:bad-request"
    assert "created" in refused.json()["detail"]
    assert await _outcome(conn, "evt_ahead") is None
    assert (await _org(conn, tenant))["billing_event_created"] is None
    # Within the signature's tolerance it is Stripe's own clock: accepted.
    near = stripe_event("evt_near", tenant.stripe_customer_id, "unpaid", signed + 200)
    assert (await deliver(client, near, signature=sign(near, timestamp=signed))).json()["outcome"] == "hold"
    genuine = stripe_event("evt_genuine", tenant.stripe_customer_id, "active", signed + 201)
    assert (await deliver(client, genuine, signature=sign(genuine, timestamp=signed + 1))).json()[
        "outcome"
    ] == "release"
