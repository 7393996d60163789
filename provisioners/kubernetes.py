"""The kubernetes provisioner: pure manifest builders, and steps as server-side applies via the client."""

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
from typing import Any, TypeVar

import kubernetes
import urllib3

from controlplane import fencing
from controlplane.errors import PermanentError, StaleFence, TemporaryError
from controlplane.settings import Settings
from provisioners.base import (
    ConnectionInfo,
    DeprovisionResult,
    InstanceSpec,
    Observation,
    Provisioner,
    Resource,
)

log = logging.getLogger(__name__)

FIELD_MANAGER = "controlplane"
APPLY_CONTENT_TYPE = "application/apply-patch+yaml"
MANAGED_BY = "app.kubernetes.io/managed-by"
INSTANCE_LABEL = "controlplane.io/instance-id"
BACKUP_OF_LABEL = "controlplane.io/backup-of"
FENCE_ANNOTATION = "controlplane.io/fence"
PLAN_ANNOTATION = "controlplane.io/plan"
GENERATION_ANNOTATION = "controlplane.io/generation"
READ_ONLY_ANNOTATION = "controlplane.io/read-only"
DEFAULT_IMAGE = "postgres:{version}"
DEFAULT_VERSION = "15"
POSTGRES_UID = 999
PORT = 5432
DBNAME = "app"
ADMIN_USER = "postgres"
T = TypeVar("T")

# CPU and memory each plan asks for (the PostgreSQL settings come from controlplane.plans).
PLAN_RESOURCES: Mapping[str, tuple[str, str]] = {
    "dev": ("250m", "256Mi"),
    "small": ("500m", "512Mi"),
    "medium": ("1", "1Gi"),
}
DEFAULT_RESOURCES = ("500m", "512Mi")

# Runs before the image's entrypoint: a suspended instance starts in standby mode (hard read-only,
# which no session, not even a superuser's, can switch off without pg_promote); a resumed one
# starts as a primary again. The env change itself rolls the pod, which ends every session.
START_SCRIPT = """\
set -e
if [ -s "$PGDATA/PG_VERSION" ]; then
  if [ "$CONTROLPLANE_READ_ONLY" = "true" ]; then touch "$PGDATA/standby.signal"
  else rm -f "$PGDATA/standby.signal"; fi
fi
exec docker-entrypoint.sh postgres -c listen_addresses='*' -c hot_standby=on \\
  -c password_encryption=scram-sha-256 \\
  -c max_connections="$PG_MAX_CONNECTIONS" -c shared_buffers="$PG_SHARED_BUFFERS"
"""

# Runs once, on an empty data directory: the customer's role is never a superuser.
INIT_SCRIPT = """\
#!/bin/sh
set -e
psql -v ON_ERROR_STOP=1 -v owner="$OWNER_USER" -v password="$OWNER_PASSWORD" -v db="$OWNER_DB" \\
  --username "$POSTGRES_USER" --dbname postgres <<'EOSQL'
CREATE ROLE :"owner" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION PASSWORD :'password';
CREATE DATABASE :"db" OWNER :"owner";
REVOKE CONNECT ON DATABASE :"db" FROM PUBLIC;
GRANT CONNECT ON DATABASE :"db" TO :"owner";
EOSQL
"""


# ---- pure manifest builders ----------------------------------------------------------------------


def resource_name(instance_id: uuid.UUID) -> str:
    return f"pg-{instance_id}"


def owner_user(instance_id: uuid.UUID) -> str:
    return f"app_{instance_id.hex[:12]}"


def selector_labels(instance_id: uuid.UUID) -> dict[str, str]:
    """What the StatefulSet selects its pods by (immutable once created)."""
    return {"app.kubernetes.io/name": "postgresql", INSTANCE_LABEL: str(instance_id)}


def labels(instance_id: uuid.UUID) -> dict[str, str]:
    """Every resource of the instance carries its id and the manager, so a sweep can find it."""
    return {
        **selector_labels(instance_id),
        "app.kubernetes.io/instance": resource_name(instance_id),
        "app.kubernetes.io/component": "database",
        MANAGED_BY: FIELD_MANAGER,
    }


