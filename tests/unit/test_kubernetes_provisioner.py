"""The kubernetes provisioner on CloudNativePG: manifests against the real schemas, the lifecycle on
the fake API server (with the Role enforced), status mapping, fences, races and API errors."""

from __future__ import annotations

import base64
import re
import socket
import uuid
from typing import Any

import kubernetes
import kubernetes_validate
import pytest

from controlplane.core import plans
from controlplane.core.step_errors import PermanentError, StaleFence, TemporaryError
from provisioners import cnpg, cnpg_schema
from provisioners.base import InstanceSpec, RestoreSource
from provisioners.kubernetes import KubernetesApi, KubernetesProvisioner
from provisioners.noop import NoopProvisioner
from tests.kubernetes_fake import FAKE_CA, FakeCluster
from tests.kubernetes_support import NAMESPACE, provisioner_on_fake, role_from, run_lifecycle

K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
PLAIN = cnpg.ClusterOptions(NAMESPACE)
FULL = cnpg.ClusterOptions(
    NAMESPACE,
    storage_class="fast-ssd",
    image="ghcr.io/cloudnative-pg/postgresql:17.5",
    object_store="backups",
    expose="loadbalancer",
    external_domain="db.example.com",
    client_cidrs=("203.0.113.0/24",),
    pod_monitor=True,
)


@pytest.mark.parametrize("plan", plans.plan_names())
@pytest.mark.parametrize("options", [PLAIN, FULL], ids=["in-cluster", "exposed-with-backups"])
def test_every_manifest_is_valid_against_the_crd_and_kubernetes_schemas(
    plan: str, options: cnpg.ClusterOptions
) -> None:
    iid, org = uuid.uuid4(), uuid.uuid4()
    manifests = cnpg.all_manifests(iid, InstanceSpec(plan, 3, storage_gb=5, org_id=org), options, fence=7)
    kinds = {m["kind"] for m in manifests}
    assert kinds >= {"Secret", "NetworkPolicy", "Cluster"}
    if options.object_store:
        assert kinds >= {"ScheduledBackup", "Backup"}
    assert ("PodMonitor" in kinds) == options.pod_monitor
    for manifest in manifests:
        for version in K8S_VERSIONS:
            cnpg_schema.validate(manifest, version)
        meta = manifest["metadata"]
        assert DNS_LABEL.match(meta["name"]) and len(meta["name"]) <= 63
        assert meta["labels"][cnpg.MANAGED_BY] == cnpg.FIELD_MANAGER
        assert all(len(value) <= 63 for value in meta["labels"].values())
        assert meta["annotations"][cnpg.INSTANCE_LABEL] == str(iid)
        assert meta["annotations"][cnpg.ORG_LABEL] == str(org)
        if manifest["kind"] == "Backup":  # a backup outlives the instance: not labelled as its own
            assert cnpg.INSTANCE_LABEL not in meta["labels"] and meta["labels"][cnpg.BACKUP_OF_LABEL] == str(
                iid
            )
        else:
            assert meta["labels"][cnpg.INSTANCE_LABEL] == str(iid) and meta["labels"][cnpg.ORG_LABEL] == str(
                org
            )


def test_the_schema_check_refuses_what_the_api_server_would() -> None:
    cluster = cnpg.cluster_manifest(uuid.uuid4(), InstanceSpec(), PLAIN, 1)
    cluster["spec"]["storage"]["sise"] = "1Gi"  # misspelt: pruned silently by a lenient server
    with pytest.raises(cnpg_schema.ManifestError, match="'sise' was unexpected"):
        cnpg_schema.validate(cluster)
    cluster = cnpg.cluster_manifest(uuid.uuid4(), InstanceSpec(), PLAIN, 1)
    cluster["spec"]["instances"] = 0
    with pytest.raises(cnpg_schema.ManifestError, match="minimum of 1"):
        cnpg_schema.validate(cluster)
    monitor = cnpg.pod_monitor_manifest(uuid.uuid4(), InstanceSpec(), FULL, 1)
    monitor["spec"]["podMetricsEndpoint"] = monitor["spec"].pop("podMetricsEndpoints")
    with pytest.raises(cnpg_schema.ManifestError, match="'podMetricsEndpoint' was unexpected"):
        cnpg_schema.validate(monitor)


