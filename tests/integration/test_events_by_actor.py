"""`events --actor stripe` finds what a Stripe event caused: the billing hold's suspension, made
by a worker running the job the event enqueued (each move a job makes names it)."""

from __future__ import annotations

import httpx

from controlplane.core.kinds import SUSPEND
from controlplane.db.connection import AsyncConn
from controlplane.runtime.settings import Settings
from provisioners.noop import NoopProvisioner
from tests.api_support import Tenant, deliver, sign, stripe_event
from tests.operations_support import instance_in, ready_instance, registry_for, run_until

pytest_plugins = ("tests.api_fixtures",)


async def test_the_moves_of_a_stripe_events_jobs_are_found_by_its_actor(
    conn: AsyncConn,
    settings: Settings,
    client: httpx.AsyncClient,
    tenant: Tenant,
    admin_headers: dict[str, str],
) -> None:
    registry = registry_for(NoopProvisioner())
    iid = await ready_instance(conn, settings, registry, tenant.org_id)
    payload = stripe_event("evt_hold_1", tenant.stripe_customer_id, "unpaid", 1_700_000_000)
    assert (await deliver(client, payload, sign(payload))).status_code == 200
    await run_until(settings, registry, instance_in(iid, "suspended"))

    def moves(found: httpx.Response) -> list[tuple[str, str]]:
        assert found.status_code == 200, found.text
        return [(e["event"], e["actor"]["kind"]) for e in found.json()["items"]]

    by_kind = await client.get("/v1/admin/events", params={"actor": "stripe"}, headers=admin_headers)
    by_event = await client.get(
        "/v1/admin/events", params={"actor": "stripe:evt_hold_1"}, headers=admin_headers
    )
    other = await client.get("/v1/admin/events", params={"actor": "stripe:evt_other"}, headers=admin_headers)
    # The suspension's moves are the worker's, of the job the event enqueued.
    assert moves(by_kind) and {actor for _event, actor in moves(by_kind)} == {"worker"}
    assert by_kind.json()["items"][-1]["to_state"] == "suspended"
    assert moves(by_event) == moves(by_kind)
    assert moves(other) == []
    job_ids = {e["detail"]["job_id"] for e in by_kind.json()["items"]}
    (job_id,) = job_ids
    history = await client.get(f"/v1/admin/jobs/{job_id}", headers=admin_headers)
    first = history.json()["items"][0]
    assert (first["event"], first["actor"]) == ("enqueue", {"kind": "stripe", "id": "evt_hold_1"})
    assert history.json()["items"][-1]["to_state"] == "completed"
    # The worker's own moves of the provisioning are not the customer's-actor matches of Stripe.
    assert SUSPEND in {
        j["kind"] for j in (await client.get("/v1/admin/jobs", headers=admin_headers)).json()["items"]
    }