def _metadata(instance_id: uuid.UUID, namespace: str, name: str, fence: int, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": namespace,
        "labels": labels(instance_id),
        "annotations": {FENCE_ANNOTATION: str(fence)},
        **extra,
    }


@dataclass(frozen=True)
class Credentials:
    user: str
    password: str = ""
    admin_password: str = ""

    @classmethod
    def generate(cls, instance_id: uuid.UUID, password: str | None = None) -> Credentials:
        return cls(owner_user(instance_id), password or secrets.token_urlsafe(24), secrets.token_urlsafe(32))


def secret_manifest(
    instance_id: uuid.UUID, namespace: str, credentials: Credentials, fence: int
) -> dict[str, Any]:
    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(instance_id, namespace, f"{resource_name(instance_id)}-credentials", fence),
        "type": "Opaque",
        "data": {
            "username": b64(credentials.user),
            "password": b64(credentials.password),
            "database": b64(DBNAME),
            "admin-password": b64(credentials.admin_password),
        },
    }


def init_config_manifest(instance_id: uuid.UUID, namespace: str, fence: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(instance_id, namespace, f"{resource_name(instance_id)}-init", fence),
        "data": {"10-owner.sh": INIT_SCRIPT},
    }


def service_manifest(instance_id: uuid.UUID, namespace: str, fence: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(instance_id, namespace, resource_name(instance_id), fence),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(instance_id),
            "ports": [{"name": "postgresql", "port": PORT, "targetPort": "postgresql", "protocol": "TCP"}],
        },
    }


def statefulset_manifest(
    instance_id: uuid.UUID,
    namespace: str,
    spec: InstanceSpec,
    fence: int,
    *,
    replicas: int,
    read_only: bool,
    resource_version: str | None = None,
) -> dict[str, Any]:
    """The instance's server: one pod, its storage from a volume claim template, settings from the plan."""
    name = resource_name(instance_id)
    secret = f"{name}-credentials"
    cpu, memory = PLAN_RESOURCES.get(spec.plan, DEFAULT_RESOURCES)
    settings = spec.server_settings()
    metadata = _metadata(instance_id, namespace, name, fence)
    metadata["annotations"].update(
        {
            PLAN_ANNOTATION: spec.plan,
            GENERATION_ANNOTATION: str(spec.generation),
            READ_ONLY_ANNOTATION: "true" if read_only else "false",
        }
    )
    if resource_version is not None:
        metadata["resourceVersion"] = resource_version  # apply only over what was read: fenced

    def from_secret(key: str) -> dict[str, Any]:
        return {"valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}

    env = [
        {"name": "PGDATA", "value": "/var/lib/postgresql/data/pgdata"},
        {"name": "POSTGRES_USER", "value": ADMIN_USER},
        {"name": "POSTGRES_PASSWORD", **from_secret("admin-password")},
        {"name": "POSTGRES_INITDB_ARGS", "value": "--auth=scram-sha-256"},
        {"name": "POSTGRES_HOST_AUTH_METHOD", "value": "scram-sha-256"},
        {"name": "OWNER_USER", **from_secret("username")},
        {"name": "OWNER_PASSWORD", **from_secret("password")},
        {"name": "OWNER_DB", **from_secret("database")},
        {"name": "PG_MAX_CONNECTIONS", "value": settings["max_connections"]},
        {"name": "PG_SHARED_BUFFERS", "value": settings["shared_buffers"]},
        {"name": "CONTROLPLANE_READ_ONLY", "value": "true" if read_only else "false"},
    ]
    container = {
        "name": "postgres",
        "image": DEFAULT_IMAGE.format(version=spec.version or DEFAULT_VERSION),
        "command": ["sh", "-c", START_SCRIPT],
        "env": env,
        "ports": [{"name": "postgresql", "containerPort": PORT, "protocol": "TCP"}],
        "readinessProbe": {
            "exec": {"command": ["sh", "-c", f'pg_isready -h 127.0.0.1 -p {PORT} -U "$POSTGRES_USER"']},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
        "resources": {
            "requests": {"cpu": cpu, "memory": memory},
            "limits": {"memory": memory},
        },
        "securityContext": {"allowPrivilegeEscalation": False, "runAsNonRoot": True},
        "volumeMounts": [
            {"name": "data", "mountPath": "/var/lib/postgresql/data"},
            {"name": "init", "mountPath": "/docker-entrypoint-initdb.d", "readOnly": True},
        ],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata,
        "spec": {
            "serviceName": name,
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(instance_id)},
            "template": {
                "metadata": {"labels": labels(instance_id)},
                "spec": {
                    "securityContext": {
                        "runAsUser": POSTGRES_UID,
                        "runAsGroup": POSTGRES_UID,
                        "fsGroup": POSTGRES_UID,
                        "runAsNonRoot": True,
                    },
                    "terminationGracePeriodSeconds": 30,
                    "containers": [container],
                    "volumes": [
                        {
                            "name": "init",
                            "configMap": {"name": f"{name}-init", "defaultMode": 0o555},
                        }
                    ],
                },
            },
            "volumeClaimTemplates": [
                {
                    "metadata": {"name": "data", "labels": labels(instance_id)},
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": f"{spec.storage_gb}Gi"}},
                    },
                }
            ],
        },
    }