@pytest.mark.parametrize("plan", plans.plan_names())
def test_the_cluster_carries_the_plan_and_requires_tls(plan: str) -> None:
    iid = uuid.uuid4()
    shape = plans.get_shape(plan)
    spec = cnpg.cluster_manifest(iid, InstanceSpec(plan, 2), FULL, 3)["spec"]
    assert spec["instances"] == shape.instances
    assert spec["storage"] == {
        "size": f"{shape.storage_gb}Gi",
        "resizeInUseVolumes": True,
        "storageClass": "fast-ssd",
    }
    assert spec["resources"]["requests"] == {"cpu": shape.cpu, "memory": shape.memory}
    assert spec["postgresql"]["parameters"]["max_connections"] == str(plans.get_plan(plan)["max_connections"])
    assert "hostnossl all all 0.0.0.0/0 reject" in spec["postgresql"]["pg_hba"]
    assert ("synchronous" in spec["postgresql"]) == (shape.instances > 1)
    assert spec["enableSuperuserAccess"] is False
    assert spec["bootstrap"]["initdb"]["owner"] == cnpg.OWNER
    assert spec["bootstrap"]["initdb"]["secret"] == {"name": cnpg.credentials_name(iid)}
    host = FULL.host(iid)
    assert host == f"pg-{iid}.db.example.com" and spec["certificates"]["serverAltDNSNames"] == [host]
    (service,) = spec["managed"]["services"]["additional"]
    assert service["serviceTemplate"]["spec"]["type"] == "LoadBalancer"
    assert service["serviceTemplate"]["spec"]["loadBalancerSourceRanges"] == ["203.0.113.0/24"]
    assert spec["plugins"][0]["isWALArchiver"] is True
    # A spec may ask for a larger volume than its plan's, never a smaller one.
    assert (
        cnpg.cluster_manifest(iid, InstanceSpec(plan, storage_gb=500), PLAIN, 3)["spec"]["storage"]["size"]
        == "500Gi"
    )
    assert cnpg.cluster_manifest(iid, InstanceSpec(plan, storage_gb=0), PLAIN, 3)["spec"]["storage"][
        "size"
    ] == (f"{shape.storage_gb}Gi")


def test_the_network_policy_admits_peers_the_operator_the_monitoring_and_the_organisation_only() -> None:
    iid, org = uuid.uuid4(), uuid.uuid4()
    policy = cnpg.network_policy_manifest(iid, InstanceSpec(org_id=org), FULL, 1)["spec"]
    assert policy["podSelector"] == {"matchLabels": {"cnpg.io/cluster": f"pg-{iid}"}}
    sources = [(rule["from"], {p["port"] for p in rule["ports"]}) for rule in policy["ingress"]]
    assert sources[0] == ([{"podSelector": {"matchLabels": {"cnpg.io/cluster": f"pg-{iid}"}}}], {5432, 8000})
    assert sources[1][1] == {8000}  # the operator reads status, it does not need PostgreSQL
    # The monitoring namespace's Prometheus reaches the exporter, and nothing else.
    by_name = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    assert sources[2] == ([by_name], {9187})
    assert all(9187 not in ports for _, ports in sources[:2] + sources[3:])
    customers, ports = sources[3]
    assert ports == {5432}
    assert {"namespaceSelector": {"matchLabels": {cnpg.ORG_LABEL: str(org)}}} in customers
    assert {"ipBlock": {"cidr": "203.0.113.0/24"}} in customers
    assert {} not in customers
    inside = cnpg.network_policy_manifest(iid, InstanceSpec(org_id=org), PLAIN, 1)["spec"]
    assert not any("ipBlock" in peer for rule in inside["ingress"] for peer in rule["from"])


def test_the_pod_monitor_scrapes_every_server_of_the_cluster_with_its_ids() -> None:
    iid, org = uuid.uuid4(), uuid.uuid4()
    monitor = cnpg.pod_monitor_manifest(iid, InstanceSpec(org_id=org), FULL, 4)
    assert monitor["metadata"]["name"] == f"pg-{iid}" and monitor["metadata"]["namespace"] == NAMESPACE
    spec = monitor["spec"]
    servers = {"cnpg.io/cluster": f"pg-{iid}", "cnpg.io/podRole": "instance"}
    assert spec["selector"] == {"matchLabels": servers}
    assert spec["podMetricsEndpoints"] == [{"port": "metrics"}]  # CloudNativePG's name for 9187
    # The Cluster's pods inherit these labels: every exporter series names its instance and org.
    cluster = cnpg.cluster_manifest(iid, InstanceSpec(org_id=org), FULL, 4)
    inherited = cluster["spec"]["inheritedMetadata"]["labels"]
    assert set(spec["podTargetLabels"]) == set(inherited) == {cnpg.INSTANCE_LABEL, cnpg.ORG_LABEL}


