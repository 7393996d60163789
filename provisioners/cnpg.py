"""CloudNativePG manifests for one instance (pure functions) and what the operator's status means."""

from __future__ import annotations

import base64
import json
import secrets
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, Literal

from kubernetes.utils import quantity

from controlplane.core.step_errors import PermanentError
from controlplane.runtime.settings import Settings
from provisioners.base import InstanceSpec, OperatorEvent, RecoveryWindow, RestoreSource

FIELD_MANAGER = "controlplane"
APPLY_CONTENT_TYPE = "application/apply-patch+yaml"
MERGE_CONTENT_TYPE = "application/merge-patch+json"
MANAGED_BY = "app.kubernetes.io/managed-by"
INSTANCE_LABEL = "controlplane.io/instance-id"
ORG_LABEL = "controlplane.io/org-id"
BACKUP_OF_LABEL = "controlplane.io/backup-of"
FENCE_ANNOTATION = "controlplane.io/fence"
PLAN_ANNOTATION = "controlplane.io/plan"
GENERATION_ANNOTATION = "controlplane.io/generation"
PURPOSE_ANNOTATION = "controlplane.io/backup-purpose"
CNPG_CLUSTER_LABEL = "cnpg.io/cluster"
CNPG_API_VERSION = "postgresql.cnpg.io/v1"
BARMAN_PLUGIN = "barman-cloud.cloudnative-pg.io"
EXTERNAL_DNS_ANNOTATION = "external-dns.alpha.kubernetes.io/hostname"
IMAGE = "ghcr.io/cloudnative-pg/postgresql:{version}"
HEALTHY_PHASE = "Cluster in healthy state"
# The operator's phases while its primary moves: a failover of a lost primary, a switchover asked for
# (`kubectl cnpg promote`: `status.targetPrimary` set through the status subresource).
FAILOVER_PHASE = "Failing over"
SWITCHOVER_PHASE = "Switchover in progress"
PORT = 5432
STATUS_PORT = 8000  # the instance manager's HTTP endpoint (operator and peers)
METRICS_PORT = 9187  # the instance manager's metrics exporter (Prometheus), a container port named:
METRICS_PORT_NAME = "metrics"
MONITORING_API_VERSION = "monitoring.coreos.com/v1"
DBNAME = "app"
OWNER = "app"
SSLMODE = "verify-full"
# The external cluster a suspended instance pretends to follow: it does not exist, so the demoted
# primary stays in recovery (read-only) with nothing to replay, until it is promoted again.
SUSPENDED_SUFFIX = "-suspended"
RESTORE_SOURCE = "origin"
# Kubernetes quantities ("512Mi", "1", "250m") as numbers, the way the API server compares them.
parse_quantity: Callable[[str], Decimal] = quantity.parse_quantity

# ---- names and labels ------------------------------------------------------------------------------


def resource_name(instance_id: uuid.UUID) -> str:
    """The Cluster's name (at most 50 characters, a DNS-1035 label): everything else derives from it."""
    return f"pg-{instance_id}"


def credentials_name(instance_id: uuid.UUID) -> str:
    return f"{resource_name(instance_id)}-credentials"


def suspended_source(instance_id: uuid.UUID) -> str:
    return resource_name(instance_id) + SUSPENDED_SUFFIX


def labels(instance_id: uuid.UUID, org_id: uuid.UUID | None) -> dict[str, str]:
    """What every object the provisioner creates carries: the instance, its organisation, the manager."""
    found = {
        "app.kubernetes.io/name": "postgresql",
        "app.kubernetes.io/instance": resource_name(instance_id),
        "app.kubernetes.io/component": "database",
        MANAGED_BY: FIELD_MANAGER,
        INSTANCE_LABEL: str(instance_id),
    }
    if org_id is not None:
        found[ORG_LABEL] = str(org_id)
    return found


def owned_selector(instance_id: uuid.UUID) -> dict[str, str]:
    """The objects this provisioner created for one instance (not the operator's, which inherit ids)."""
    return {MANAGED_BY: FIELD_MANAGER, INSTANCE_LABEL: str(instance_id)}