def backup_claim_manifest(
    instance_id: uuid.UUID, namespace: str, spec: InstanceSpec, fence: int
) -> dict[str, Any]:
    """Where the final dump is kept: not labelled with the instance id, so deletion spares it."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": f"{resource_name(instance_id)}-final-backup",
            "namespace": namespace,
            "labels": {MANAGED_BY: FIELD_MANAGER, BACKUP_OF_LABEL: str(instance_id)},
            "annotations": {FENCE_ANNOTATION: str(fence)},
        },
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": f"{spec.storage_gb}Gi"}},
        },
    }


def backup_job_manifest(
    instance_id: uuid.UUID, namespace: str, spec: InstanceSpec, fence: int
) -> dict[str, Any]:
    """A Job that runs pg_dump against the instance's service into the backup claim."""
    name = resource_name(instance_id)
    script = (
        f'pg_dump --format=custom --host={name} --port={PORT} --username="$PGUSER" '
        f'--file=/backup/{instance_id}.dump "$PGDATABASE"'
    )
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(instance_id, namespace, f"{name}-final-backup", fence),
        "spec": {
            "backoffLimit": 3,
            "template": {
                "metadata": {"labels": labels(instance_id)},
                "spec": {
                    "restartPolicy": "OnFailure",
                    "securityContext": {
                        "runAsUser": POSTGRES_UID,
                        "runAsGroup": POSTGRES_UID,
                        "fsGroup": POSTGRES_UID,
                        "runAsNonRoot": True,
                    },
                    "containers": [
                        {
                            "name": "pg-dump",
                            "image": DEFAULT_IMAGE.format(version=spec.version or DEFAULT_VERSION),
                            "command": ["sh", "-c", script],
                            "env": [
                                {"name": "PGUSER", "value": ADMIN_USER},
                                {"name": "PGDATABASE", "value": DBNAME},
                                {
                                    "name": "PGPASSWORD",
                                    "valueFrom": {
                                        "secretKeyRef": {
                                            "name": f"{name}-credentials",
                                            "key": "admin-password",
                                        }
                                    },
                                },
                            ],
                            "volumeMounts": [{"name": "backup", "mountPath": "/backup"}],
                        }
                    ],
                    "volumes": [
                        {"name": "backup", "persistentVolumeClaim": {"claimName": f"{name}-final-backup"}}
                    ],
                },
            },
        },
    }


def all_manifests(
    instance_id: uuid.UUID, namespace: str, spec: InstanceSpec, fence: int
) -> list[dict[str, Any]]:
    """Every manifest the provisioner can apply for one instance (what the schema tests validate)."""
    credentials = Credentials.generate(instance_id)
    return [
        secret_manifest(instance_id, namespace, credentials, fence),
        init_config_manifest(instance_id, namespace, fence),
        service_manifest(instance_id, namespace, fence),
        statefulset_manifest(instance_id, namespace, spec, fence, replicas=1, read_only=False),
        statefulset_manifest(instance_id, namespace, spec, fence, replicas=1, read_only=True),
        backup_claim_manifest(instance_id, namespace, spec, fence),
        backup_job_manifest(instance_id, namespace, spec, fence),
    ]