async def test_without_pod_monitors_their_kind_is_never_touched() -> None:
    """A cluster without the Prometheus Operator's CRDs has no podmonitors collection at all."""
    with provisioner_on_fake(role_from()) as (k8s, state):
        iid = uuid.uuid4()
        await ready(k8s, iid, InstanceSpec())
        await k8s.inventory()
        await k8s.deprovision(iid, InstanceSpec(), 2, skip_backup=True)
    assert not any(resource == "podmonitors" for _, resource, _ in state.calls)
    assert state.denied == []


async def test_the_whole_lifecycle_with_the_role_enforced() -> None:
    with provisioner_on_fake(
        role_from(), kubernetes_backup_object_store="backups", kubernetes_pod_monitor=True
    ) as (k8s, state):
        run = await run_lifecycle(k8s, state)
        notes = run.notes
        name = f"pg-{run.first}"
        kinds = {resource.kind for resource in notes["inventory"] if resource.instance_id == run.first}
        assert kinds == {"Cluster", "ScheduledBackup", "NetworkPolicy", "PodMonitor", "Secret"}

        info = notes["info"]
        assert (info.host, info.port, info.dbname, info.user) == (
            f"{name}-rw.{NAMESPACE}.svc",
            5432,
            "app",
            "app",
        )
        assert info.sslmode == "verify-full" and info.ca_certificate == FAKE_CA.replace("{name}", name)
        assert notes["rerun"] == info  # adopted: the same credentials from the same Secret
        assert info.read_only is None  # a one-server plan: no standby to read from
        assert (
            notes["ready"].healthy
            and notes["ready"].read_only is False
            and notes["ready"].plan_applied == "dev"
        )

        assert notes["resized"] is True and notes["resized_again"] is False
        assert notes["downsized"] is True and notes["back_up_sized"] is True
        assert notes["suspended"] is True and notes["suspended_again"] is False
        assert notes["while_suspended"].read_only is True and notes["while_suspended"].healthy
        assert notes["resumed"] is True and notes["resumed_again"] is False
        assert notes["after_resume"].read_only is False

        failing = notes["failing_over"]
        assert failing.exists and not failing.healthy and "Failing over" in failing.detail
        assert failing.failover_to == f"{name}-2" and failing.primary == f"{name}-1"
        assert notes["failed_over"].healthy and "1/2" not in notes["failed_over"].detail
        assert notes["failed_over"].primary == f"{name}-2" and notes["failed_over"].failover_to is None
        # What the operator recorded on the Cluster of its failover, oldest first, as the audit log keeps it.
        assert [(e.reason, e.message) for e in notes["operator_events"]] == [
            ("FailingOver", f"Current primary isn't healthy, initiating a failover from {name}-1"),
            ("FailoverTarget", f"Failing over from {name}-1 to {name}-2"),
        ]
        switched = notes["switched"]
        assert (switched.promoted, switched.fenced) == (f"{name}-1", f"{name}-2")
        assert notes["switched_to"].primary == f"{name}-1" and notes["switched_to"].healthy

        assert isinstance(notes["backup_error"], TemporaryError) and "failed" in str(notes["backup_error"])
        (backup,) = run.backups
        assert backup.name == f"{name}-backup-17" and backup.completed_at

        deleted = notes["deleted"]
        assert deleted.removed and deleted.backup == f"{name}-final"
        assert notes["deleted_again"].removed is False and notes["deleted_again"].backup is None
        assert notes["swept"].removed and notes["swept"].backup is None  # never ran: nothing to back up

        # Only the backups are left: they outlive the instances, for restores (and the operator's
        # events, which the API server expires by itself, an hour after the last).
        assert {p for p, _, _ in state.objects} == {"backups", "events"}
        final = state.get("backups", NAMESPACE, f"{name}-final")
        assert final is not None and final["status"]["phase"] == "completed"
        assert (await k8s.observe(run.first)).exists is False


