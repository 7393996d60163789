"""An organisation made without a Stripe customer is linked to one later (issue 30, item 6): by the
use case, the admin route PATCH /v1/orgs/{id} and `controlplane orgs update`. The subscription
events received for that customer before the link apply then, as at creation; a link is made once
and not moved."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest

from controlplane.cli import main
from controlplane.core.refusals import Conflict, NotFound, OrgExists
from controlplane.db.connection import AsyncConn
from controlplane.services import tenants
from tests.api_support import deliver, stripe_event
from tests.fake_api import Answer, fake_api

pytest_plugins = ("tests.api_fixtures",)


async def test_linking_applies_what_the_customer_did_before(
    client: httpx.AsyncClient, conn: AsyncConn
) -> None:
    org, _ = await tenants.create_org(conn, "acme")
    assert org["stripe_customer_id"] is None
    unpaid = await deliver(client, stripe_event("evt_link_1", "cus_acme", "unpaid", 100))
    assert unpaid.json()["outcome"] == "unknown_customer"

    linked = await tenants.link_stripe_customer(conn, org["id"], "cus_acme")
    assert linked["stripe_customer_id"] == "cus_acme"
    assert linked["billing_hold"] is True and linked["billing_status"] == "unpaid"
    # Again with the same customer: nothing changes; with another, or a missing organisation: refused.
    assert (await tenants.link_stripe_customer(conn, org["id"], "cus_acme"))["billing_hold"] is True
    with pytest.raises(Conflict, match="linked to Stripe customer cus_acme already"):
        await tenants.link_stripe_customer(conn, org["id"], "cus_other")
    with pytest.raises(NotFound):
        await tenants.link_stripe_customer(conn, uuid.uuid4(), "cus_x")
    # From now on the customer's events apply to it.
    released = await deliver(client, stripe_event("evt_link_2", "cus_acme", "active", 200))
    assert released.json()["outcome"] == "release"


async def test_a_customer_has_one_organisation(conn: AsyncConn) -> None:
    await tenants.create_org(conn, "first", "cus_shared")
    second, _ = await tenants.create_org(conn, "second")
    with pytest.raises(OrgExists, match="this Stripe customer"):
        await tenants.link_stripe_customer(conn, second["id"], "cus_shared")


async def test_the_admin_route(
    client: httpx.AsyncClient, admin_headers: dict[str, str], conn: AsyncConn
) -> None:
    org, key = await tenants.create_org(conn, "initech")
    path = f"/v1/orgs/{org['id']}"
    body = {"stripe_customer_id": "cus_initech"}
    customer = {"Authorization": f"Bearer {key.plaintext}"}
    assert (await client.patch(path, json=body, headers=customer)).status_code == 403
    answer = await client.patch(path, json=body, headers=admin_headers)
    assert answer.status_code == 200, answer.text
    assert answer.json()["stripe_customer_id"] == "cus_initech" and answer.json()["name"] == "initech"
    again = await client.patch(path, json={"stripe_customer_id": "cus_other"}, headers=admin_headers)
    assert again.status_code == 409 and again.json()["type"] == "urn:controlplane:problem:conflict"
    missing = await client.patch(f"/v1/orgs/{uuid.uuid4()}", json=body, headers=admin_headers)
    assert missing.status_code == 404
    invalid = await client.patch(path, json={"stripe_customer_id": "cus x"}, headers=admin_headers)
    assert invalid.status_code == 422


async def test_the_command_names_the_organisation(capsys: pytest.CaptureFixture[str]) -> None:
    org = {"id": str(uuid.uuid4()), "name": "acme", "stripe_customer_id": "cus_acme", "billing_hold": False}
    script = (Answer(200, {"items": [org]}), Answer(200, org))
    with fake_api(*script) as server:
        argv = [
            "orgs",
            "update",
            "acme",
            "--stripe-customer",
            "cus_acme",
            "--url",
            server.url,
            "--api-key",
            "k",
        ]
        assert await asyncio.to_thread(main, argv) == 0
    assert capsys.readouterr().out.strip() == "organisation acme is billed to Stripe customer cus_acme"
    assert [(r.method, r.path, r.body) for r in server.received] == [
        ("GET", "/v1/orgs?name=acme", None),
        ("PATCH", f"/v1/orgs/{org['id']}", {"stripe_customer_id": "cus_acme"}),
    ]
