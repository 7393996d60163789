"""The API, the worker's operations and the kubernetes provisioner together, on the fake API server
with the Role enforced: create, ready with TLS details, resize, restore into a new instance, delete
with a final backup; restore_from refused across organisations and where nothing restores; storage
autoscaling patching the Cluster's storage size."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from fastapi import FastAPI

from controlplane.core.dbmetrics import GIB, DatabaseStats
from controlplane.core.kinds import BACKUP, RESUME, SUSPEND
from controlplane.db.connection import AsyncConn
from controlplane.queue.consumers import LogEvent
from controlplane.queue.registry import JobRegistry
from controlplane.runtime.settings import Settings
from controlplane.services import notices
from controlplane.services.policy import Policy
from provisioners.base import Observation
from provisioners.kubernetes import KubernetesProvisioner
from tests.api_support import WEBHOOK_SECRET, Tenant, create
from tests.kubernetes_fake import FakeCluster
from tests.kubernetes_support import NAMESPACE, OBJECT_STORE, provisioner_on_fake, role_from
from tests.operations_support import (
    enqueue,
    instance,
    instance_in,
    job_finished,
    registry_for,
    run_until,
    scalar,
)
from tests.reconciler_support import reconciling
from tests.support import eventually

pytest_plugins = ("tests.api_fixtures",)


@pytest.fixture
def api_settings(settings: Settings) -> Settings:
    return settings.replace(
        stripe_webhook_secret=WEBHOOK_SECRET,
        provisioner="kubernetes",
        kubernetes_namespace=NAMESPACE,
        retry_base_delay_s=0.05,
        retry_max_delay_s=0.2,
        poll_interval_s=0.1,
    )


@pytest.fixture
def k8s() -> Iterator[tuple[KubernetesProvisioner, FakeCluster]]:
    with provisioner_on_fake(role_from(), kubernetes_backup_object_store=OBJECT_STORE) as pair:
        yield pair


async def ready_ha_instance(
    client: httpx.AsyncClient, tenant: Tenant, settings: Settings, provisioner: KubernetesProvisioner
) -> tuple[JobRegistry, uuid.UUID, str]:
    """An HA (`small`) instance `orders` made ready on the fake cluster: the registry that ran it,
    its id, and its Cluster's name."""
    registry = registry_for(provisioner)
    made = await create(client, tenant, "orders", plan="small")
    iid = uuid.UUID(made["id"])
    await run_until(settings, registry, instance_in(iid, "ready"))
    return registry, iid, f"pg-{iid}"


