"""The kubernetes provisioner: steps as fenced server-side applies of CloudNativePG objects via the client."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import secrets
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

import kubernetes
import urllib3

from controlplane.core.failures import QUOTA_EXCEEDED, RESTORE_SOURCE_UNAVAILABLE
from controlplane.core.step_errors import PermanentError, StaleFence, TemporaryError
from controlplane.runtime import fencing
from controlplane.runtime.settings import Settings
from provisioners.base import (
    BackupInfo,
    ConnectionInfo,
    DeprovisionResult,
    InstanceSpec,
    Observation,
    OperatorEvent,
    Promotion,
    Provisioner,
    RecoveryWindow,
    Resource,
    RestoreSource,
)
from provisioners.cnpg import (
    APPLY_CONTENT_TYPE,
    CNPG_API_VERSION,
    CNPG_CLUSTER_LABEL,
    DBNAME,
    FENCE_ANNOTATION,
    FIELD_MANAGER,
    GENERATION_ANNOTATION,
    INSTANCE_LABEL,
    MANAGED_BY,
    MERGE_CONTENT_TYPE,
    MONITORING_API_VERSION,
    OWNER,
    PLAN_ANNOTATION,
    PORT,
    RESTORE_SOURCE,
    SSLMODE,
    ClusterOptions,
    Credentials,
    Replica,
    backup_manifest,
    bootstrap_stanza,
    cluster_health,
    cluster_manifest,
    credentials_name,
    failing_over_to,
    final_backup_name,
    gib,
    is_read_only,
    network_policy_manifest,
    owned_selector,
    pod_monitor_manifest,
    primary_events,
    recovery_target,
    recovery_window,
    resource_name,
    restore_reference,
    scheduled_backup_manifest,
    secret_manifest,
    servers_lag,
    status_of,
    switchover_status,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


def translate(exc: BaseException) -> Exception:
    """API errors in the engine's terms: 409, 429, 5xx and timeouts temporary; 400, 403, 422 permanent."""
    if isinstance(exc, kubernetes.client.exceptions.ApiException):
        status = int(exc.status or 0)
        message = f"kubernetes API {status} {exc.reason or ''}".strip()
        detail = _api_message(exc)
        if detail:
            message += f": {detail}"
        if status == 429:
            retry_after = (exc.headers or {}).get("Retry-After")
            delay = float(retry_after) if retry_after and str(retry_after).isdigit() else None
            return TemporaryError(f"{message} (throttled)", delay_s=delay)
        if status == 409 or status >= 500 or status == 0:
            return TemporaryError(message)
        if status == 403 and "exceeded quota" in detail:
            # A ResourceQuota of the namespace refuses the object: what customers know as a quota.
            return PermanentError(message, code=QUOTA_EXCEEDED)
        if status in (400, 401, 403, 404, 422):
            return PermanentError(message)
        return TemporaryError(message)
    if isinstance(exc, urllib3.exceptions.HTTPError | TimeoutError | ConnectionError):
        return TemporaryError(f"kubernetes API unreachable: {type(exc).__name__}: {exc}")
    return exc if isinstance(exc, Exception) else RuntimeError(str(exc))


def _api_message(exc: kubernetes.client.exceptions.ApiException) -> str:
    try:
        return str(json.loads(exc.body or "{}").get("message") or "")[:300]
    except (ValueError, AttributeError):
        return ""


# ---- the API edge ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    """One resource kind the provisioner reads or writes, and where its collection lives."""

    kind: str
    api_version: str
    plural: str

    @property
    def group(self) -> str:
        return "" if "/" not in self.api_version else self.api_version.split("/")[0]

    def path(self, namespace: str, name: str | None = None) -> str:
        base = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        path = f"{base}/namespaces/{namespace}/{self.plural}"
        return path if name is None else f"{path}/{name}"