def test_the_operators_events_kept_are_its_clusters_moves_of_the_primary_and_its_warnings() -> None:
    def event(name: str, reason: str, at: str, kind: str = "Normal", **more: Any) -> dict[str, Any]:
        involved = {"kind": more.pop("involved_kind", "Cluster"), "name": name}
        made = {"involvedObject": involved, "reason": reason, "message": f"{reason} at {at}", "type": kind}
        return made | {"lastTimestamp": at} | more

    events = [
        event("pg-a", "FailoverTarget", "2026-01-01T10:00:02Z"),
        event("pg-a", "FailingOver", "2026-01-01T10:00:01Z"),
        event("pg-a", "CreatingPodDisruptionBudget", "2026-01-01T09:00:00Z"),  # routine: not kept
        event("pg-a", "Unhealthy", "2026-01-01T10:00:00Z", "Warning", count=3),  # a warning: kept
        event("pg-b", "FailingOver", "2026-01-01T10:00:03Z"),  # another cluster's
        event("pg-a", "FailingOver", "2026-01-01T10:00:04Z", involved_kind="Pod"),  # not the Cluster
        event("pg-a", "SwitchingOver", "", eventTime="2026-01-01T10:00:05.000000Z", lastTimestamp=None),
    ]
    kept = cnpg.primary_events(events, "pg-a")
    assert [(e.reason, e.type, e.at, e.count) for e in kept] == [
        ("Unhealthy", "Warning", "2026-01-01T10:00:00Z", 3),
        ("FailingOver", "Normal", "2026-01-01T10:00:01Z", 1),
        ("FailoverTarget", "Normal", "2026-01-01T10:00:02Z", 1),
        ("SwitchingOver", "Normal", "2026-01-01T10:00:05.000000Z", 1),
    ]
    assert kept[1].as_dict() == {
        "reason": "FailingOver",
        "message": "FailingOver at 2026-01-01T10:00:01Z",
        "type": "Normal",
        "at": "2026-01-01T10:00:01Z",
        "count": 1,
    }
    # The newest few only, oldest first.
    many = [event("pg-a", "FailingOver", f"2026-01-01T10:00:{n:02d}Z") for n in range(10)]
    assert [e.at for e in cnpg.primary_events(many, "pg-a")] == [
        f"2026-01-01T10:00:{n:02d}Z" for n in range(10 - cnpg.PRIMARY_EVENTS_KEPT, 10)
    ]


def test_the_read_only_endpoint_is_the_operators_ro_service_also_where_the_primary_is_exposed() -> None:
    iid = uuid.uuid4()
    assert PLAIN.read_only_host(iid) == f"pg-{iid}-ro.{NAMESPACE}.svc"
    # Exposed through a load balancer, the primary's name is external; the standbys' stays inside.
    assert FULL.host(iid) == f"pg-{iid}.db.example.com"
    assert FULL.read_only_host(iid) == f"pg-{iid}-ro.{NAMESPACE}.svc"


async def test_a_restore_bootstraps_from_the_named_backup_or_the_point_in_time() -> None:
    with provisioner_on_fake(kubernetes_backup_object_store="backups") as (k8s, state):
        source, org = uuid.uuid4(), uuid.uuid4()
        await ready(k8s, source, InstanceSpec("dev", org_id=org))
        backup = await k8s.take_backup(source, InstanceSpec("dev", org_id=org), 2)
        backup_id = state.get("backups", NAMESPACE, backup.name)["status"]["backupId"]  # type: ignore[index]

        restored = uuid.uuid4()
        spec = InstanceSpec("small", org_id=org, restore_from=RestoreSource(source, backup=backup.name))
        await ready(k8s, restored, spec)
        cluster = state.get("clusters", NAMESPACE, f"pg-{restored}")
        assert cluster is not None
        recovery = cluster["spec"]["bootstrap"]["recovery"]
        assert recovery["recoveryTarget"] == {"backupID": backup_id}
        assert (recovery["owner"], recovery["database"]) == ("app", "app")
        (origin,) = cluster["spec"]["externalClusters"]
        assert origin["plugin"]["parameters"] == {"barmanObjectName": "backups", "serverName": f"pg-{source}"}
        # Later applies keep the bootstrap as created, even once the backup is gone.
        state.objects.pop(("backups", NAMESPACE, backup.name))
        await k8s.apply_plan(
            restored, InstanceSpec("medium", 2, org_id=org, restore_from=spec.restore_from), 3
        )
        cluster = state.get("clusters", NAMESPACE, f"pg-{restored}")
        assert cluster is not None and cluster["spec"]["bootstrap"]["recovery"] == recovery

        pitr = uuid.uuid4()
        moment = "2026-05-01T12:00:00+00:00"
        await k8s.allocate_storage(
            pitr, InstanceSpec(restore_from=RestoreSource(source, point_in_time=moment)), 1
        )
        cluster = state.get("clusters", NAMESPACE, f"pg-{pitr}")
        assert cluster is not None
        assert cluster["spec"]["bootstrap"]["recovery"]["recoveryTarget"] == {"targetTime": moment}