async def test_an_instance_on_cloudnativepg_from_create_to_delete_and_restored(
    client: httpx.AsyncClient,
    tenant: Tenant,
    other_tenant: Tenant,
    conn: AsyncConn,
    api_settings: Settings,
    k8s: tuple[KubernetesProvisioner, FakeCluster],
) -> None:
    provisioner, state = k8s
    registry = registry_for(provisioner)
    made = await create(client, tenant, "orders")
    await run_until(api_settings, registry, instance_in(uuid.UUID(made["id"]), "ready"))
    body = (await client.get(f"/v1/instances/{made['id']}", headers=tenant.headers)).json()
    connection = body["connection"]
    assert connection["host"] == f"pg-{made['id']}-rw.{NAMESPACE}.svc"
    assert connection["sslmode"] == "verify-full" and "BEGIN CERTIFICATE" in connection["ca_certificate"]
    assert connection["uri"].endswith("/app?sslmode=verify-full&sslrootcert=controlplane-ca.pem")
    assert connection["password"] and connection["sslrootcert"] == "controlplane-ca.pem"
    assert (body["instances"], body["storage_gb"]) == (1, 1)
    cluster = state.get("clusters", NAMESPACE, f"pg-{made['id']}")
    assert cluster is not None
    assert cluster["metadata"]["labels"]["controlplane.io/org-id"] == str(tenant.org_id)

    changed = await client.patch(
        f"/v1/instances/{made['id']}", json={"plan": "small"}, headers=tenant.headers
    )
    assert changed.status_code == 202, changed.text
    await run_until(
        api_settings,
        registry,
        lambda c: scalar(c, "SELECT observed_generation = 2 FROM instances WHERE id = %s", (made["id"],)),
    )
    cluster = state.get("clusters", NAMESPACE, f"pg-{made['id']}")
    assert (
        cluster is not None
        and cluster["spec"]["instances"] == 2
        and cluster["spec"]["storage"]["size"] == "10Gi"
    )

    # Its recoverable window, from the Cluster's status: from its first backup's end, up to the
    # operator's archive timeout before the reconciler's observation.
    taken = await enqueue(conn, BACKUP, uuid.UUID(made["id"]), backup_kind="on_demand")
    await run_until(api_settings, registry, job_finished(taken["id"]))
    async with reconciling(api_settings, provisioner) as rec:
        await rec.run_once()
    window = (await client.get(f"/v1/instances/{made['id']}/recovery", headers=tenant.headers)).json()
    assert window["earliest"].startswith("2026-01-01T00:00:00") and window["archive"]["healthy"] is True
    outside = await client.post(
        "/v1/instances",
        json={
            "name": "copy",
            "plan": "dev",
            "restore_from": {"instance_id": made["id"], "point_in_time": "2025-12-31T00:00:00Z"},
        },
        headers=tenant.headers,
    )
    assert outside.status_code == 422 and outside.json()["recoverable_window"]["earliest"] is not None

    # Another organisation cannot restore this one's data; this one can, to a point in time.
    foreign = await client.post(
        "/v1/instances",
        json={"name": "copy", "plan": "dev", "restore_from": {"instance_id": made["id"]}},
        headers=other_tenant.headers,
    )
    assert foreign.status_code == 404 and "no instance" in foreign.json()["detail"]
    restored = await create(
        client,
        tenant,
        "orders-copy",
        restore_from={"instance_id": made["id"], "point_in_time": "2026-05-01T12:00:00Z"},
    )
    assert restored["restore_from"]["instance_id"] == made["id"]
    await run_until(api_settings, registry, instance_in(uuid.UUID(restored["id"]), "ready"))
    copy = state.get("clusters", NAMESPACE, f"pg-{restored['id']}")
    assert copy is not None
    recovery = copy["spec"]["bootstrap"]["recovery"]
    assert recovery["recoveryTarget"] == {"targetTime": "2026-05-01T12:00:00Z"}
    assert copy["spec"]["externalClusters"][0]["plugin"]["parameters"]["serverName"] == f"pg-{made['id']}"

    deleted = await client.delete(f"/v1/instances/{made['id']}", headers=tenant.headers)
    assert deleted.status_code == 202, deleted.text
    await run_until(api_settings, registry, instance_in(uuid.UUID(made["id"]), "deleted"))
    backup = await scalar(
        conn,
        "SELECT detail->>'backup' FROM instance_events WHERE instance_id = %s AND event = 'deprovisioned'",
        (made["id"],),
    )
    assert backup == f"pg-{made['id']}-final"
    final = state.get("backups", NAMESPACE, backup)
    assert final is not None and final["status"]["phase"] == "completed"
    assert state.get("clusters", NAMESPACE, f"pg-{made['id']}") is None
    assert state.denied == []


async def test_restore_from_is_refused_where_the_provisioner_does_not_restore(
    client: httpx.AsyncClient, tenant: Tenant, app: FastAPI, api_settings: Settings
) -> None:
    made = await create(client, tenant, "orders")
    noop = api_settings.replace(provisioner="noop")
    app.state.controlplane.settings = noop
    app.state.controlplane.policy = Policy.from_settings(noop)
    response = await client.post(
        "/v1/instances",
        json={"name": "copy", "plan": "dev", "restore_from": {"instance_id": made["id"]}},
        headers=tenant.headers,
    )
    assert response.status_code == 422
    assert (
        response.json()["detail"] == "restore_from is not supported by the noop provisioner of this service"
    )
    naive = await client.post(
        "/v1/instances",
        json={
            "name": "copy",
            "plan": "dev",
            "restore_from": {"instance_id": made["id"], "point_in_time": "2026-01-01T00:00:00"},
        },
        headers=tenant.headers,
    )
    assert naive.status_code == 422 and "time zone" in naive.text