def translate(exc: BaseException) -> Exception:
    """API errors in the engine's terms: 409, 429, 5xx and timeouts temporary; 400, 403, 422 permanent."""
    if isinstance(exc, kubernetes.client.exceptions.ApiException):
        status = int(exc.status or 0)
        message = f"kubernetes API {status} {exc.reason or ''}".strip()
        if status == 429:
            retry_after = (exc.headers or {}).get("Retry-After")
            delay = float(retry_after) if retry_after and str(retry_after).isdigit() else None
            return TemporaryError(f"{message}: throttled", delay_s=delay)
        if status == 409 or status >= 500 or status == 0:
            return TemporaryError(message)
        if status in (400, 401, 403, 404, 422):
            return PermanentError(message)
        return TemporaryError(message)
    if isinstance(exc, urllib3.exceptions.HTTPError | TimeoutError | ConnectionError):
        return TemporaryError(f"kubernetes API unreachable: {type(exc).__name__}: {exc}")
    return exc if isinstance(exc, Exception) else RuntimeError(str(exc))


# ---- the API edge ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    """One resource kind the provisioner manages, and where its collection lives."""

    kind: str
    api_version: str
    plural: str

    def path(self, namespace: str, name: str | None = None) -> str:
        base = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        path = f"{base}/namespaces/{namespace}/{self.plural}"
        return path if name is None else f"{path}/{name}"


STATEFULSET = Kind("StatefulSet", "apps/v1", "statefulsets")
SERVICE = Kind("Service", "v1", "services")
SECRET = Kind("Secret", "v1", "secrets")
CONFIGMAP = Kind("ConfigMap", "v1", "configmaps")
PVC = Kind("PersistentVolumeClaim", "v1", "persistentvolumeclaims")
JOB = Kind("Job", "batch/v1", "jobs")
KINDS = {k.kind: k for k in (STATEFULSET, SERVICE, SECRET, CONFIGMAP, PVC, JOB)}
# Deleted by label on deprovision, dependants first.
DELETION_ORDER = (JOB, STATEFULSET, SERVICE, CONFIGMAP, SECRET, PVC)


class KubernetesApi:
    """The few calls used, through the official client's ApiClient: apply, get, list, delete."""

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
            query=[("fieldManager", FIELD_MANAGER), ("force", "true")],
            body=dict(manifest),
            content_type=APPLY_CONTENT_TYPE,
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

    def list(self, kind: Kind, namespace: str, selector: Mapping[str, str]) -> list[dict[str, Any]]:
        label_selector = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        result = self._call("GET", kind.path(namespace), query=[("labelSelector", label_selector)])
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