@pytest.mark.parametrize(
    ("restore", "error"),
    [
        (lambda src: RestoreSource(src, backup="no-such-backup"), "does not exist"),
        (lambda src: RestoreSource(uuid.uuid4(), backup=f"pg-{src}-backup-2"), "is not a backup of instance"),
    ],
)
async def test_a_restore_from_a_wrong_backup_is_permanent(restore: Any, error: str) -> None:
    with provisioner_on_fake(kubernetes_backup_object_store="backups") as (k8s, _):
        source = uuid.uuid4()
        await ready(k8s, source, InstanceSpec())
        await k8s.take_backup(source, InstanceSpec(), 2)
        with pytest.raises(PermanentError, match=error):
            await k8s.allocate_storage(uuid.uuid4(), InstanceSpec(restore_from=restore(source)), 1)


async def test_without_an_object_store_backups_and_restores_are_refused_and_a_delete_needs_skip() -> None:
    with provisioner_on_fake() as (k8s, state):
        iid = uuid.uuid4()
        await ready(k8s, iid, InstanceSpec())
        with pytest.raises(PermanentError, match="object store"):
            await k8s.take_backup(iid, InstanceSpec(), 2)
        with pytest.raises(PermanentError, match="object store"):
            await k8s.allocate_storage(uuid.uuid4(), InstanceSpec(restore_from=RestoreSource(iid)), 1)
        with pytest.raises(PermanentError, match="skip_final_backup"):
            await k8s.deprovision(iid, InstanceSpec(), 3)
        assert state.get("clusters", NAMESPACE, f"pg-{iid}") is not None  # nothing removed
        result = await k8s.deprovision(iid, InstanceSpec(), 4, skip_backup=True)
        assert result.removed and result.backup is None and not state.of_kind("clusters")
        assert not state.of_kind("scheduledbackups")


async def test_a_provisioner_without_restores_refuses_one_instead_of_an_empty_database() -> None:
    spec = InstanceSpec(restore_from=RestoreSource(uuid.uuid4()))
    with pytest.raises(PermanentError, match="not supported by the noop provisioner"):
        NoopProvisioner().refuse_unsupported_restore(spec)
    with pytest.raises(PermanentError, match="not supported by the noop provisioner"):
        await NoopProvisioner().take_backup(uuid.uuid4(), spec, 1)
    with provisioner_on_fake() as (k8s, _):
        k8s.refuse_unsupported_restore(spec)  # the kubernetes one can


async def ready(k8s: KubernetesProvisioner, iid: uuid.UUID, spec: InstanceSpec, fence: int = 1) -> None:
    await k8s.allocate_storage(iid, spec, fence)
    await k8s.configure_network(iid, spec, fence)
    await k8s.initialize_database(iid, spec, fence)