async def test_a_failover_by_the_operator_is_recorded_as_one_and_a_suspension_is_read_only(
    client: httpx.AsyncClient,
    tenant: Tenant,
    conn: AsyncConn,
    api_settings: Settings,
    k8s: tuple[KubernetesProvisioner, FakeCluster],
) -> None:
    provisioner, state = k8s
    registry, iid, name = await ready_ha_instance(client, tenant, api_settings, provisioner)

    # The primary's server dies and the operator fails over by itself: the reconciler records it as
    # the local provisioner's failover (degraded with the code failover, naming who was lost and who
    # is promoted), leaves the promotion to the operator (no heal: nothing to fence or promote), and
    # records ready again, naming the new primary, once the operator reports it healthy.
    state.fail_primary(NAMESPACE, name)
    async with reconciling(api_settings, provisioner, registry=registry) as reconciler:
        await reconciler.run_once()
        row = await instance(conn, iid)
        assert (row["state"], row["failure_code"]) == ("degraded", "failover")
        assert f"primary {name}-1 lost" in row["failure_reason"] and "Failing over" in row["failure_reason"]
        assert f"the operator promotes {name}-2" in row["failure_reason"]

        async def recovered() -> bool:
            await reconciler.run_once()
            return bool((await instance(conn, iid))["state"] == "ready")

        await eventually(recovered, "ready again once the operator's failover is done")
    heals = await scalar(conn, "SELECT count(*) FROM jobs WHERE instance_id = %s AND kind = 'heal'", (iid,))
    assert heals == 0
    cursor = await conn.execute(
        "SELECT from_state, to_state, actor_kind, reason, detail FROM instance_events"
        " WHERE instance_id = %s ORDER BY id DESC LIMIT 2",
        (iid,),
    )
    recover, degrade = await cursor.fetchall()
    assert (degrade["from_state"], degrade["to_state"], degrade["actor_kind"]) == (
        "ready",
        "degraded",
        "reconciler",
    )
    assert degrade["detail"]["code"] == "failover"
    assert (degrade["detail"]["primary"], degrade["detail"]["failover_to"]) == (f"{name}-1", f"{name}-2")
    assert (recover["from_state"], recover["to_state"]) == ("degraded", "ready")
    assert recover["reason"].startswith(f"failover: {name}-2 promoted by the operator")
    assert recover["detail"]["failover"]["promoted"] == f"{name}-2"
    assert recover["detail"]["failover"]["by"] == "operator"
    # What the operator said of it, from the Cluster's events, kept for SREs with each move.
    said = [(e["reason"], e["message"]) for e in recover["detail"]["sre"]["operator_events"]]
    assert said == [
        ("FailingOver", f"Current primary isn't healthy, initiating a failover from {name}-1"),
        ("FailoverTarget", f"Failing over from {name}-1 to {name}-2"),
    ]
    assert [e["reason"] for e in degrade["detail"]["sre"]["operator_events"]] == ["FailingOver"]
    shown = await client.get(f"/v1/instances/{iid}/events", headers=tenant.headers)
    assert shown.status_code == 200 and shown.json()["items"]
    assert all("sre" not in (item["detail"] or {}) for item in shown.json()["items"])
    # What the customer's `instance.failover` notice is made of.
    event = LogEvent(
        id=1,
        xid=1,
        instance_id=iid,
        org_id=tenant.org_id,
        from_state="degraded",
        to_state="ready",
        event="recover",
        actor_kind="reconciler",
        actor_id="reconciler",
        reason=recover["reason"],
        detail=recover["detail"],
        at=datetime.now(UTC),
        seq=1,
        state_version=0,
    )
    assert "instance.failover" in notices.notice_types(event, notices.DEADLINE_CODES)
    cluster = state.get("clusters", NAMESPACE, name)
    assert cluster is not None and cluster["status"]["currentPrimary"] == f"{name}-2"

    # Suspension demotes the Cluster; resumption promotes it with its own demotion token.
    await enqueue(conn, SUSPEND, iid, suspended_by_billing=False)
    await run_until(api_settings, registry, instance_in(iid, "suspended"))
    assert (await provisioner.observe(iid)).read_only is True
    cluster = state.get("clusters", NAMESPACE, f"pg-{iid}")
    assert cluster is not None and cluster["spec"]["replica"]["primary"] == f"pg-{iid}-suspended"
    await enqueue(conn, RESUME, iid)
    await run_until(api_settings, registry, instance_in(iid, "ready"))
    cluster = state.get("clusters", NAMESPACE, f"pg-{iid}")
    assert cluster is not None
    assert cluster["spec"]["replica"]["promotionToken"] == cluster["status"]["lastPromotionToken"]
    assert (await provisioner.observe(iid)).read_only is False


