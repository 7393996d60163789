"""On real instance servers: progress while provisioning, a failure at a step, the retry that makes a
new instance of the same name ready (the failed one unchanged and linked), and the deletion of the
failed one, which leaves no directory, port, server or role behind and archives it."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import httpx
import pytest
from fastapi import FastAPI

from controlplane.api.app import create_app
from controlplane.audit import verify as audit
from controlplane.core import failures
from controlplane.core.faultspec import parse_faults
from controlplane.core.kinds import DEPROVISION, OPERATION_STEPS, PROVISION
from controlplane.db.connection import AsyncConn
from controlplane.handlers import operations
from controlplane.queue.registry import JobKind, JobRegistry
from controlplane.runtime.postgres import port_in_use
from controlplane.runtime.settings import Settings
from controlplane.services import tenants
from provisioners.faults import FaultyProvisioner
from provisioners.local import LocalProvisioner, owner_role
from tests.api_support import Tenant, make_tenant
from tests.operations_support import instance, instance_in, job_finished, registry_for, run_until, scalar
from tests.provisioning_support import connect, credentials

T = TypeVar("T")


class Observed(FaultyProvisioner):
    """Faults as given; before each provisioning step, `look` is called (what a customer sees then)."""

    def __init__(self, inner: LocalProvisioner, faults: str, look: Callable[[str], Awaitable[None]]) -> None:
        super().__init__(inner, parse_faults(faults))
        self.look = look

    async def _around(self, step: str, work: Callable[[], Awaitable[T]]) -> T:
        if step in OPERATION_STEPS[PROVISION]:
            await self.look(step)
        return await super()._around(step, work)


def without_cleanup(provisioner: FaultyProvisioner) -> JobRegistry:
    """The instance operations, but no worker here runs a deprovision (a failure's leftovers stay)."""
    table = operations.kind_table(operations.Operations(provisioner))
    return JobRegistry(
        [
            JobKind(k.name, None if k.name == DEPROVISION else k.handler, on_abandoned=k.on_abandoned)
            for k in table
        ]
    )


@pytest.fixture
async def local_client(local_settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    application: FastAPI = create_app(local_settings)
    async with application.router.lifespan_context(application):
        transport = httpx.ASGITransport(app=application, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            yield http


async def test_a_failed_instance_is_retried_into_a_ready_one_and_deleted_without_leftovers(
    local_client: httpx.AsyncClient, conn: AsyncConn, local_settings: Settings
) -> None:
    client, settings = local_client, local_settings
    tenant: Tenant = await make_tenant(conn, "acme")
    local = LocalProvisioner(settings)
    made = (
        await client.post("/v1/instances", json={"name": "orders", "plan": "dev"}, headers=tenant.headers)
    ).json()
    failed_id = uuid.UUID(made["id"])
    seen: dict[str, dict[str, Any]] = {}

    async def look(step: str) -> None:
        doc = (await client.get(f"/v1/instances/{failed_id}", headers=tenant.headers)).json()
        seen[step] = doc["progress"]

    # The database server is initialised, then the step fails: its server, port and role are left.
    faulty = Observed(local, "initialize_database:fail_permanent:1:after", look)
    await run_until(settings, without_cleanup(faulty), instance_in(failed_id, "failed"))

    # Progress as each step ran: the ones before done, with their times, this one running, the
    # next ones pending.
    at_network = seen["configure_network"]
    assert at_network["operation"] == "provision" and at_network["attempt"] == 1
    assert at_network["current_step"] == "configure_network"
    assert [(s["name"], s["state"]) for s in at_network["steps"]] == [
        ("allocate_storage", "done"),
        ("configure_network", "running"),
        ("initialize_database", "pending"),
        ("configure_archive", "pending"),
    ]
    storage = at_network["steps"][0]
    assert storage["started_at"] < storage["finished_at"] and storage["duration_s"] > 0
    at_init = seen["initialize_database"]
    assert [s["state"] for s in at_init["steps"]] == ["done", "done", "running", "pending"]
    assert at_init["overdue"] is False and at_init["expected_by"] <= at_init["deadline_at"]

    failed = (await client.get(f"/v1/instances/{failed_id}", headers=tenant.headers)).json()
    assert failed["failure"] == failures.REASONS["database_initialization_failed"].as_dict()
    assert failed["progress"] is None and failed["allowed_actions"] == ["retry", "delete"]
    assert failed["state_info"]["severity"] == "fault" and failed["state_info"]["billing"] == "not_billed"
    left = await local.inventory()
    assert {r.instance_id for r in left} == {failed_id}
    port = local.ports.port_of(failed_id)
    assert port is not None and port_in_use(port, local.advertise_host)
    assert owner_role(failed_id) in local.roles(failed_id)

    # Retry: a new instance with the failed one's name and spec, linked both ways.
    faulty.faults = []
    before = await scalar(conn, "SELECT row_to_json(i)::text FROM instances i WHERE id = %s", (failed_id,))
    key = {**tenant.headers, "Idempotency-Key": "retry-orders-1"}
    retried = await client.post(f"/v1/instances/{failed_id}/retry", headers=key)
    assert retried.status_code == 202, retried.text
    new = retried.json()
    assert (new["name"], new["plan"], new["state"], new["replaces"]) == (
        "orders",
        "dev",
        "pending",
        str(failed_id),
    )
    assert retried.headers["Location"] == f"/v1/instances/{new['id']}"
    assert new["progress"]["operation"] == "provision"
    replay = await client.post(f"/v1/instances/{failed_id}/retry", headers=key)
    assert replay.status_code == 202 and replay.json()["id"] == new["id"]
    assert replay.headers["Idempotent-Replayed"] == "true"
    twice = await client.post(f"/v1/instances/{failed_id}/retry", headers=tenant.headers)
    assert twice.status_code == 409 and twice.json()["type"].endswith(":already-replaced")
    assert twice.json()["replaced_by"] == new["id"]

    new_id = uuid.UUID(new["id"])
    await run_until(settings, without_cleanup(faulty), instance_in(new_id, "ready"))
    with connect(credentials(settings, await instance(conn, new_id))) as customer:
        customer.execute("CREATE TABLE orders (id int)")
    # The failed one is unchanged (its row to the byte), terminal, and names its replacement.
    assert (
        await scalar(conn, "SELECT row_to_json(i)::text FROM instances i WHERE id = %s", (failed_id,))
        == before
    )
    old = (await client.get(f"/v1/instances/{failed_id}", headers=tenant.headers)).json()
    assert (old["state"], old["replaced_by"], old["allowed_actions"]) == ("failed", new["id"], ["delete"])

    # Deleting the failed instance: archived, and what it left is removed through the provisioner.
    deleted = await client.delete(f"/v1/instances/{failed_id}", headers=tenant.headers)
    assert deleted.status_code == 202, deleted.text
    archived = deleted.json()
    assert archived["state"] == "failed" and archived["archived_at"] and archived["allowed_actions"] == []
    cleanup = await scalar(
        conn,
        "SELECT id FROM jobs WHERE instance_id = %s AND kind = 'deprovision' ORDER BY created_at LIMIT 1",
        (failed_id,),
    )
    await run_until(settings, registry_for(faulty), job_finished(cleanup))
    assert {r.instance_id for r in await local.inventory()} == {new_id}
    assert not local.instance_dir(failed_id).exists() and local.ports.port_of(failed_id) is None
    assert not port_in_use(port, local.advertise_host)
    assert (await instance(conn, failed_id))["state"] == "failed"

    listed = (await client.get("/v1/instances", headers=tenant.headers)).json()["items"]
    assert [i["id"] for i in listed] == [new["id"]]
    every = (await client.get("/v1/instances?include=archived", headers=tenant.headers)).json()["items"]
    assert [i["id"] for i in every] == [str(failed_id), new["id"]]

    # Asking again: accepted, the same archive time; its cleanup, the customer's, finds nothing left.
    again = await client.delete(f"/v1/instances/{failed_id}", headers=tenant.headers)
    assert again.status_code == 202 and again.json()["archived_at"] == archived["archived_at"]
    second = await scalar(
        conn,
        "SELECT j.id FROM jobs j JOIN job_events e ON e.job_id = j.id AND e.event = 'enqueue'"
        " WHERE j.instance_id = %s AND j.kind = 'deprovision' AND e.actor_kind = 'customer'",
        (failed_id,),
    )
    await run_until(settings, registry_for(faulty), job_finished(second))
    verdict = await scalar(conn, "SELECT verdict FROM jobs WHERE id = %s", (second,))
    assert verdict["result"] == "cleaned up" and verdict["removed"] is False

    # The ready one deleted with its final backup: customers are told the backup's name, never where
    # the server keeps it; SREs see that.
    assert (await client.delete(f"/v1/instances/{new_id}", headers=tenant.headers)).status_code == 202
    await run_until(settings, registry_for(faulty), instance_in(new_id, "deleted"))
    events = (await client.get(f"/v1/instances/{new_id}/events", headers=tenant.headers)).json()["items"]
    final = events[-1]
    assert final["event"] == "deprovisioned" and final["reason"].startswith("final backup ")
    assert settings.data_dir is not None and str(settings.data_dir) not in json.dumps(events)
    assert "/" not in final["reason"] and "sre" not in final["detail"]
    assert final["detail"]["backup"] == final["reason"].removeprefix("final backup ")
    admin = await tenants.create_admin_key(conn)
    raw = (
        await client.get(
            "/v1/admin/events",
            params={"instance": str(new_id), "event": "deprovisioned"},
            headers={"Authorization": f"Bearer {admin.plaintext}"},
        )
    ).json()["items"]
    location = raw[0]["detail"]["sre"]["location"]
    assert location.startswith(str(settings.data_dir)) and location.endswith(final["detail"]["backup"])
    assert await audit.verify(conn) == []