async def test_steps_apply_declaratively_with_a_field_manager_and_strict_validation() -> None:
    with provisioner_on_fake() as (k8s, state):
        iid = uuid.uuid4()
        await ready(k8s, iid, InstanceSpec())
        (secret,) = [
            s for s in state.of_kind("secrets") if s["metadata"]["name"] == cnpg.credentials_name(iid)
        ]
        assert secret["type"] == "kubernetes.io/basic-auth"
        assert base64.b64decode(secret["data"]["username"]).decode() == "app"
        applies = [r for r in state.requests if r.content_type == "application/apply-patch+yaml"]
        assert applies and all(
            r.query["fieldManager"] == [cnpg.FIELD_MANAGER]
            and r.query["force"] == ["true"]
            and r.query["fieldValidation"] == ["Strict"]
            for r in applies
        )
        # The operator is slow: a rollout that does not finish in time is temporary, not a failure.
        state.operator_running = False
        k8s.ready_wait_s = 0.1
        with pytest.raises(TemporaryError, match=r"plan change .* not done yet"):
            await k8s.apply_plan(iid, InstanceSpec("small", 2), 2)
        observed = await k8s.observe(iid)
        assert observed.plan_applied == "small" and observed.generation == 2


async def test_the_rollout_waits_for_the_servers_not_only_the_phase() -> None:
    with provisioner_on_fake() as (k8s, state):
        iid = uuid.uuid4()
        await ready(k8s, iid, InstanceSpec())
        # The operator reports healthy, but one server still runs with its old resources.
        await k8s.apply_plan(iid, InstanceSpec("small", 2), 2)
        pod = state.get("pods", NAMESPACE, f"pg-{iid}-2")
        assert pod is not None
        pod["spec"]["containers"][0]["resources"]["requests"]["memory"] = "256Mi"
        cluster = state.get("clusters", NAMESPACE, f"pg-{iid}")
        assert cluster is not None
        lag = cnpg.servers_lag(cluster, state.of_kind("pods"), state.of_kind("persistentvolumeclaims"))
        assert lag == f"server pg-{iid}-2 still runs with its previous requests"
        claim = state.get("persistentvolumeclaims", NAMESPACE, f"pg-{iid}-1")
        assert claim is not None
        claim["status"]["capacity"]["storage"] = "1Gi"
        pod["spec"]["containers"][0]["resources"]["requests"]["memory"] = "512Mi"
        assert cnpg.servers_lag(cluster, state.of_kind("pods"), state.of_kind("persistentvolumeclaims")) == (
            f"volume pg-{iid}-1 is 1Gi of 10Gi"
        )


async def test_a_stale_fence_is_refused_and_a_racing_writer_is_retried_then_temporary() -> None:
    with provisioner_on_fake() as (k8s, state):
        iid = uuid.uuid4()
        await ready(k8s, iid, InstanceSpec(), fence=5)
        with pytest.raises(StaleFence):
            await k8s.apply_plan(iid, InstanceSpec("small", 2), 4)
        with pytest.raises(StaleFence):
            await k8s.deprovision(iid, InstanceSpec(), 4, skip_backup=True)

        # Someone writes between every read and the apply: re-read a few times, then temporary.
        original_get = k8s.api.get
        races = {"count": 0}

        def get_then_race(*args: Any) -> Any:
            seen = original_get(*args)
            if seen is not None and args[0].plural == "clusters":
                races["count"] += 1
                key = ("clusters", NAMESPACE, f"pg-{iid}")
                state.objects[key]["metadata"]["resourceVersion"] = f"race-{races['count']}"
            return seen

        k8s.api.get = get_then_race  # type: ignore[method-assign,assignment]
        with pytest.raises(TemporaryError, match="409"):
            await k8s.configure_network(iid, InstanceSpec(), 6)
        assert races["count"] >= 5
        k8s.api.get = original_get  # type: ignore[method-assign]

        # A higher fence written meanwhile is seen on the re-read: refused, not overwritten.
        state.objects[("clusters", NAMESPACE, f"pg-{iid}")]["metadata"]["annotations"][
            cnpg.FENCE_ANNOTATION
        ] = "9"
        with pytest.raises(StaleFence):
            await k8s.configure_network(iid, InstanceSpec(), 6)


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (409, TemporaryError),
        (429, TemporaryError),
        (500, TemporaryError),
        (503, TemporaryError),
        (400, PermanentError),
        (403, PermanentError),
        (422, PermanentError),
    ],
)
async def test_api_errors_are_translated(status: int, error: type[Exception]) -> None:
    with provisioner_on_fake() as (k8s, state):
        state.fail_next.append(("PATCH", status))
        with pytest.raises(error, match=str(status)):
            await k8s.allocate_storage(uuid.uuid4(), InstanceSpec(), 1)