CLUSTER = Kind("Cluster", CNPG_API_VERSION, "clusters")
BACKUP = Kind("Backup", CNPG_API_VERSION, "backups")
SCHEDULED_BACKUP = Kind("ScheduledBackup", CNPG_API_VERSION, "scheduledbackups")
NETWORK_POLICY = Kind("NetworkPolicy", "networking.k8s.io/v1", "networkpolicies")
POD_MONITOR = Kind("PodMonitor", MONITORING_API_VERSION, "podmonitors")
SECRET = Kind("Secret", "v1", "secrets")
POD = Kind("Pod", "v1", "pods")
PVC = Kind("PersistentVolumeClaim", "v1", "persistentvolumeclaims")
EVENT = Kind("Event", "v1", "events")
KINDS = {
    k.kind: k
    for k in (CLUSTER, BACKUP, SCHEDULED_BACKUP, NETWORK_POLICY, POD_MONITOR, SECRET, POD, PVC, EVENT)
}
# What the provisioner creates per instance, deleted on deprovision in this order (the schedule
# first, so no backup starts on a cluster going away; the Cluster's own objects go with it). The
# PodMonitor only where the installation makes them (`ClusterOptions.pod_monitor`): without the
# Prometheus Operator's CRDs, its collection does not exist.
DELETION_ORDER = (SCHEDULED_BACKUP, CLUSTER, POD_MONITOR, NETWORK_POLICY, SECRET)