def _metadata(
    instance_id: uuid.UUID, org_id: uuid.UUID | None, namespace: str, name: str, fence: int
) -> dict[str, Any]:
    annotations = {FENCE_ANNOTATION: str(fence), INSTANCE_LABEL: str(instance_id)}
    if org_id is not None:
        annotations[ORG_LABEL] = str(org_id)
    return {
        "name": name,
        "namespace": namespace,
        "labels": labels(instance_id, org_id),
        "annotations": annotations,
    }


@dataclass(frozen=True)
class ClusterOptions:
    """How this installation builds clusters (from CONTROLPLANE_KUBERNETES_* settings)."""

    namespace: str
    storage_class: str | None = None
    image: str | None = None
    object_store: str | None = None
    backup_schedule: str = "0 0 3 * * *"
    expose: str = "cluster"
    external_domain: str | None = None
    client_cidrs: tuple[str, ...] = ()
    operator_namespace: str = "cnpg-system"
    # Whose Prometheus scrapes the exporters (admitted to METRICS_PORT), and whether a PodMonitor
    # per instance tells it to (the Prometheus Operator's kind).
    monitoring_namespace: str = "monitoring"
    pod_monitor: bool = False

    @classmethod
    def from_settings(cls, settings: Settings) -> ClusterOptions:
        p = settings.provisioner
        return cls(
            namespace=p.kubernetes_namespace,
            storage_class=p.kubernetes_storage_class,
            image=p.kubernetes_image,
            object_store=p.kubernetes_backup_object_store,
            backup_schedule=p.kubernetes_backup_schedule,
            expose=p.kubernetes_expose,
            external_domain=p.kubernetes_external_domain,
            client_cidrs=p.client_cidrs,
            operator_namespace=p.kubernetes_operator_namespace,
            monitoring_namespace=p.kubernetes_monitoring_namespace,
            pod_monitor=p.kubernetes_pod_monitor,
        )

    def external_host(self, instance_id: uuid.UUID) -> str | None:
        if self.expose != "loadbalancer" or not self.external_domain:
            return None
        return f"{resource_name(instance_id)}.{self.external_domain.strip('.')}"

    def host(self, instance_id: uuid.UUID) -> str:
        """Where customers connect: the external name, else the -rw Service (both in the certificate)."""
        return self.external_host(instance_id) or f"{resource_name(instance_id)}-rw.{self.namespace}.svc"

    def read_only_host(self, instance_id: uuid.UUID) -> str:
        """An HA plan's read-only endpoint: the operator's -ro Service, which leads to its standbys
        only (in the operator's certificate too; inside the cluster, also where `host` is external)."""
        return f"{resource_name(instance_id)}-ro.{self.namespace}.svc"


# ---- pure manifest builders ------------------------------------------------------------------------


@dataclass(frozen=True)
class Credentials:
    user: str
    password: str = field(default="", repr=False)

    @classmethod
    def generate(cls, password: str | None = None) -> Credentials:
        return cls(OWNER, password or secrets.token_urlsafe(24))


def secret_manifest(
    instance_id: uuid.UUID, spec: InstanceSpec, options: ClusterOptions, credentials: Credentials, fence: int
) -> dict[str, Any]:
    """The owner's credentials: the bootstrap secret of the Cluster (basic-auth, as the operator reads it)."""

    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(
            instance_id, spec.org_id, options.namespace, credentials_name(instance_id), fence
        ),
        "type": "kubernetes.io/basic-auth",
        "data": {"username": b64(credentials.user), "password": b64(credentials.password)},
    }


@dataclass(frozen=True)
class Replica:
    """The Cluster's replica stanza: never set, demoted (suspended), or promoted again with a token."""

    state: Literal["none", "demoted", "promoted"] = "none"
    promotion_token: str | None = None

    @classmethod
    def of(cls, cluster: Mapping[str, Any] | None) -> Replica:
        stanza = ((cluster or {}).get("spec") or {}).get("replica") or {}
        if not stanza:
            return cls()
        name = (cluster or {}).get("metadata", {}).get("name")
        if stanza.get("primary") == name:
            return cls("promoted", stanza.get("promotionToken") or None)
        return cls("demoted")


