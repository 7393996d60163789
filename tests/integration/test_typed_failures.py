"""Typed failures: a fault injected in each step of each operation ends the instance failed or
degraded with that step's code; customers read its reason (never the raw error), SREs the raw one."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest

from controlplane.audit import verify as audit
from controlplane.core import failures, lifecycle
from controlplane.core.faultspec import parse_faults
from controlplane.core.kinds import SUSPEND
from controlplane.db.connection import AsyncConn
from controlplane.runtime.settings import Settings
from provisioners.faults import FaultyProvisioner
from provisioners.noop import NoopProvisioner
from tests.api_support import Tenant, create
from tests.operations_support import enqueue, instance_in, registry_for, run_until, scalar

pytest_plugins = ("tests.api_fixtures",)


def faulty(spec: str) -> FaultyProvisioner:
    return FaultyProvisioner(NoopProvisioner(), parse_faults(spec))


async def to_ready(client: httpx.AsyncClient, tenant: Tenant, settings: Settings, conn: AsyncConn) -> str:
    made = await create(client, tenant, "orders")
    await run_until(settings, registry_for(NoopProvisioner()), instance_in(uuid.UUID(made["id"]), "ready"))
    return str(made["id"])


async def start(
    operation: str, client: httpx.AsyncClient, tenant: Tenant, settings: Settings, conn: AsyncConn
) -> str:
    """The instance and the request that runs `operation` on it."""
    if operation == "provision":
        return str((await create(client, tenant, "orders"))["id"])
    iid = await to_ready(client, tenant, settings, conn)
    if operation == "update":
        response = await client.patch(f"/v1/instances/{iid}", json={"plan": "small"}, headers=tenant.headers)
    elif operation == "deprovision":
        response = await client.delete(f"/v1/instances/{iid}", headers=tenant.headers)
    else:
        # A billing hold: the suspend job the hold's webhook would enqueue.
        await conn.execute("UPDATE organisations SET billing_hold = true WHERE id = %s", (tenant.org_id,))
        await enqueue(conn, SUSPEND, uuid.UUID(iid), billing=True)
        return iid
    assert response.status_code == 202, response.text
    return iid


@pytest.mark.parametrize(
    ("operation", "fault", "state", "code"),
    [
        ("provision", "allocate_storage:fail_permanent", "failed", "storage_allocation_failed"),
        ("provision", "configure_network:fail_permanent", "failed", "network_configuration_failed"),
        ("provision", "initialize_database:fail_permanent", "failed", "database_initialization_failed"),
        # Temporary failures until the attempts are over: still named after the step.
        ("provision", "configure_network:fail:*", "failed", "network_configuration_failed"),
        ("provision", "allocate_storage:quota", "failed", "quota_exceeded"),
        ("update", "apply_plan:fail_permanent", "degraded", "plan_change_failed"),
        ("suspend", "suspend:fail_permanent", "degraded", "suspend_failed"),
        ("deprovision", "final_backup:fail_permanent", "failed", "final_backup_failed"),
        ("deprovision", "deprovision:fail_permanent", "failed", "deprovision_failed"),
    ],
)
async def test_a_failure_in_each_step_ends_with_its_code_and_a_customer_message(
    operation: str,
    fault: str,
    state: str,
    code: str,
    client: httpx.AsyncClient,
    tenant: Tenant,
    admin_headers: dict[str, str],
    conn: AsyncConn,
    api_settings: Settings,
) -> None:
    settings = api_settings.replace(job_max_attempts=2, retry_base_delay_s=0, retry_max_delay_s=0)
    iid = await start(operation, client, tenant, settings, conn)
    await run_until(settings, registry_for(faulty(fault)), instance_in(uuid.UUID(iid), state))

    shown = (await client.get(f"/v1/instances/{iid}", headers=tenant.headers)).json()
    reason = failures.REASONS[code]
    assert shown["state"] == state and shown["failure"] == reason.as_dict()
    assert (shown["failure_code"], shown["failure_reason"]) == (code, reason.message)
    assert ("retry" in shown["allowed_actions"]) == (state == "failed" and reason.retryable)
    events = (await client.get(f"/v1/instances/{iid}/events", headers=tenant.headers)).json()["items"]
    moved = [e for e in events if e["to_state"] == state][-1]
    edge = lifecycle.INSTANCE.edge_info[(moved["from_state"], moved["event"])]
    assert (moved["reason"], moved["detail"]["code"], moved["label"]) == (reason.message, code, edge.label)
    assert edge.alerts
    # The raw error (the injected fault's words) reaches no customer document, only SREs.
    customer_text = json.dumps(shown) + json.dumps(events)
    assert "injected fault" not in customer_text
    sre = (await client.get(f"/v1/admin/instances/{iid}", headers=admin_headers)).json()
    assert "injected fault" in sre["failure_reason_raw"] and sre["failure_code"] == code
    failed_steps = [s for s in sre["steps"] if s["event"] == "failed"]
    step = fault.split(":")[0]
    assert failed_steps and failed_steps[-1]["step"] == step and failed_steps[-1]["code"] == code
    assert "injected fault" in failed_steps[-1]["error"]
    raw = (await client.get("/v1/admin/events", params={"instance": iid}, headers=admin_headers)).json()
    assert any("injected fault" in (e["reason"] or "") for e in raw["items"])
    assert await audit.verify(conn) == []


async def test_a_retry_of_a_reason_that_a_retry_cannot_help_is_refused_with_a_typed_problem(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn, api_settings: Settings
) -> None:
    iid = (await create(client, tenant, "orders"))["id"]
    await run_until(
        api_settings, registry_for(faulty("allocate_storage:quota")), instance_in(uuid.UUID(iid), "failed")
    )
    before = await scalar(conn, "SELECT row_to_json(i)::text FROM instances i WHERE id = %s", (iid,))
    refused = await client.post(f"/v1/instances/{iid}/retry", headers=tenant.headers)
    assert refused.status_code == 409, refused.text
    problem: dict[str, Any] = refused.json()
    assert problem["type"] == "urn:controlplane:problem:not-retryable"
    assert problem["failure"] == failures.REASONS["quota_exceeded"].as_dict()
    assert problem["current_state"] == "failed" and problem["allowed_actions"] == ["delete"]
    assert await scalar(conn, "SELECT count(*) FROM instances") == 1
    assert await scalar(conn, "SELECT row_to_json(i)::text FROM instances i WHERE id = %s", (iid,)) == before
    # A ready instance cannot be retried either: there is nothing to retry.
    ready = await to_ready(client, tenant, api_settings, conn)
    not_failed = await client.post(f"/v1/instances/{ready}/retry", headers=tenant.headers)
    assert not_failed.status_code == 409 and not_failed.json()["type"].endswith(":invalid-state")
    elsewhere = await client.post(f"/v1/instances/{uuid.uuid4()}/retry", headers=tenant.headers)
    assert elsewhere.status_code == 404