class KubernetesApi:
    """The few calls used, through the official client's ApiClient: apply, merge patch, get, list, delete."""

    def __init__(self, api_client: Any, timeout_s: float = 30, connect_timeout_s: float = 5) -> None:
        self.client = api_client
        self.timeout = (connect_timeout_s, timeout_s)

    def _call(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, Any]] | None = None,
        body: Any = None,
        content_type: str | None = None,
    ) -> dict[str, Any] | None:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        request = self.client.param_serialize(
            method=method,
            resource_path=path,
            query_params=query or [],
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self.client.call_api(*request, _request_timeout=self.timeout)
        response.read()
        if not 200 <= response.status <= 299:
            raise kubernetes.client.exceptions.ApiException.from_response(
                http_resp=response, body=response.data.decode(errors="replace"), data=None
            )
        if not response.data:
            return None
        value: dict[str, Any] = json.loads(response.data)
        return value

    def apply(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply: declare the whole object; the field manager owns what it sets."""
        kind = KINDS[manifest["kind"]]
        meta = manifest["metadata"]
        result = self._call(
            "PATCH",
            kind.path(meta["namespace"], meta["name"]),
            # Strict: an unknown field is refused, not silently dropped (custom resources prune).
            query=[("fieldManager", FIELD_MANAGER), ("force", "true"), ("fieldValidation", "Strict")],
            body=dict(manifest),
            content_type=APPLY_CONTENT_TYPE,
        )
        assert result is not None
        return result

    def annotate(
        self, kind: Kind, namespace: str, name: str, annotations: Mapping[str, str], resource_version: str
    ) -> dict[str, Any]:
        """Set annotations only (a merge patch), over the version that was read."""
        body = {"metadata": {"annotations": dict(annotations), "resourceVersion": resource_version}}
        result = self._call(
            "PATCH",
            kind.path(namespace, name),
            query=[("fieldManager", FIELD_MANAGER)],
            body=body,
            content_type=MERGE_CONTENT_TYPE,
        )
        assert result is not None
        return result

    def patch_status(
        self, kind: Kind, namespace: str, name: str, status: Mapping[str, Any], resource_version: str
    ) -> dict[str, Any]:
        """Set status fields (a merge patch of the status subresource), over the version that was
        read: what `kubectl cnpg promote` does to ask the operator for a switchover."""
        body = {"metadata": {"resourceVersion": resource_version}, "status": dict(status)}
        result = self._call(
            "PATCH",
            kind.path(namespace, name) + "/status",
            query=[("fieldManager", FIELD_MANAGER)],
            body=body,
            content_type=MERGE_CONTENT_TYPE,
        )
        assert result is not None
        return result

    def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", kind.path(namespace, name))
        except kubernetes.client.exceptions.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list(
        self,
        kind: Kind,
        namespace: str,
        selector: Mapping[str, str],
        fields: Mapping[str, str] | None = None,
    ) -> list[dict[str, Any]]:
        """The objects of a kind whose labels match `selector` (and whose fields match `fields`)."""
        query = [("labelSelector", ",".join(f"{k}={v}" for k, v in sorted(selector.items())))]
        if fields:
            query.append(("fieldSelector", ",".join(f"{k}={v}" for k, v in sorted(fields.items()))))
        result = self._call("GET", kind.path(namespace), query=query)
        items: list[dict[str, Any]] = (result or {}).get("items", [])
        return items

    def delete(self, kind: Kind, namespace: str, name: str) -> bool:
        """Delete one object; False when it was already gone (404 is done)."""
        try:
            self._call(
                "DELETE",
                kind.path(namespace, name),
                body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"},
            )
        except kubernetes.client.exceptions.ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True


# ---- the provisioner ---------------------------------------------------------------------------------

# How often a fenced apply re-reads and tries again when the object changed in between (the
# operator writes its status all the time); a higher fence seen on a re-read ends it at once.
APPLY_TRIES = 5


class KubernetesProvisioner(Provisioner):
    """Instances as CloudNativePG Clusters in one namespace; every step is a declarative, fenced apply."""

    name = "kubernetes"
    supports_restore = True
    # The window comes from the Cluster's status (its first recoverability point, its archiving).
    reports_windows = True
    # The operator fails a lost primary over to a standby by itself; the control plane records it.
    fails_over_itself = True
    # An HA plan's read-only endpoint is the operator's `-ro` Service (its standbys).
    serves_read_only = True

    def __init__(
        self,
        api: KubernetesApi,
        options: ClusterOptions | str,
        *,
        ready_wait_s: float = 120,
        backup_wait_s: float = 600,
        poll_s: float = 2,
    ) -> None:
        self.api = api
        self.options = ClusterOptions(options) if isinstance(options, str) else options
        self.ready_wait_s = ready_wait_s
        self.backup_wait_s = backup_wait_s
        self.poll_s = poll_s

    @property
    def namespace(self) -> str:
        return self.options.namespace

    @classmethod
    def from_settings(cls, settings: Settings) -> KubernetesProvisioner:
        """The API at settings.provisioner.kubernetes_host, else in-cluster, else the kubeconfig."""
        configuration = kubernetes.client.Configuration()
        host = settings.provisioner.kubernetes_host
        if host:
            configuration.host = host
            token = settings.provisioner.kubernetes_token
            if token is not None:
                configuration.api_key = {"BearerToken": token.get_secret_value()}
                configuration.api_key_prefix = {"BearerToken": "Bearer"}
        else:
            try:
                kubernetes.config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            except kubernetes.config.ConfigException:
                kubernetes.config.load_kube_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        api = KubernetesApi(kubernetes.client.ApiClient(configuration))
        return cls(api, ClusterOptions.from_settings(settings))

    async def _run(self, work: Callable[[], T]) -> T:
        try:
            return await asyncio.to_thread(work)
        except (TemporaryError, PermanentError, StaleFence):
            raise
        except Exception as exc:
            raise translate(exc) from exc

    # ---- the fenced apply of the Cluster: every step goes through it -------------------------------

    def _cluster(self, instance_id: uuid.UUID) -> dict[str, Any] | None:
        return self.api.get(CLUSTER, self.namespace, resource_name(instance_id))

    @staticmethod
    def _admit(instance_id: uuid.UUID, current: Mapping[str, Any] | None, fence: int) -> None:
        annotations = (current or {}).get("metadata", {}).get("annotations") or {}
        seen = annotations.get(FENCE_ANNOTATION)
        fencing.admit(f"cluster/{resource_name(instance_id)}", int(seen) if seen else None, fence)

    def _fenced_cluster(
        self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, *, replica: Replica | None = None
    ) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """Read the Cluster, admit the fence against its annotation, apply over that version.

        The apply carries the resourceVersion that was read, so a worker with a lower fence that
        raced in between gets a 409 instead of overwriting: the fence is enforced by the API server.
        What only the first apply decides (the bootstrap) and what must never go back (a volume's
        size, the replica stanza unless asked) is taken from the Cluster that exists.
        Returns the Cluster before and after.
        """
        for attempt in range(APPLY_TRIES):
            current = self._cluster(instance_id)
            self._admit(instance_id, current, fence)
            if current is None:
                bootstrap, clusters = self._first_bootstrap(instance_id, spec)
                storage_gb = None
            else:
                bootstrap = current["spec"].get("bootstrap")
                clusters = [
                    c for c in current["spec"].get("externalClusters") or [] if c["name"] == RESTORE_SOURCE
                ]
                storage_gb = gib((current["spec"].get("storage") or {}).get("size"))
            manifest = cluster_manifest(
                instance_id,
                spec,
                self.options,
                fence,
                replica=replica if replica is not None else Replica.of(current),
                bootstrap=bootstrap,
                external_clusters=clusters,
                storage_gb=storage_gb,
                resource_version=None if current is None else current["metadata"].get("resourceVersion"),
            )
            try:
                return current, self.api.apply(manifest)
            except kubernetes.client.exceptions.ApiException as exc:
                if exc.status != 409 or attempt == APPLY_TRIES - 1:
                    raise
                log.info("cluster of %s changed while being applied; reading it again", instance_id)
        raise AssertionError("unreachable")

    def _record_fence(self, instance_id: uuid.UUID, fence: int) -> dict[str, Any] | None:
        """Admit the fence and mark the Cluster with it, declaring nothing else (a merge patch of one
        annotation over the version read, re-read on a 409 as the fenced apply is). None: no Cluster."""
        for attempt in range(APPLY_TRIES):
            current = self._cluster(instance_id)
            self._admit(instance_id, current, fence)
            if current is None:
                return None
            meta = current["metadata"]
            try:
                return self.api.annotate(
                    CLUSTER,
                    self.namespace,
                    meta["name"],
                    {FENCE_ANNOTATION: str(fence)},
                    meta["resourceVersion"],
                )
            except kubernetes.client.exceptions.ApiException as exc:
                if exc.status != 409 or attempt == APPLY_TRIES - 1:
                    raise
        raise AssertionError("unreachable")

    def _first_bootstrap(
        self, instance_id: uuid.UUID, spec: InstanceSpec
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """initdb, or recovery from the source's archive (resolving a named backup to its id)."""
        source = spec.restore_from
        if source is None:
            return bootstrap_stanza(instance_id, self.options, None), []
        reference = restore_reference(self.options, source)
        backup_id = None if source.backup is None else self._backup_id(source)
        return bootstrap_stanza(instance_id, self.options, recovery_target(source, backup_id)), [reference]

    def _backup_id(self, source: RestoreSource) -> str:
        assert source.backup is not None
        backup = self.api.get(BACKUP, self.namespace, source.backup)
        if backup is None:
            raise PermanentError(f"backup {source.backup!r} does not exist", code=RESTORE_SOURCE_UNAVAILABLE)
        if (backup.get("spec") or {}).get("cluster", {}).get("name") != resource_name(source.instance_id):
            raise PermanentError(
                f"backup {source.backup!r} is not a backup of instance {source.instance_id}",
                code=RESTORE_SOURCE_UNAVAILABLE,
            )
        status = backup.get("status") or {}
        if status.get("phase") == "failed":
            raise PermanentError(
                f"backup {source.backup!r} failed: {status.get('error') or 'no detail'}",
                code=RESTORE_SOURCE_UNAVAILABLE,
            )
        if status.get("phase") != "completed" or not status.get("backupId"):
            raise TemporaryError(f"backup {source.backup!r} is not complete yet", delay_s=30)
        return str(status["backupId"])

    def _credentials(self, instance_id: uuid.UUID, password: str | None) -> Credentials:
        """Adopt the credentials of an existing Secret; generate them the first time."""
        existing = self.api.get(SECRET, self.namespace, credentials_name(instance_id))
        if existing is None:
            return Credentials.generate(password)
        data = {k: base64.b64decode(v).decode() for k, v in (existing.get("data") or {}).items()}
        return Credentials(
            data.get("username") or OWNER, password or data.get("password") or secrets.token_urlsafe(24)
        )

    def _wait(
        self, instance_id: uuid.UUID, what: str, done: Callable[[dict[str, Any]], str | None]
    ) -> dict[str, Any]:
        """Poll the Cluster until `done` reports nothing left (None), or give up temporarily."""
        deadline = time.monotonic() + self.ready_wait_s
        while True:
            current = self._cluster(instance_id)
            lag = "cluster missing" if current is None else done(current)
            if lag is None and current is not None:
                return current
            if time.monotonic() >= deadline:
                raise TemporaryError(f"{what} of {instance_id} not done yet: {lag}", delay_s=10)
            time.sleep(self.poll_s)

    def _rolled_out(self, cluster: dict[str, Any]) -> str | None:
        """None once the operator reports the Cluster healthy and its servers match the declaration."""
        healthy, detail = cluster_health(cluster)
        if not healthy:
            return detail
        selector = {CNPG_CLUSTER_LABEL: cluster["metadata"]["name"]}
        pods = self.api.list(POD, self.namespace, selector)
        return servers_lag(cluster, pods, self.api.list(PVC, self.namespace, selector))

    @staticmethod
    def _settled(cluster: dict[str, Any]) -> str | None:
        healthy, detail = cluster_health(cluster)
        return None if healthy else detail

    # ---- steps ---------------------------------------------------------------------------------------

    async def allocate_storage(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> None:
        """The credentials, then the Cluster (the operator creates its volumes and servers)."""

        def work() -> None:
            self._admit(instance_id, self._cluster(instance_id), fence)
            credentials = self._credentials(instance_id, None)
            self.api.apply(secret_manifest(instance_id, spec, self.options, credentials, fence))
            self._fenced_cluster(instance_id, spec, fence)

        await self._run(work)

    async def configure_network(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> None:
        """Who may reach the servers (the NetworkPolicy) and, where the installation makes them,
        the PodMonitor that has Prometheus scrape their exporters."""

        def work() -> None:
            self._fenced_cluster(instance_id, spec, fence)
            self.api.apply(network_policy_manifest(instance_id, spec, self.options, fence))
            if self.options.pod_monitor:
                self.api.apply(pod_monitor_manifest(instance_id, spec, self.options, fence))

        await self._run(work)

    async def initialize_database(
        self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, *, password: str | None = None
    ) -> ConnectionInfo:
        """Wait for the operator's rollout; the scheduled backups; the connection with the operator's CA."""

        def work() -> ConnectionInfo:
            credentials = self._credentials(instance_id, password)
            self.api.apply(secret_manifest(instance_id, spec, self.options, credentials, fence))
            self._fenced_cluster(instance_id, spec, fence)
            self._wait(instance_id, "rollout", self._rolled_out)
            if self.options.object_store:
                self.api.apply(scheduled_backup_manifest(instance_id, spec, self.options, fence))
            return ConnectionInfo(
                self.options.host(instance_id),
                PORT,
                DBNAME,
                credentials.user,
                credentials.password,
                sslmode=SSLMODE,
                ca_certificate=self._ca_certificate(instance_id),
                read_only=(
                    (self.options.read_only_host(instance_id), PORT, DBNAME)
                    if spec.shape.instances > 1
                    else None
                ),
            )

        return await self._run(work)

    def _ca_certificate(self, instance_id: uuid.UUID) -> str:
        secret = self.api.get(SECRET, self.namespace, f"{resource_name(instance_id)}-ca")
        encoded = ((secret or {}).get("data") or {}).get("ca.crt")
        if not encoded:
            raise TemporaryError(f"the operator has not issued the CA of {instance_id} yet")
        return base64.b64decode(encoded).decode()

    def _existing(self, instance_id: uuid.UUID, fence: int) -> dict[str, Any]:
        current = self._cluster(instance_id)
        self._admit(instance_id, current, fence)
        if current is None:
            raise TemporaryError(f"instance {instance_id} has no cluster")
        return current

    async def apply_plan(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> bool:
        """A patch of the Cluster; done when the operator has rolled it out."""

        def work() -> bool:
            self._existing(instance_id, fence)
            before, after = self._fenced_cluster(instance_id, spec, fence)
            assert before is not None
            self._wait(instance_id, "plan change", self._rolled_out)
            return bool(before["spec"] != after["spec"])

        return await self._run(work)

    async def suspend(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> bool:
        """Demote the Cluster: its primary restarts in recovery, where no session can write."""

        def work() -> bool:
            current = self._existing(instance_id, fence)
            was = is_read_only(current)
            self._fenced_cluster(instance_id, spec, fence, replica=Replica("demoted"))
            self._wait(instance_id, "suspension", lambda c: None if is_read_only(c) else "still writable")
            self._wait(instance_id, "suspension", self._settled)
            return not was

        return await self._run(work)

    async def resume(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> bool:
        """Promote it again with the token of its own demotion: nothing replayed is lost."""

        def work() -> bool:
            current = self._existing(instance_id, fence)
            was = is_read_only(current)
            if Replica.of(current).state == "none":
                return False  # never suspended
            token = status_of(current).get("demotionToken") or None
            self._fenced_cluster(instance_id, spec, fence, replica=Replica("promoted", token))
            self._wait(instance_id, "resumption", lambda c: "still read-only" if is_read_only(c) else None)
            self._wait(instance_id, "resumption", self._settled)
            return was

        return await self._run(work)

    async def switchover(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> Promotion | None:
        """The operator's promote (`kubectl cnpg promote`): the Cluster marked with the fence, its
        status's `targetPrimary` set to a ready standby over the version read, then waited for until
        the operator reports it the current primary and the Cluster healthy. A move of the primary
        already under way (a retry's own) is waited for, not asked for again. None when the Cluster
        has one server."""

        def work() -> Promotion | None:
            current = self._existing(instance_id, fence)
            if int(current["spec"].get("instances") or 1) <= 1:
                return None
            target, old = self._ask_switchover(instance_id, fence)
            done = self._wait(instance_id, "switchover", lambda c: self._switched(c, target))
            at = status_of(done).get("currentPrimaryTimestamp") or datetime.now(UTC).isoformat()
            log.warning("instance %s: the operator switched over from %s to %s", instance_id, old, target)
            return Promotion(target, old, "", str(at))

        return await self._run(work)

    def _ask_switchover(self, instance_id: uuid.UUID, fence: int) -> tuple[str, str | None]:
        """The standby the primary moves to and the primary it leaves: one under way adopted, else a
        ready standby asked for through the status subresource (re-read on a 409, as applies are)."""
        for attempt in range(APPLY_TRIES):
            marked = self._record_fence(instance_id, fence)
            if marked is None:
                raise TemporaryError(f"instance {instance_id} has no cluster")
            status = status_of(marked)
            primary, target = status.get("currentPrimary"), status.get("targetPrimary")
            if target and target != primary:
                return str(target), primary  # already moving (this job's earlier try, or a failover)
            standby = self._ready_standby(marked)
            if standby is None:
                raise TemporaryError(f"instance {instance_id}: no ready standby to switch over to")
            meta = marked["metadata"]
            wanted = switchover_status(standby, datetime.now(UTC))
            try:
                self.api.patch_status(CLUSTER, self.namespace, meta["name"], wanted, meta["resourceVersion"])
            except kubernetes.client.exceptions.ApiException as exc:
                if exc.status != 409 or attempt == APPLY_TRIES - 1:
                    raise
                continue
            return standby, primary
        raise AssertionError("unreachable")

    def _ready_standby(self, cluster: Mapping[str, Any]) -> str | None:
        """A ready server of the Cluster that is not its primary (by name, the lowest)."""
        primary = status_of(cluster).get("currentPrimary")
        pods = self.api.list(POD, self.namespace, {CNPG_CLUSTER_LABEL: cluster["metadata"]["name"]})
        ready = sorted(
            pod["metadata"]["name"]
            for pod in pods
            if (pod["metadata"].get("labels") or {}).get("cnpg.io/podRole") == "instance"
            and pod["metadata"]["name"] != primary
            and any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for c in (pod.get("status") or {}).get("conditions") or []
            )
        )
        return ready[0] if ready else None

    @staticmethod
    def _switched(cluster: dict[str, Any], target: str) -> str | None:
        primary = status_of(cluster).get("currentPrimary")
        if primary != target:
            return f"the primary is still {primary}, not {target}"
        healthy, detail = cluster_health(cluster)
        return None if healthy else detail

    async def take_backup(
        self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, *, kind: str = "on_demand"
    ) -> BackupInfo:
        def work() -> BackupInfo:
            self._require_backups(instance_id, fence)
            name = f"{resource_name(instance_id)}-backup-{fence}"
            return self._backup(instance_id, spec.org_id, name, "on-demand", fence)

        return await self._run(work)

    def _require_backups(self, instance_id: uuid.UUID, fence: int) -> None:
        if not self.options.object_store:
            raise PermanentError(
                "no backup object store is configured (CONTROLPLANE_KUBERNETES_BACKUP_OBJECT_STORE)"
            )
        if self._record_fence(instance_id, fence) is None:
            raise PermanentError(f"instance {instance_id} has no cluster to back up")

    def _backup(
        self,
        instance_id: uuid.UUID,
        org_id: uuid.UUID | None,
        name: str,
        purpose: str,
        fence: int,
    ) -> BackupInfo:
        """Apply a Backup (adopting one of that name) and wait until the operator reports it complete.

        A failed Backup is deleted, so that the retry takes a new one under the same name.
        """
        existing = self.api.get(BACKUP, self.namespace, name)
        if existing is None:
            self.api.apply(backup_manifest(instance_id, org_id, self.options, name, purpose, fence))
        deadline = time.monotonic() + self.backup_wait_s
        while True:
            backup = self.api.get(BACKUP, self.namespace, name) or {}
            status = backup.get("status") or {}
            if status.get("phase") == "completed":
                return BackupInfo(
                    name, instance_id, status.get("stoppedAt"), str(status.get("backupId") or "")
                )
            if status.get("phase") == "failed":
                self.api.delete(BACKUP, self.namespace, name)
                raise TemporaryError(f"backup {name} failed: {status.get('error') or 'no detail'}")
            if time.monotonic() >= deadline:
                raise TemporaryError(f"backup {name} still {status.get('phase') or 'pending'}", delay_s=30)
            time.sleep(self.poll_s)

    async def deprovision(
        self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, *, skip_backup: bool = False
    ) -> DeprovisionResult:
        """Final backup (waited for) unless skipped, then every object the instance had, by label."""

        def work() -> DeprovisionResult:
            current = self._cluster(instance_id)
            backup: str | None = None
            if current is not None:
                backup = None if skip_backup else self._take_final_backup(instance_id, spec, fence, current)
                if backup is None:
                    self._record_fence(instance_id, fence)
            removed = False
            for kind in self._owned_kinds():
                for item in self.api.list(kind, self.namespace, owned_selector(instance_id)):
                    removed = self.api.delete(kind, self.namespace, item["metadata"]["name"]) or removed
            return DeprovisionResult(backup=backup, removed=removed or current is not None)

        return await self._run(work)

    async def final_backup(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> str | None:
        def work() -> str | None:
            current = self._cluster(instance_id)
            return None if current is None else self._take_final_backup(instance_id, spec, fence, current)

        return await self._run(work)

    def _take_final_backup(
        self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, current: Mapping[str, Any]
    ) -> str | None:
        """The final Backup's name, taken (or adopted) and waited for; None when the cluster never
        had a primary: it never held data, there is nothing to back up."""
        if not status_of(current).get("currentPrimary"):
            return None
        if not self.options.object_store:
            raise PermanentError(
                "the final backup needs a backup object store"
                " (CONTROLPLANE_KUBERNETES_BACKUP_OBJECT_STORE); delete with"
                " skip_final_backup to remove the instance without one"
            )
        self._require_backups(instance_id, fence)
        return self._backup(instance_id, spec.org_id, final_backup_name(instance_id), "final", fence).name

    def _owned_kinds(self) -> tuple[Kind, ...]:
        """The kinds this installation creates per instance, in their order of deletion."""
        return tuple(kind for kind in DELETION_ORDER if kind is not POD_MONITOR or self.options.pod_monitor)

    # ---- reading -------------------------------------------------------------------------------------

    async def observe(self, instance_id: uuid.UUID) -> Observation:
        def work() -> Observation:
            current = self._cluster(instance_id)
            if current is None:
                return Observation(False, detail="cluster missing")
            annotations = current["metadata"].get("annotations") or {}
            healthy, detail = cluster_health(current)
            generation = annotations.get(GENERATION_ANNOTATION)
            status = status_of(current)
            return Observation(
                True,
                running=int(status.get("readyInstances") or 0) > 0,
                healthy=healthy,
                read_only=is_read_only(current),
                endpoint=(self.options.host(instance_id), PORT),
                plan_applied=annotations.get(PLAN_ANNOTATION),
                generation=int(generation) if generation else None,
                detail=detail,
                recovery=self._window(current),
                servers=int(current["spec"].get("instances") or 1),
                failover_to=failing_over_to(current),
                primary=status.get("currentPrimary") or None,
                primary_since=status.get("currentPrimaryTimestamp") or None,
            )

        return await self._run(work)

    async def operator_events(self, instance_id: uuid.UUID) -> tuple[OperatorEvent, ...]:
        """The events CloudNativePG recorded on the instance's Cluster about moves of its primary,
        and its warnings (one list of the Cluster's events, as `kubectl describe` shows them)."""
        name = resource_name(instance_id)

        def work() -> tuple[OperatorEvent, ...]:
            fields = {"involvedObject.kind": "Cluster", "involvedObject.name": name}
            return primary_events(self.api.list(EVENT, self.namespace, {}, fields), name)

        return await self._run(work)

    def _window(self, cluster: Mapping[str, Any]) -> RecoveryWindow | None:
        return recovery_window(cluster, bool(self.options.object_store), datetime.now(UTC))

    async def recovery_window(self, instance_id: uuid.UUID) -> RecoveryWindow | None:
        def work() -> RecoveryWindow | None:
            current = self._cluster(instance_id)
            return None if current is None else self._window(current)

        return await self._run(work)

    async def inventory(self) -> list[Resource]:
        def work() -> list[Resource]:
            found: list[Resource] = []
            for kind in self._owned_kinds():
                for item in self.api.list(kind, self.namespace, {MANAGED_BY: FIELD_MANAGER}):
                    meta = item["metadata"]
                    owner = (meta.get("labels") or {}).get(INSTANCE_LABEL)
                    found.append(Resource(kind.kind, meta["name"], _as_uuid(owner)))
            return found

        return await self._run(work)

    async def close(self) -> None:
        await asyncio.to_thread(self.api.client.close)


def _as_uuid(text: str | None) -> uuid.UUID | None:
    try:
        return None if text is None else uuid.UUID(text)
    except ValueError:
        return None