async def test_storage_autoscaling_of_a_cloudnativepg_instance_patches_the_clusters_storage_size(
    client: httpx.AsyncClient,
    tenant: Tenant,
    conn: AsyncConn,
    api_settings: Settings,
    k8s: tuple[KubernetesProvisioner, FakeCluster],
) -> None:
    provisioner, state = k8s
    registry = registry_for(provisioner)
    made = await create(client, tenant, "orders")  # dev: 1 GiB
    iid = uuid.UUID(made["id"])
    await run_until(api_settings, registry, instance_in(iid, "ready"))
    cluster = state.get("clusters", NAMESPACE, f"pg-{iid}")
    assert cluster is not None and cluster["spec"]["storage"]["size"] == "1Gi"

    # The provisioner reports no database metrics on Kubernetes (the exporter is the source there):
    # its observation is given a nearly full database (95 % of 1 GiB), all else as it observes.
    observe = provisioner.observe

    async def nearly_full(instance_id: uuid.UUID) -> Observation:
        seen = await observe(instance_id)
        return dataclasses.replace(seen, stats=DatabaseStats(1, 20, 100, 10, 10, 90, 10, int(0.95 * GIB)))

    provisioner.observe = nearly_full  # type: ignore[method-assign]
    async with reconciling(api_settings, provisioner, registry=registry) as reconciler:
        now = await scalar(conn, "SELECT now()")
        for step in range(0, 310, 10):  # the RDS rule: nearly full for 5 minutes (injected time)
            await reconciler.run_once(now + timedelta(seconds=step))
    row = await instance(conn, iid)
    assert (row["spec"]["storage_gb"], row["spec_generation"]) == (2, 2)

    # The update job applies it: the Cluster's storage size is patched, the volumes follow.
    await run_until(
        api_settings,
        registry,
        lambda c: scalar(c, "SELECT observed_generation = 2 FROM instances WHERE id = %s", (iid,)),
    )
    cluster = state.get("clusters", NAMESPACE, f"pg-{iid}")
    assert cluster is not None and cluster["spec"]["storage"]["size"] == "2Gi"
    claims = [
        c for c in state.of_kind("persistentvolumeclaims") if c["metadata"]["name"].startswith(f"pg-{iid}")
    ]
    assert claims and all(c["status"]["capacity"]["storage"] == "2Gi" for c in claims)
    patches = [r for r in state.requests if r.method == "PATCH" and r.path.endswith(f"/clusters/pg-{iid}")]
    assert patches, "the Cluster is patched, not re-created"
    updated = await scalar(
        conn,
        "SELECT detail->>'storage_gb' FROM instance_events WHERE instance_id = %s AND event = 'updated'",
        (iid,),
    )
    assert updated == "2"
    assert state.denied == []