def _streaming_source(name: str, host: str, **parameters: str) -> dict[str, Any]:
    """An external cluster reached by streaming replication, as the operator's replica clusters are."""
    return {
        "name": name,
        "connectionParameters": {
            "host": host,
            "user": "streaming_replica",
            "dbname": "postgres",
            **parameters,
        },
    }


def _self_reference(instance_id: uuid.UUID, namespace: str) -> dict[str, Any]:
    """This cluster as an external cluster (the distributed topology names its members this way)."""
    name = resource_name(instance_id)
    return {
        **_streaming_source(name, f"{name}-rw.{namespace}.svc", sslmode=SSLMODE),
        "sslKey": {"name": f"{name}-replication", "key": "tls.key"},
        "sslCert": {"name": f"{name}-replication", "key": "tls.crt"},
        "sslRootCert": {"name": f"{name}-ca", "key": "ca.crt"},
    }


def _suspension_source(instance_id: uuid.UUID) -> dict[str, Any]:
    """A primary that does not exist (.invalid never resolves): a demoted cluster follows nothing."""
    name = suspended_source(instance_id)
    return _streaming_source(name, f"{name}.invalid")


def replica_stanza(instance_id: uuid.UUID, replica: Replica) -> dict[str, Any] | None:
    name, phantom = resource_name(instance_id), suspended_source(instance_id)
    if replica.state == "demoted":
        return {"primary": phantom, "source": phantom}
    if replica.state == "promoted":
        stanza = {"primary": name, "source": phantom}
        if replica.promotion_token:
            stanza["promotionToken"] = replica.promotion_token
        return stanza
    return None


def bootstrap_stanza(
    instance_id: uuid.UUID, options: ClusterOptions, recovery: Mapping[str, Any] | None
) -> dict[str, Any]:
    """initdb of an empty database owned by the customer's role, or recovery from another's backups."""
    owner = {"database": DBNAME, "owner": OWNER, "secret": {"name": credentials_name(instance_id)}}
    if recovery is None:
        return {"initdb": {**owner, "dataChecksums": True}}
    return {"recovery": {"source": RESTORE_SOURCE, **owner, **recovery}}


def restore_reference(options: ClusterOptions, source: RestoreSource) -> dict[str, Any]:
    """The source instance's archive in the object store, as an external cluster."""
    if not options.object_store:
        raise PermanentError(
            "restoring needs a backup object store (CONTROLPLANE_KUBERNETES_BACKUP_OBJECT_STORE)"
        )
    return {
        "name": RESTORE_SOURCE,
        "plugin": {
            "name": BARMAN_PLUGIN,
            "parameters": {
                "barmanObjectName": options.object_store,
                "serverName": resource_name(source.instance_id),
            },
        },
    }


def recovery_target(source: RestoreSource, backup_id: str | None) -> dict[str, Any]:
    """What to recover: from one backup (by its id) and/or up to a point in time; else everything."""
    target: dict[str, Any] = {}
    if backup_id is not None:
        target["backupID"] = backup_id
    if source.point_in_time is not None:
        target["targetTime"] = source.point_in_time
    return {"recoveryTarget": target} if target else {}