async def test_the_operators_webhook_refuses_a_shrinking_volume_and_the_provisioner_never_asks() -> None:
    with provisioner_on_fake() as (k8s, state):
        iid = uuid.uuid4()
        await ready(k8s, iid, InstanceSpec("medium"))
        await k8s.apply_plan(iid, InstanceSpec("dev", 2), 2)  # a smaller plan keeps the larger volume
        cluster = state.get("clusters", NAMESPACE, f"pg-{iid}")
        assert cluster is not None and cluster["spec"]["storage"]["size"] == "50Gi"
        assert cluster["spec"]["instances"] == 1
        smaller = cnpg.cluster_manifest(iid, InstanceSpec("dev", 3), k8s.options, 3)
        with pytest.raises(kubernetes.client.exceptions.ApiException, match="shrink"):
            k8s.api.apply(smaller)


def direct(url: str, timeout_s: float) -> KubernetesProvisioner:
    configuration = kubernetes.client.Configuration()
    configuration.host = url
    configuration.retries = 0
    api = KubernetesApi(
        kubernetes.client.ApiClient(configuration), timeout_s=timeout_s, connect_timeout_s=0.3
    )
    return KubernetesProvisioner(api, NAMESPACE)


async def test_an_unreachable_or_silent_api_is_temporary() -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)  # accepts connections in the kernel, never answers
        port = silent.getsockname()[1]
        with pytest.raises(TemporaryError, match="unreachable"):
            await direct(f"http://127.0.0.1:{port}", timeout_s=0.3).observe(uuid.uuid4())
    with pytest.raises(TemporaryError, match="unreachable"):
        await direct(f"http://127.0.0.1:{port}", timeout_s=0.3).inventory()


def test_the_fake_counts_only_what_it_serves(tmp_path: Any) -> None:
    # The fake is a test instrument: its Role check matches RBAC's (group, resource, verb, namespace).
    role = role_from()
    assert role.allows(NAMESPACE, ("postgresql.cnpg.io", "clusters", "patch"))
    assert not role.allows("default", ("postgresql.cnpg.io", "clusters", "patch"))
    assert not role.allows(NAMESPACE, ("postgresql.cnpg.io", "clusters", "watch"))
    assert isinstance(FakeCluster().settle_reads, int)


@pytest.mark.parametrize(
    ("environ", "error"),
    [
        ({"CONTROLPLANE_KUBERNETES_EXPOSE": "nodeport"}, "expected cluster or loadbalancer"),
        ({"CONTROLPLANE_KUBERNETES_EXPOSE": "loadbalancer"}, "needs CONTROLPLANE_KUBERNETES_EXTERNAL_DOMAIN"),
        ({"CONTROLPLANE_KUBERNETES_CLIENT_CIDRS": "10.0.0.0/8, nonsense"}, "'nonsense' is not a CIDR"),
    ],
)
def test_bad_kubernetes_settings_are_refused_in_one_line(environ: dict[str, str], error: str) -> None:
    from controlplane.runtime import settings

    with pytest.raises(settings.SettingsError, match=error):
        settings.load(environ)
    exposed = settings.load(
        {
            "CONTROLPLANE_KUBERNETES_EXPOSE": "loadbalancer",
            "CONTROLPLANE_KUBERNETES_EXTERNAL_DOMAIN": "db.example.com",
            "CONTROLPLANE_KUBERNETES_CLIENT_CIDRS": "10.0.0.0/8, 192.0.2.0/24",
        }
    )
    assert cnpg.ClusterOptions.from_settings(exposed).client_cidrs == ("10.0.0.0/8", "192.0.2.0/24")


async def test_a_status_write_racing_the_fence_mark_is_read_again() -> None:
    with provisioner_on_fake() as (k8s, state):
        iid = uuid.uuid4()
        await ready(k8s, iid, InstanceSpec(), fence=3)
        original_get = k8s.api.get
        races: list[str] = []
        reads = {"clusters": 0}

        def get_then_race_once(*args: Any) -> Any:
            seen = original_get(*args)
            if seen is not None and args[0].plural == "clusters":
                reads["clusters"] += 1
                if reads["clusters"] == 2:  # the read before the mark: the operator writes right after it
                    races.append("raced")
                    state.objects[("clusters", NAMESPACE, f"pg-{iid}")]["metadata"]["resourceVersion"] = (
                        "race"
                    )
            return seen

        k8s.api.get = get_then_race_once  # type: ignore[method-assign,assignment]
        result = await k8s.deprovision(iid, InstanceSpec(), 4, skip_backup=True)
        assert races == ["raced"] and result.removed
        conflicts = [
            r for r in state.requests if r.method == "PATCH" and r.content_type == cnpg.MERGE_CONTENT_TYPE
        ]
        assert len(conflicts) == 2  # refused once with 409, then applied over the version read again