async def test_an_sre_switchover_of_a_cloudnativepg_instance_is_the_operators_promote(
    client: httpx.AsyncClient,
    tenant: Tenant,
    conn: AsyncConn,
    admin_headers: dict[str, str],
    api_settings: Settings,
    k8s: tuple[KubernetesProvisioner, FakeCluster],
) -> None:
    provisioner, state = k8s
    registry = registry_for(provisioner)
    ha = await create(client, tenant, "orders", plan="small")
    single = await create(client, tenant, "notes")
    iid = uuid.UUID(ha["id"])
    await run_until(api_settings, registry, instance_in(iid, "ready"))
    await run_until(api_settings, registry, instance_in(uuid.UUID(single["id"]), "ready"))
    name = f"pg-{iid}"
    reason = {"reason": "node maintenance"}

    # A one-server Cluster has nothing to switch over to: refused, as on the local provisioner.
    one_server = await client.post(
        f"/v1/admin/instances/{single['id']}/switchover", json=reason, headers=admin_headers
    )
    assert one_server.status_code == 422 and "one server" in one_server.json()["detail"]
    # The HA plan's read-only endpoint is the operator's -ro Service (its standbys), the same
    # database; the one-server plan has none.
    read_only = {"host": f"{name}-ro.{NAMESPACE}.svc", "port": 5432, "dbname": "app"}
    assert (await instance(conn, iid))["connection"]["read_only"] == read_only
    assert "read_only" not in (await instance(conn, uuid.UUID(single["id"])))["connection"]
    shown = (await client.get(f"/v1/instances/{iid}", headers=tenant.headers)).json()["connection"]
    assert shown["read_only"]["uri"].startswith("postgresql://app:")
    assert f"@{name}-ro.{NAMESPACE}.svc:5432/app?sslmode=verify-full" in shown["read_only"]["uri"]

    # The update job asks the operator to promote the standby (the status's targetPrimary) and is
    # done once the operator reports it the current primary.
    async with reconciling(api_settings, provisioner, registry=registry) as reconciler:
        await reconciler.run_once()  # it has seen the first primary
    assert (await instance(conn, iid))["primary_seen"] == f"{name}-1"
    asked = await client.post("/v1/admin/instances/orders/switchover", json=reason, headers=admin_headers)
    assert asked.status_code == 202, asked.text
    await run_until(api_settings, registry, job_finished(asked.json()["id"]))
    row = await instance(conn, iid)
    assert row["state"] == "ready"
    # The switchover's own state change forgot the primary seen: no failover is read into it.
    async with reconciling(api_settings, provisioner, registry=registry) as reconciler:
        await reconciler.run_once()
        await reconciler.run_once()
    assert ((await instance(conn, iid))["state"], (await instance(conn, iid))["primary_seen"]) == (
        "ready",
        f"{name}-2",
    )
    status_path = f"/clusters/{name}/status"
    assert len([r for r in state.requests if r.method == "PATCH" and r.path.endswith(status_path)]) == 1
    cluster = state.get("clusters", NAMESPACE, name)
    assert cluster is not None
    assert cluster["status"]["currentPrimary"] == cluster["status"]["targetPrimary"] == f"{name}-2"
    cursor = await conn.execute(
        "SELECT reason, detail FROM instance_events WHERE instance_id = %s AND to_state = 'ready'"
        " AND from_state = 'updating'",
        (iid,),
    )
    (updated,) = await cursor.fetchall()
    assert updated["reason"] == f"switchover: {name}-2 is the primary, {name}-1 its standby"
    assert updated["detail"]["switchover"]["promoted"] == f"{name}-2"
    # The connection does not move: the -rw Service follows the primary, the -ro one the standbys.
    assert row["connection"]["host"] == f"{name}-rw.{NAMESPACE}.svc"
    assert row["connection"]["read_only"] == read_only
    assert state.denied == []


async def test_a_failover_by_the_operator_between_two_passes_is_recorded_as_one(
    client: httpx.AsyncClient,
    tenant: Tenant,
    conn: AsyncConn,
    api_settings: Settings,
    k8s: tuple[KubernetesProvisioner, FakeCluster],
) -> None:
    provisioner, state = k8s
    registry, iid, name = await ready_ha_instance(client, tenant, api_settings, provisioner)
    async with reconciling(api_settings, provisioner, registry=registry) as reconciler:
        await reconciler.run_once()
        assert (await instance(conn, iid))["primary_seen"] == f"{name}-1"
        # The operator fails over and is done before the next pass: the Cluster is healthy, on
        # another primary. The pass records the failover it did not see under way, then its end.
        state.fail_over_at_once(NAMESPACE, name)
        await reconciler.run_once()
        row = await instance(conn, iid)
        assert (row["state"], row["failure_code"]) == ("degraded", "failover")
        assert f"primary {name}-1 replaced by {name}-2 between two observations" in row["failure_reason"]
        await reconciler.run_once()
        assert (await instance(conn, iid))["state"] == "ready"
        await reconciler.run_once()  # recorded once: the new primary is the one seen now
    cursor = await conn.execute(
        "SELECT from_state, to_state, reason, detail FROM instance_events WHERE instance_id = %s"
        " AND %s IN (from_state, to_state) ORDER BY id",
        (iid, "degraded"),
    )
    degrade, recover = await cursor.fetchall()
    assert (degrade["detail"]["primary"], degrade["detail"]["failover_to"]) == (f"{name}-1", f"{name}-2")
    assert (recover["from_state"], recover["to_state"]) == ("degraded", "ready")
    assert recover["reason"].startswith(f"failover: {name}-2 promoted by the operator")
    assert recover["detail"]["failover"]["by"] == "operator"
    assert (await instance(conn, iid))["primary_seen"] == f"{name}-2"
    # The operator's events on the failover no pass saw under way are kept with its record.
    reasons = [e["reason"] for e in degrade["detail"]["sre"]["operator_events"]]
    assert reasons == ["FailingOver", "FailoverTarget"]