def gib(quantity: str | None) -> int:
    """A storage quantity in whole GiB, rounded up (0 when absent)."""
    if not quantity:
        return 0
    value: Decimal = parse_quantity(quantity)
    return int(-(-value // (1024**3)))


def cluster_manifest(
    instance_id: uuid.UUID,
    spec: InstanceSpec,
    options: ClusterOptions,
    fence: int,
    *,
    replica: Replica = Replica(),
    bootstrap: Mapping[str, Any] | None = None,
    external_clusters: Sequence[Mapping[str, Any]] = (),
    storage_gb: int | None = None,
    resource_version: str | None = None,
) -> dict[str, Any]:
    """The instance's CloudNativePG Cluster: the plan's servers, volume, resources and settings."""
    name = resource_name(instance_id)
    shape = spec.shape
    metadata = _metadata(instance_id, spec.org_id, options.namespace, name, fence)
    metadata["annotations"].update({PLAN_ANNOTATION: spec.plan, GENERATION_ANNOTATION: str(spec.generation)})
    if resource_version is not None:
        metadata["resourceVersion"] = resource_version  # apply only over what was read: fenced
    storage: dict[str, Any] = {
        "size": f"{max(storage_gb or 0, spec.volume_gb)}Gi",
        "resizeInUseVolumes": True,
    }
    if options.storage_class:
        storage["storageClass"] = options.storage_class
    postgresql: dict[str, Any] = {
        "parameters": spec.server_settings(),
        # TLS only: a connection without it is refused before any password is asked for.
        "pg_hba": ["hostnossl all all 0.0.0.0/0 reject", "hostnossl all all ::/0 reject"],
    }
    if shape.instances > 1:
        # An acknowledged commit is on a standby while one is in sync; a lost standby does not stop writes.
        postgresql["synchronous"] = {"method": "any", "number": 1, "dataDurability": "preferred"}
    inherited = {INSTANCE_LABEL: str(instance_id)}
    if spec.org_id is not None:
        inherited[ORG_LABEL] = str(spec.org_id)
    body: dict[str, Any] = {
        "instances": shape.instances,
        "primaryUpdateStrategy": "unsupervised",
        "enableSuperuserAccess": False,
        "storage": storage,
        "resources": {
            "requests": {"cpu": shape.cpu, "memory": shape.memory},
            "limits": {"memory": shape.memory},
        },
        "postgresql": postgresql,
        "bootstrap": dict(bootstrap or bootstrap_stanza(instance_id, options, None)),
        "inheritedMetadata": {"labels": inherited},
    }
    image = options.image or (IMAGE.format(version=spec.version) if spec.version else None)
    if image:
        body["imageName"] = image
    external_host = options.external_host(instance_id)
    if external_host:
        body["certificates"] = {"serverAltDNSNames": [external_host]}
        service: dict[str, Any] = {"type": "LoadBalancer", "externalTrafficPolicy": "Local"}
        if options.client_cidrs:
            service["loadBalancerSourceRanges"] = list(options.client_cidrs)
        body["managed"] = {
            "services": {
                "additional": [
                    {
                        "selectorType": "rw",
                        "serviceTemplate": {
                            "metadata": {
                                "name": f"{name}-external",
                                "labels": inherited,
                                "annotations": {EXTERNAL_DNS_ANNOTATION: external_host},
                            },
                            "spec": service,
                        },
                    }
                ]
            }
        }
    if options.object_store:
        body["plugins"] = [
            {
                "name": BARMAN_PLUGIN,
                "isWALArchiver": True,
                "parameters": {"barmanObjectName": options.object_store},
            }
        ]
    clusters = [dict(item) for item in external_clusters]
    stanza = replica_stanza(instance_id, replica)
    if stanza is not None:
        body["replica"] = stanza
        clusters += [_self_reference(instance_id, options.namespace), _suspension_source(instance_id)]
    if clusters:
        body["externalClusters"] = clusters
    return {"apiVersion": CNPG_API_VERSION, "kind": "Cluster", "metadata": metadata, "spec": body}


def network_policy_manifest(
    instance_id: uuid.UUID, spec: InstanceSpec, options: ClusterOptions, fence: int
) -> dict[str, Any]:
    """Who may reach the instance's servers: its own peers, the operator, the monitoring's
    Prometheus (the metrics exporter only), and its customers only.

    Customers are pods in namespaces labelled with the organisation's id and, when the instance is
    exposed, the configured client networks. Other pods of the Kubernetes cluster are refused.
    """
    name = resource_name(instance_id)
    own = {"podSelector": {"matchLabels": {CNPG_CLUSTER_LABEL: name}}}

    def namespace(named: str) -> dict[str, Any]:
        return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": named}}}

    def ports(*numbers: int) -> list[dict[str, Any]]:
        return [{"protocol": "TCP", "port": number} for number in numbers]

    ingress: list[dict[str, Any]] = [
        {"from": [own], "ports": ports(PORT, STATUS_PORT)},
        {"from": [namespace(options.operator_namespace)], "ports": ports(STATUS_PORT)},
        {"from": [namespace(options.monitoring_namespace)], "ports": ports(METRICS_PORT)},
    ]
    customers: list[dict[str, Any]] = []
    if spec.org_id is not None:
        customers.append({"namespaceSelector": {"matchLabels": {ORG_LABEL: str(spec.org_id)}}})
    if options.external_host(instance_id):
        customers += [{"ipBlock": {"cidr": cidr}} for cidr in options.client_cidrs or ("0.0.0.0/0",)]
    if customers:
        ingress.append({"from": customers, "ports": ports(PORT)})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(instance_id, spec.org_id, options.namespace, name, fence),
        "spec": {
            "podSelector": {"matchLabels": {CNPG_CLUSTER_LABEL: name}},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def pod_monitor_manifest(
    instance_id: uuid.UUID, spec: InstanceSpec, options: ClusterOptions, fence: int
) -> dict[str, Any]:
    """The Prometheus Operator's scrape of the instance's exporters (CloudNativePG deprecates making
    it itself): every server of the Cluster on its `metrics` port, each target labelled with the
    instance and organisation ids its pods inherit from the Cluster."""
    name = resource_name(instance_id)
    return {
        "apiVersion": MONITORING_API_VERSION,
        "kind": "PodMonitor",
        "metadata": _metadata(instance_id, spec.org_id, options.namespace, name, fence),
        "spec": {
            "selector": {"matchLabels": {CNPG_CLUSTER_LABEL: name, "cnpg.io/podRole": "instance"}},
            "podMetricsEndpoints": [{"port": METRICS_PORT_NAME}],
            "podTargetLabels": [INSTANCE_LABEL, ORG_LABEL],
        },
    }


def scheduled_backup_manifest(
    instance_id: uuid.UUID, spec: InstanceSpec, options: ClusterOptions, fence: int
) -> dict[str, Any]:
    """A base backup on the schedule, the first at once; its Backups go with it when it is deleted."""
    name = resource_name(instance_id)
    return {
        "apiVersion": CNPG_API_VERSION,
        "kind": "ScheduledBackup",
        "metadata": _metadata(instance_id, spec.org_id, options.namespace, f"{name}-scheduled", fence),
        "spec": {
            "schedule": options.backup_schedule,
            "cluster": {"name": name},
            "method": "plugin",
            "pluginConfiguration": {"name": BARMAN_PLUGIN},
            "backupOwnerReference": "self",
            "immediate": True,
        },
    }


def backup_manifest(
    instance_id: uuid.UUID,
    org_id: uuid.UUID | None,
    options: ClusterOptions,
    name: str,
    purpose: str,
    fence: int,
) -> dict[str, Any]:
    """An on-demand backup. Labelled as a backup of the instance, not as the instance's own object,
    so deleting the instance spares it (a restore can still name it)."""
    metadata = _metadata(instance_id, org_id, options.namespace, name, fence)
    metadata["labels"] = {MANAGED_BY: FIELD_MANAGER, BACKUP_OF_LABEL: str(instance_id)}
    if org_id is not None:
        metadata["labels"][ORG_LABEL] = str(org_id)
    metadata["annotations"][PURPOSE_ANNOTATION] = purpose
    return {
        "apiVersion": CNPG_API_VERSION,
        "kind": "Backup",
        "metadata": metadata,
        "spec": {
            "cluster": {"name": resource_name(instance_id)},
            "method": "plugin",
            "pluginConfiguration": {"name": BARMAN_PLUGIN},
        },
    }


def final_backup_name(instance_id: uuid.UUID) -> str:
    return f"{resource_name(instance_id)}-final"


def all_manifests(
    instance_id: uuid.UUID, spec: InstanceSpec, options: ClusterOptions, fence: int
) -> list[dict[str, Any]]:
    """Every manifest the provisioner can apply for one instance (what the schema tests validate)."""
    source = RestoreSource(uuid.uuid4(), backup="pg-source-final")
    recovered = bootstrap_stanza(instance_id, options, recovery_target(source, "20260101T000000"))
    pitr = RestoreSource(source.instance_id, point_in_time="2026-01-01T00:00:00+00:00")
    manifests = [
        secret_manifest(instance_id, spec, options, Credentials.generate(), fence),
        network_policy_manifest(instance_id, spec, options, fence),
        cluster_manifest(instance_id, spec, options, fence),
        cluster_manifest(instance_id, spec, options, fence, replica=Replica("demoted")),
        cluster_manifest(instance_id, spec, options, fence, replica=Replica("promoted", _example_token())),
    ]
    if options.pod_monitor:
        manifests.append(pod_monitor_manifest(instance_id, spec, options, fence))
    if options.object_store:
        manifests += [
            cluster_manifest(
                instance_id,
                spec,
                options,
                fence,
                bootstrap=recovered,
                external_clusters=[restore_reference(options, source)],
            ),
            cluster_manifest(
                instance_id,
                spec,
                options,
                fence,
                bootstrap=bootstrap_stanza(instance_id, options, recovery_target(pitr, None)),
                external_clusters=[restore_reference(options, pitr)],
            ),
            scheduled_backup_manifest(instance_id, spec, options, fence),
            backup_manifest(
                instance_id, spec.org_id, options, final_backup_name(instance_id), "final", fence
            ),
        ]
    return manifests


def _example_token() -> str:
    fields = {"databaseSystemIdentifier": "7000000000000000000", "latestCheckpointTimelineID": "1"}
    return base64.b64encode(json.dumps(fields).encode()).decode()


# ---- what the operator reports -----------------------------------------------------------------------


def status_of(cluster: Mapping[str, Any]) -> dict[str, Any]:
    status: dict[str, Any] = cluster.get("status") or {}
    return status


def is_read_only(cluster: Mapping[str, Any]) -> bool:
    """In recovery: demoted, and the demotion not yet undone by a promotion with its token."""
    status = status_of(cluster)
    token = status.get("demotionToken")
    return bool(token) and token != status.get("lastPromotionToken")


def cluster_health(cluster: Mapping[str, Any]) -> tuple[bool, str]:
    """Healthy as the operator reports it: its healthy phase, Ready, every instance ready."""
    status = status_of(cluster)
    wanted = int((cluster.get("spec") or {}).get("instances") or 0)
    ready = int(status.get("readyInstances") or 0)
    phase = str(status.get("phase") or "no status yet")
    condition = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    primary = status.get("currentPrimary")
    switching = primary != status.get("targetPrimary")
    healthy = (
        phase == HEALTHY_PHASE
        and ready >= wanted > 0
        and (condition is None or condition.get("status") == "True")
        and bool(primary)
        and not switching
    )
    detail = f"{phase}; {ready}/{wanted} ready"
    if switching:
        detail += f"; primary moving from {primary} to {status.get('targetPrimary')}"
    return healthy, detail


def failing_over_to(cluster: Mapping[str, Any]) -> str | None:
    """The standby the operator is promoting because its primary was lost (None: no failover under
    way; a switchover asked for is not one)."""
    status = status_of(cluster)
    target, primary = status.get("targetPrimary"), status.get("currentPrimary")
    if status.get("phase") != FAILOVER_PHASE or not target or target == primary:
        return None
    return str(target)


# The events CloudNativePG records on a Cluster when it moves the primary (1.30: `FailingOver` as it
# starts a failover, `FailoverTarget` naming the standby it promotes, `SwitchingOver`); with any
# warning recorded on the Cluster, they go to the audit log of a failover the operator carried out.
PRIMARY_EVENT_REASONS = frozenset({"FailingOver", "FailoverTarget", "SwitchingOver"})
# The newest events kept with one failover (Kubernetes keeps a Cluster's events for an hour).
PRIMARY_EVENTS_KEPT = 5


def primary_events(events: Sequence[Mapping[str, Any]], cluster: str) -> tuple[OperatorEvent, ...]:
    """What the operator recorded on the Cluster named `cluster` about moves of its primary, and its
    warnings, from a list of the namespace's events: the newest few, oldest first."""
    found: list[OperatorEvent] = []
    for event in events:
        involved = event.get("involvedObject") or {}
        if involved.get("kind") != "Cluster" or involved.get("name") != cluster:
            continue
        reason, kind = str(event.get("reason") or ""), str(event.get("type") or "Normal")
        if reason not in PRIMARY_EVENT_REASONS and kind != "Warning":
            continue
        at = event.get("lastTimestamp") or event.get("eventTime") or event.get("firstTimestamp")
        found.append(
            OperatorEvent(
                reason=reason,
                message=str(event.get("message") or ""),
                type=kind,
                at=str(at) if at else None,
                count=int(event.get("count") or 1),
            )
        )
    found.sort(key=lambda e: e.at or "")
    return tuple(found[-PRIMARY_EVENTS_KEPT:])


def switchover_status(target: str, now: datetime) -> dict[str, Any]:
    """What `kubectl cnpg promote` writes to the Cluster's status to have the operator switch its
    primary over to `target` (a standby's pod name)."""
    return {
        "targetPrimary": target,
        "targetPrimaryTimestamp": now.isoformat().replace("+00:00", "Z"),
        "phase": SWITCHOVER_PHASE,
        "phaseReason": f"Switching over to {target}",
    }


# CloudNativePG's default archive_timeout: a segment is archived at least this often while written to.
ARCHIVE_TIMEOUT_S = 300.0


def recovery_window(
    cluster: Mapping[str, Any], archives: bool, now: datetime, archive_timeout_s: float = ARCHIVE_TIMEOUT_S
) -> RecoveryWindow | None:
    """The recoverable window the operator's status shows (None where nothing is archived): from its
    first recoverability point; up to `archive_timeout_s` before `now` while its continuous
    archiving works (every segment written before then is archived); the archiving's health from
    its `ContinuousArchiving` condition."""
    if not archives:
        return None
    status = status_of(cluster)
    earliest = status.get("firstRecoverabilityPoint")
    condition = next(
        (c for c in status.get("conditions") or [] if c.get("type") == "ContinuousArchiving"), None
    )
    healthy = None if condition is None else condition.get("status") == "True"
    detail = ""
    if condition is not None and healthy is False:
        reason = condition.get("reason") or "ContinuousArchivingFailing"
        detail = f"{reason}: {condition.get('message') or ''}".strip()
    latest = None
    if healthy and earliest:
        start = datetime.fromisoformat(str(earliest))
        latest = max(start, now - timedelta(seconds=archive_timeout_s)).isoformat()
    return RecoveryWindow(
        earliest=None if earliest is None else str(earliest),
        latest=latest,
        archive_healthy=healthy,
        archive_detail=detail,
        lag_s=archive_timeout_s if healthy else None,
        observed_at=now.isoformat(),
    )


def _container(pod: Mapping[str, Any], name: str = "postgres") -> Mapping[str, Any]:
    for container in (pod.get("spec") or {}).get("containers") or []:
        if container.get("name") == name:
            found: Mapping[str, Any] = container
            return found
    return {}


def _same_quantities(have: Mapping[str, Any], want: Mapping[str, Any]) -> bool:
    try:
        return set(have) == set(want) and all(
            parse_quantity(have[k]) == parse_quantity(want[k]) for k in want
        )
    except ValueError:
        return False


def servers_lag(
    cluster: Mapping[str, Any], pods: Sequence[Mapping[str, Any]], claims: Sequence[Mapping[str, Any]]
) -> str | None:
    """What the servers still lack of the declared Cluster, or None when they match it.

    The operator's healthy phase is necessary but not enough: right after an apply it may still
    report the previous state. So the servers it runs are checked too: as many instance pods as
    declared, each ready and with the declared resources, and volumes at least the declared size.
    """
    spec = cluster.get("spec") or {}
    wanted = int(spec.get("instances") or 0)
    instances = [
        p for p in pods if (p.get("metadata", {}).get("labels") or {}).get("cnpg.io/podRole") == "instance"
    ]
    if len(instances) != wanted:
        return f"{len(instances)} of {wanted} servers running"
    resources = spec.get("resources") or {}
    for pod in instances:
        name = pod["metadata"]["name"]
        conditions = (pod.get("status") or {}).get("conditions") or []
        if not any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions):
            return f"server {name} not ready"
        have = _container(pod).get("resources") or {}
        for bound in ("requests", "limits"):
            if not _same_quantities(have.get(bound) or {}, resources.get(bound) or {}):
                return f"server {name} still runs with its previous {bound}"
    size = gib((spec.get("storage") or {}).get("size"))
    for claim in claims:
        capacity = gib(((claim.get("status") or {}).get("capacity") or {}).get("storage"))
        if capacity < size:
            return f"volume {claim['metadata']['name']} is {capacity}Gi of {size}Gi"
    return None