async def test_the_recoverable_window_and_the_archive_health_come_from_the_cluster_status() -> None:
    with provisioner_on_fake(kubernetes_backup_object_store="backups") as (k8s, state):
        iid, spec = uuid.uuid4(), InstanceSpec("dev")
        await ready(k8s, iid, spec)
        before = (await k8s.observe(iid)).recovery
        # Archiving, but nothing restorable before the first backup ends.
        assert before is not None and before.archive_healthy is True and before.earliest is None
        await k8s.take_backup(iid, spec, 2)
        window = await k8s.recovery_window(iid)
        assert window is not None and window.earliest == "2026-01-01T00:00:00Z"
        assert window.latest is not None and window.lag_s == cnpg.ARCHIVE_TIMEOUT_S
        state.archiving_fails("unable to upload WAL: access denied")
        failing = await k8s.observe(iid)
        assert failing.archive_failing and failing.recovery is not None and failing.recovery.latest is None
        assert (
            failing.recovery.archive_detail
            == "ContinuousArchivingFailing: unable to upload WAL: access denied"
        )
    # Without an object store nothing is archived: no window.
    with provisioner_on_fake() as (bare, _):
        other = uuid.uuid4()
        await ready(bare, other, InstanceSpec("dev"))
        assert (await bare.observe(other)).recovery is None


async def test_a_switchover_is_the_operators_promote_through_the_status_subresource() -> None:
    with provisioner_on_fake(role_from()) as (k8s, state):
        iid, small = uuid.uuid4(), InstanceSpec("small")
        await ready(k8s, iid, small)
        name = f"pg-{iid}"
        assert (await k8s.observe(iid)).primary == f"{name}-1"

        promotion = await k8s.switchover(iid, small, 2)
        assert promotion is not None
        assert (promotion.promoted, promotion.fenced, promotion.lsn) == (f"{name}-2", f"{name}-1", "")
        # As `kubectl cnpg promote`: the status's targetPrimary, patched over the version read.
        (asked,) = [r for r in state.requests if r.method == "PATCH" and r.path.endswith(f"/{name}/status")]
        assert asked.content_type == "application/merge-patch+json"
        cluster = state.get("clusters", NAMESPACE, name)
        assert cluster is not None and cluster["metadata"]["annotations"][cnpg.FENCE_ANNOTATION] == "2"
        status = cluster["status"]
        assert status["currentPrimary"] == status["targetPrimary"] == f"{name}-2"
        assert status["phase"] == cnpg.HEALTHY_PHASE and status["currentPrimaryTimestamp"] == promotion.at
        seen = await k8s.observe(iid)
        assert seen.healthy and seen.primary == f"{name}-2" and seen.failover_to is None
        with pytest.raises(StaleFence):
            await k8s.switchover(iid, small, 1)

        # While the operator switches over, the move is no failover (nothing for the reconciler).
        state.settle_reads = 50
        asked_for = await k8s._run(lambda: k8s._ask_switchover(iid, 3))
        assert asked_for == (f"{name}-1", f"{name}-2")
        moving = await k8s.observe(iid)
        assert not moving.healthy and moving.failover_to is None and "Switchover in progress" in moving.detail
        # A retry adopts the move under way instead of asking for another.
        assert await k8s._run(lambda: k8s._ask_switchover(iid, 4)) == (f"{name}-1", f"{name}-2")
        assert len([r for r in state.requests if r.path.endswith("/status")]) == 2
    assert state.denied == []


async def test_a_one_server_cluster_has_nothing_to_switch_over_to() -> None:
    with provisioner_on_fake(role_from()) as (k8s, state):
        iid = uuid.uuid4()
        await ready(k8s, iid, InstanceSpec("dev"))
        assert await k8s.switchover(iid, InstanceSpec("dev"), 2) is None
        assert not [r for r in state.requests if r.path.endswith("/status")]