async def test_a_failover_by_the_operator_that_leaves_a_server_behind_is_healed_and_recorded_as_one(
    client: httpx.AsyncClient,
    tenant: Tenant,
    conn: AsyncConn,
    api_settings: Settings,
    k8s: tuple[KubernetesProvisioner, FakeCluster],
) -> None:
    provisioner, state = k8s
    registry, iid, name = await ready_ha_instance(client, tenant, api_settings, provisioner)
    key = ("clusters", NAMESPACE, name)

    state.fail_primary(NAMESPACE, name)
    async with reconciling(api_settings, provisioner, registry=registry) as reconciler:
        await reconciler.run_once()
        assert (await instance(conn, iid))["failure_code"] == "failover"
        # The operator promoted the standby, but the old primary's server does not come back: no
        # failover under way any more, the Cluster still unhealthy, so a heal waits for the operator.
        with state.lock:
            state.pending.pop(key)
            status = state.objects[key]["status"]
            status.update(phase="Waiting for the instances to become active", currentPrimary=f"{name}-2")
        await reconciler.run_once()
    heals = await scalar(conn, "SELECT count(*) FROM jobs WHERE instance_id = %s AND kind = 'heal'", (iid,))
    assert heals == 1
    with state.lock:
        state.pending[key] = state.settle_reads  # the operator brings the server back
    await run_until(api_settings, registry, instance_in(iid, "ready"))
    cursor = await conn.execute(
        "SELECT actor_kind, reason, detail FROM instance_events WHERE instance_id = %s"
        " AND from_state = 'degraded' AND to_state = 'ready'",
        (iid,),
    )
    (recover,) = await cursor.fetchall()
    assert recover["actor_kind"] == "worker"  # the heal's
    assert recover["reason"] == f"failover: {name}-2 promoted by the operator"
    assert recover["detail"]["failover"]["promoted"] == f"{name}-2"
    assert [e["reason"] for e in recover["detail"]["sre"]["operator_events"]] == ["FailingOver"]
    assert state.denied == []


async def test_a_failover_whose_operator_events_cannot_be_read_is_recorded_saying_so(
    client: httpx.AsyncClient,
    tenant: Tenant,
    conn: AsyncConn,
    api_settings: Settings,
    k8s: tuple[KubernetesProvisioner, FakeCluster],
) -> None:
    provisioner, state = k8s
    registry, iid, name = await ready_ha_instance(client, tenant, api_settings, provisioner)
    assert state.role is not None
    state.role.rules = [
        {**rule, "resources": [r for r in rule["resources"] if r != "events"]} for rule in state.role.rules
    ]
    state.fail_primary(NAMESPACE, name)
    async with reconciling(api_settings, provisioner, registry=registry) as reconciler:
        await reconciler.run_once()
    row = await instance(conn, iid)
    assert (row["state"], row["failure_code"]) == ("degraded", "failover")
    detail = await scalar(
        conn,
        "SELECT detail FROM instance_events WHERE instance_id = %s ORDER BY id DESC LIMIT 1",
        (iid,),
    )
    assert "operator_events" not in detail["sre"]
    assert "403 Forbidden: events is forbidden" in detail["sre"]["operator_events_error"]