class KubernetesProvisioner(Provisioner):
    """Instances as StatefulSets in one namespace; every step is a declarative, fenced apply."""

    name = "kubernetes"

    def __init__(
        self,
        api: KubernetesApi,
        namespace: str,
        *,
        ready_wait_s: float = 120,
        backup_wait_s: float = 600,
        poll_s: float = 2,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.ready_wait_s = ready_wait_s
        self.backup_wait_s = backup_wait_s
        self.poll_s = poll_s

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
        return cls(
            KubernetesApi(kubernetes.client.ApiClient(configuration)),
            settings.provisioner.kubernetes_namespace,
        )

    async def _run(self, work: Callable[[], T]) -> T:
        try:
            return await asyncio.to_thread(work)
        except (TemporaryError, PermanentError, StaleFence):
            raise
        except Exception as exc:
            raise translate(exc) from exc

    # ---- fenced apply of the StatefulSet: every step goes through it -------------------------------

    def _fenced_statefulset(
        self,
        instance_id: uuid.UUID,
        spec: InstanceSpec,
        fence: int,
        *,
        replicas: int | None = None,
        read_only: bool | None = None,
    ) -> dict[str, Any]:
        """Read the StatefulSet, admit the fence against its annotation, apply over that version.

        The apply carries the resourceVersion that was read, so a worker with a lower fence that
        raced in between gets a 409 instead of overwriting: the fence is enforced by the API server.
        """
        name = resource_name(instance_id)
        current = self.api.get(STATEFULSET, self.namespace, name)
        annotations = (current or {}).get("metadata", {}).get("annotations") or {}
        seen = annotations.get(FENCE_ANNOTATION)
        fencing.admit(f"statefulset/{name}", int(seen) if seen else None, fence)
        if current is not None:
            replicas = replicas if replicas is not None else int(current["spec"].get("replicas", 0))
            if read_only is None:
                read_only = annotations.get(READ_ONLY_ANNOTATION) == "true"
        manifest = statefulset_manifest(
            instance_id,
            self.namespace,
            spec,
            fence,
            replicas=replicas or 0,
            read_only=bool(read_only),
            resource_version=None if current is None else current["metadata"].get("resourceVersion"),
        )
        return self.api.apply(manifest)

    def _credentials(self, instance_id: uuid.UUID, password: str | None) -> Credentials:
        """Adopt the credentials of an existing Secret; generate them the first time."""
        existing = self.api.get(SECRET, self.namespace, f"{resource_name(instance_id)}-credentials")
        if existing is None:
            return Credentials.generate(instance_id, password)
        data = {k: base64.b64decode(v).decode() for k, v in (existing.get("data") or {}).items()}
        return Credentials(
            data.get("username", owner_user(instance_id)),
            password or data.get("password") or secrets.token_urlsafe(24),
            data.get("admin-password") or secrets.token_urlsafe(32),
        )

    def _wait_ready(self, instance_id: uuid.UUID) -> dict[str, Any]:
        deadline = time.monotonic() + self.ready_wait_s
        while True:
            current = self.api.get(STATEFULSET, self.namespace, resource_name(instance_id))
            if current is not None and _rolled_out(current):
                return current
            if time.monotonic() >= deadline:
                raise TemporaryError(f"statefulset of {instance_id} not ready yet", delay_s=10)
            time.sleep(self.poll_s)

    # ---- steps ---------------------------------------------------------------------------------------

    async def allocate_storage(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> None:
        def work() -> None:
            self._fenced_statefulset(instance_id, spec, fence)
            credentials = self._credentials(instance_id, None)
            self.api.apply(secret_manifest(instance_id, self.namespace, credentials, fence))
            self.api.apply(init_config_manifest(instance_id, self.namespace, fence))

        await self._run(work)

    async def configure_network(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> None:
        def work() -> None:
            self._fenced_statefulset(instance_id, spec, fence)
            self.api.apply(service_manifest(instance_id, self.namespace, fence))

        await self._run(work)

    async def initialize_database(
        self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, *, password: str | None = None
    ) -> ConnectionInfo:
        def work() -> ConnectionInfo:
            credentials = self._credentials(instance_id, password)
            self._fenced_statefulset(instance_id, spec, fence, replicas=1)
            self.api.apply(secret_manifest(instance_id, self.namespace, credentials, fence))
            self._wait_ready(instance_id)
            host = f"{resource_name(instance_id)}.{self.namespace}.svc.cluster.local"
            return ConnectionInfo(host, PORT, DBNAME, credentials.user, credentials.password)

        return await self._run(work)

    async def apply_plan(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> bool:
        def work() -> bool:
            before = self.api.get(STATEFULSET, self.namespace, resource_name(instance_id))
            after = self._fenced_statefulset(instance_id, spec, fence)
            self._wait_ready(instance_id)
            return bool(_template(before) != _template(after))

        return await self._run(work)

    async def suspend(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> bool:
        return await self._set_read_only(instance_id, spec, fence, True)

    async def resume(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> bool:
        return await self._set_read_only(instance_id, spec, fence, False)

    async def _set_read_only(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, on: bool) -> bool:
        def work() -> bool:
            before = self.api.get(STATEFULSET, self.namespace, resource_name(instance_id))
            if before is None:
                raise TemporaryError(f"instance {instance_id} has no statefulset")
            was = (before["metadata"].get("annotations") or {}).get(READ_ONLY_ANNOTATION) == "true"
            self._fenced_statefulset(instance_id, spec, fence, read_only=on)
            self._wait_ready(instance_id)
            return was != on

        return await self._run(work)

    async def deprovision(
        self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, *, skip_backup: bool = False
    ) -> DeprovisionResult:
        def work() -> DeprovisionResult:
            name = resource_name(instance_id)
            current = self.api.get(STATEFULSET, self.namespace, name)
            backup: str | None = None
            if current is not None:
                self._fenced_statefulset(instance_id, spec, fence)
                if not skip_backup:
                    backup = self._final_backup(instance_id, spec, fence)
            removed = False
            for kind in DELETION_ORDER:
                for item in self.api.list(kind, self.namespace, {INSTANCE_LABEL: str(instance_id)}):
                    removed = self.api.delete(kind, self.namespace, item["metadata"]["name"]) or removed
            return DeprovisionResult(backup=backup, removed=removed or current is not None)

        return await self._run(work)

    def _final_backup(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> str:
        claim = backup_claim_manifest(instance_id, self.namespace, spec, fence)
        self.api.apply(claim)
        self.api.apply(backup_job_manifest(instance_id, self.namespace, spec, fence))
        deadline = time.monotonic() + self.backup_wait_s
        job_name = f"{resource_name(instance_id)}-final-backup"
        while True:
            job = self.api.get(JOB, self.namespace, job_name) or {}
            status = job.get("status") or {}
            if int(status.get("succeeded") or 0) >= 1:
                return f"pvc/{claim['metadata']['name']}/{instance_id}.dump"
            if int(status.get("failed") or 0) > 3:
                raise TemporaryError(f"final backup job {job_name} failed")
            if time.monotonic() >= deadline:
                raise TemporaryError(f"final backup job {job_name} still running", delay_s=30)
            time.sleep(self.poll_s)

    # ---- reading -------------------------------------------------------------------------------------

    async def observe(self, instance_id: uuid.UUID) -> Observation:
        def work() -> Observation:
            current = self.api.get(STATEFULSET, self.namespace, resource_name(instance_id))
            if current is None:
                return Observation(False, detail="statefulset missing")
            annotations = current["metadata"].get("annotations") or {}
            status = current.get("status") or {}
            ready = int(status.get("readyReplicas") or 0)
            wanted = int(current["spec"].get("replicas") or 0)
            generation = annotations.get(GENERATION_ANNOTATION)
            return Observation(
                True,
                running=int(status.get("replicas") or 0) > 0,
                healthy=wanted > 0 and _rolled_out(current),
                read_only=annotations.get(READ_ONLY_ANNOTATION) == "true",
                endpoint=(f"{resource_name(instance_id)}.{self.namespace}.svc.cluster.local", PORT),
                plan_applied=annotations.get(PLAN_ANNOTATION),
                generation=int(generation) if generation else None,
                detail=f"{ready}/{wanted} ready",
            )

        return await self._run(work)

    async def inventory(self) -> list[Resource]:
        def work() -> list[Resource]:
            found: list[Resource] = []
            for kind in DELETION_ORDER:
                for item in self.api.list(kind, self.namespace, {MANAGED_BY: FIELD_MANAGER}):
                    meta = item["metadata"]
                    owner = (meta.get("labels") or {}).get(INSTANCE_LABEL)
                    found.append(Resource(kind.kind, meta["name"], _as_uuid(owner)))
            return found

        return await self._run(work)

    async def close(self) -> None:
        await asyncio.to_thread(self.api.client.close)


def _rolled_out(statefulset: Mapping[str, Any]) -> bool:
    """Every wanted replica ready on the latest revision, as the controller reports it."""
    spec, status = statefulset.get("spec") or {}, statefulset.get("status") or {}
    wanted = int(spec.get("replicas") or 0)
    meta_generation = int((statefulset.get("metadata") or {}).get("generation") or 0)
    return (
        int(status.get("observedGeneration") or 0) >= meta_generation
        and int(status.get("readyReplicas") or 0) >= wanted
        and int(status.get("updatedReplicas") or 0) >= wanted
        and status.get("currentRevision") == status.get("updateRevision")
    )


def _template(statefulset: Mapping[str, Any] | None) -> Any:
    return None if statefulset is None else statefulset.get("spec", {}).get("template")


def _as_uuid(text: str | None) -> uuid.UUID | None:
    try:
        return None if text is None else uuid.UUID(text)
    except ValueError:
        return None
