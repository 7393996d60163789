"""An in-process Kubernetes API for tests: apply, merge patch, get, list by label, delete, a Role
enforced on every request, CRD schemas and a few admission rules, and a simulated CloudNativePG
operator (Cluster status progression, servers and volumes, failover, switchover through the status
subresource, demotion and promotion tokens, Backups that complete or fail, ScheduledBackups)."""

from __future__ import annotations

import base64
import copy
import itertools
import json
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml

from provisioners import cnpg_schema

PATH = re.compile(
    r"^/(?:api/v1|apis/(?P<group>[a-z0-9.-]+)/(?P<version>v[0-9a-z]+))"
    r"/namespaces/(?P<ns>[a-z0-9-]+)/(?P<plural>[a-z]+)(?:/(?P<name>[a-z0-9.-]+)(?:/(?P<sub>status))?)?$"
)
HEALTHY = "Cluster in healthy state"
SERVICE_ACCOUNT = "system:serviceaccount:controlplane:controlplane"
FAKE_CA = "-----BEGIN CERTIFICATE-----\nZmFrZSBjYSBvZiB7bmFtZX0=\n-----END CERTIFICATE-----\n"

Call = tuple[str, str, str]  # (API group, resource, verb), as RBAC sees a request


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    content_type: str | None


@dataclass
class Role:
    """A namespaced Role's rules: what the fake allows, everything else is 403."""

    namespace: str
    rules: list[dict[str, Any]]

    @classmethod
    def from_manifest(cls, doc: Mapping[str, Any]) -> Role:
        return cls(doc["metadata"]["namespace"], list(doc["rules"]))

    def allows(self, namespace: str, call: Call) -> bool:
        group, resource, verb = call
        return namespace == self.namespace and any(
            group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]
            for rule in self.rules
        )

    def grants(self) -> set[Call]:
        return {
            (group, resource, verb)
            for rule in self.rules
            for group in rule["apiGroups"]
            for resource in rule["resources"]
            for verb in rule["verbs"]
        }


class Rejected(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


@dataclass
class FakeCluster:
    """What the fake API server stores, and the knobs a test turns."""

    objects: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    # Every (group, resource, verb) a request needed, allowed or not.
    calls: set[Call] = field(default_factory=set)
    denied: list[tuple[Call, str]] = field(default_factory=list)
    role: Role | None = None
    # Status codes to answer the next matching requests with: (method, status), consumed in order.
    fail_next: list[tuple[str, int]] = field(default_factory=list)
    # The operator acts on a changed Cluster once it has been read this many times (the first
    # reads after an apply still show the previous state, as on a real cluster).
    settle_reads: int = 3
    operator_running: bool = True
    backup_reads: int = 2
    fail_backups: int = 0
    # What the WAL archiving of every archiving Cluster reports failing (None: it works).
    archive_error: str | None = None
    lock: threading.RLock = field(default_factory=threading.RLock)
    # The fake's clock for the events it records: one second per event, no wall clock.
    ticks: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    versions: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    pending: dict[tuple[str, str, str], int] = field(default_factory=dict)

    # ---- reading the state -------------------------------------------------------------------

    def of_kind(self, plural: str) -> list[dict[str, Any]]:
        return [obj for (p, _, _), obj in sorted(self.objects.items()) if p == plural]

    def get(self, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((plural, namespace, name))

    # ---- operator actions a test provokes ----------------------------------------------------

    def fail_primary(self, namespace: str, name: str) -> None:
        """The primary's server dies: the operator fails over to a standby (when there is one)."""
        with self.lock:
            cluster = self.objects[("clusters", namespace, name)]
            status = cluster.setdefault("status", {})
            primary = status["currentPrimary"]
            pod = self.objects[("pods", namespace, primary)]
            pod["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
            standbys = [p for p in status.get("instanceNames", []) if p != primary]
            status.update(
                phase="Failing over" if standbys else "Waiting for the instances to become active",
                readyInstances=int(status.get("readyInstances", 1)) - 1,
                targetPrimary=standbys[0] if standbys else primary,
                conditions=[{"type": "Ready", "status": "False", "reason": "ClusterIsNotReady"}],
            )
            self._bump(cluster)
            self.pending[("clusters", namespace, name)] = self.settle_reads
            if standbys:
                message = f"Current primary isn't healthy, initiating a failover from {primary}"
                self.record_event(namespace, name, "FailingOver", message)

    def record_event(
        self, namespace: str, cluster: str, reason: str, message: str, kind: str = "Normal"
    ) -> None:
        """An event the operator records on a Cluster (as its Recorder.Eventf does)."""
        tick = next(self.ticks)
        at = f"2026-01-01T{tick // 3600:02d}:{tick // 60 % 60:02d}:{tick % 60:02d}Z"
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{cluster}.{tick:016x}"},
            "involvedObject": {"kind": "Cluster", "name": cluster, "namespace": namespace},
            "reason": reason,
            "message": message,
            "type": kind,
            "count": 1,
            "firstTimestamp": at,
            "lastTimestamp": at,
        }
        self._put("events", namespace, event)

    def fail_over_at_once(self, namespace: str, name: str) -> None:
        """The primary's server dies and the operator is done failing over before anyone looks."""
        self.fail_primary(namespace, name)
        with self.lock:
            key = ("clusters", namespace, name)
            self.pending.pop(key, None)
            self._reconcile_cluster(self.objects[key])

    # ---- the simulated operator --------------------------------------------------------------

    def _bump(self, obj: dict[str, Any]) -> None:
        obj["metadata"]["resourceVersion"] = str(next(self.versions))

    def _put(self, plural: str, namespace: str, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        meta["namespace"] = namespace
        meta.setdefault("uid", f"uid-{next(self.versions)}")
        self._bump(obj)
        self.objects[(plural, namespace, meta["name"])] = obj

    def on_read(self, plural: str, namespace: str, name: str) -> None:
        """The operator progresses as the state is read (no wall clock: tests never sleep)."""
        key = (plural, namespace, name)
        if key not in self.pending or not self.operator_running:
            return
        self.pending[key] -= 1
        obj = self.objects.get(key)
        if obj is None:
            del self.pending[key]
            return
        if self.pending[key] > 0:
            if self.pending[key] < self.settle_reads - 1 and plural == "clusters":
                self._transitional(obj)
            return
        del self.pending[key]
        if plural == "clusters":
            self._reconcile_cluster(obj)
        elif plural == "backups":
            self._finish_backup(obj)

    def _transitional(self, cluster: dict[str, Any]) -> None:
        status = cluster.setdefault("status", {})
        if status.get("phase") in (None, "Setting up primary"):
            phase = "Setting up primary"
        elif status.get("phase") in ("Failing over", "Switchover in progress"):
            return
        else:
            phase = "Upgrading cluster"
        status.update(phase=phase, conditions=[{"type": "Ready", "status": "False"}])
        self._bump(cluster)

    def _reconcile_cluster(self, cluster: dict[str, Any]) -> None:
        meta, spec = cluster["metadata"], cluster["spec"]
        ns, name = meta["namespace"], meta["name"]
        status = cluster.setdefault("status", {})
        wanted = int(spec["instances"])
        names = [f"{name}-{n}" for n in range(1, wanted + 1)]
        primary = status.get("targetPrimary") or status.get("currentPrimary") or names[0]
        if primary not in names:
            names = [primary, *names[:-1]]
        inherited = dict((spec.get("inheritedMetadata") or {}).get("labels") or {})
        for (plural, namespace, pod_name), _ in list(self.objects.items()):
            if plural in ("pods", "persistentvolumeclaims") and namespace == ns:
                labels = self.objects[(plural, namespace, pod_name)]["metadata"].get("labels") or {}
                if labels.get("cnpg.io/cluster") == name and pod_name not in names:
                    del self.objects[(plural, namespace, pod_name)]
        for pod_name in names:
            role = "primary" if pod_name == primary else "replica"
            labels = {
                **inherited,
                "cnpg.io/cluster": name,
                "cnpg.io/podRole": "instance",
                "cnpg.io/instanceName": pod_name,
                "cnpg.io/instanceRole": role,
            }
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": pod_name, "labels": labels},
                "spec": {"containers": [{"name": "postgres", "resources": copy.deepcopy(spec["resources"])}]},
                "status": {"conditions": [{"type": "Ready", "status": "True"}]},
            }
            self._put("pods", ns, pod)
            size = spec["storage"]["size"]
            claim = {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": pod_name, "labels": {**inherited, "cnpg.io/cluster": name}},
                "spec": {"resources": {"requests": {"storage": size}}},
                "status": {"capacity": {"storage": size}},
            }
            self._put("persistentvolumeclaims", ns, claim)
        if ("secrets", ns, f"{name}-ca") not in self.objects:
            ca = base64.b64encode(FAKE_CA.replace("{name}", name).encode()).decode()
            secret = {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": f"{name}-ca", "labels": {**inherited, "cnpg.io/cluster": name}},
                "data": {"ca.crt": ca, "ca.key": base64.b64encode(b"key").decode()},
            }
            self._put("secrets", ns, secret)
        self._replica_role(cluster, status)
        if status.get("phase") == "Failing over" and primary != status.get("currentPrimary"):
            message = f"Failing over from {status.get('currentPrimary')} to {primary}"
            self.record_event(ns, name, "FailoverTarget", message)
        if primary != status.get("currentPrimary"):
            # When the primary was promoted (the fake's clock: a counter, no wall clock).
            status["currentPrimaryTimestamp"] = f"2026-01-01T00:{next(self.versions) % 60:02d}:00Z"
        status.update(
            phase=HEALTHY,
            instances=wanted,
            readyInstances=wanted,
            instanceNames=names,
            currentPrimary=primary,
            targetPrimary=primary,
            conditions=[
                {"type": "Ready", "status": "True", "reason": "ClusterIsReady"},
                *self._archiving(cluster),
            ],
        )
        self._bump(cluster)

    def _archiving(self, cluster: dict[str, Any]) -> list[dict[str, Any]]:
        """The ContinuousArchiving condition of a Cluster whose WAL a plugin archives."""
        if not any(plugin.get("isWALArchiver") for plugin in cluster["spec"].get("plugins") or []):
            return []
        if self.archive_error is None:
            return [{"type": "ContinuousArchiving", "status": "True", "reason": "ContinuousArchivingSuccess"}]
        return [
            {
                "type": "ContinuousArchiving",
                "status": "False",
                "reason": "ContinuousArchivingFailing",
                "message": self.archive_error,
            }
        ]

    def archiving_fails(self, error: str | None) -> None:
        """The operator reports every archiving Cluster's WAL archiving failing (None: working again)."""
        with self.lock:
            self.archive_error = error
            for (plural, _, _), cluster in self.objects.items():
                if plural == "clusters" and cluster.get("status"):
                    kept = [
                        c
                        for c in cluster["status"].get("conditions", [])
                        if c["type"] != "ContinuousArchiving"
                    ]
                    cluster["status"]["conditions"] = [*kept, *self._archiving(cluster)]

    def _replica_role(self, cluster: dict[str, Any], status: dict[str, Any]) -> None:
        """Demotion writes a fresh token; a promotion with that token records it as used."""
        replica = cluster["spec"].get("replica") or {}
        name = cluster["metadata"]["name"]
        token = status.get("demotionToken")
        if replica.get("primary") and replica["primary"] != name:
            if not token or token == status.get("lastPromotionToken"):
                content = {
                    "databaseSystemIdentifier": "7",
                    "latestCheckpointREDOLocation": next(self.versions),
                }
                status["demotionToken"] = base64.b64encode(json.dumps(content).encode()).decode()
        elif replica.get("primary") == name and token and replica.get("promotionToken") == token:
            status["lastPromotionToken"] = token

    def _finish_backup(self, backup: dict[str, Any]) -> None:
        ns = backup["metadata"]["namespace"]
        cluster = self.objects.get(("clusters", ns, backup["spec"]["cluster"]["name"]))
        status = backup.setdefault("status", {})
        healthy = cluster is not None and (cluster.get("status") or {}).get("phase") == HEALTHY
        if self.fail_backups > 0 or not healthy:
            self.fail_backups = max(0, self.fail_backups - 1)
            status.update(phase="failed", error="injected failure" if healthy else "cluster not ready")
        else:
            stamp = f"20260101T{next(self.versions):06d}"
            status.update(
                phase="completed",
                backupId=stamp,
                serverName=backup["spec"]["cluster"]["name"],
                stoppedAt="2026-01-01T00:00:00Z",
                method=backup["spec"].get("method"),
            )
            # The cluster's recoverable window opens at its first backup's end.
            assert cluster is not None
            cluster_status = cluster.setdefault("status", {})
            cluster_status.setdefault("firstRecoverabilityPoint", status["stoppedAt"])
            cluster_status["lastSuccessfulBackup"] = status["stoppedAt"]
        self._bump(backup)

    def after_apply(self, plural: str, obj: dict[str, Any], changed: bool, created: bool) -> None:
        key = (plural, obj["metadata"]["namespace"], obj["metadata"]["name"])
        if plural == "clusters" and changed:
            self.pending[key] = self.settle_reads
        elif plural == "backups" and created:
            obj["status"] = {"phase": "running", "startedAt": "2026-01-01T00:00:00Z"}
            self.pending[key] = self.backup_reads
        elif plural == "scheduledbackups" and created and obj["spec"].get("immediate"):
            backup = {
                "apiVersion": obj["apiVersion"],
                "kind": "Backup",
                "metadata": {
                    "name": f"{obj['metadata']['name']}-{next(self.versions)}",
                    "labels": {
                        "cnpg.io/scheduled-backup": obj["metadata"]["name"],
                        "cnpg.io/cluster": obj["spec"]["cluster"]["name"],
                    },
                },
                "spec": {k: obj["spec"][k] for k in ("cluster", "method", "pluginConfiguration")},
            }
            self._put("backups", key[1], backup)
            self.after_apply("backups", backup, True, True)

    def after_status_patch(self, plural: str, obj: dict[str, Any]) -> None:
        """A switchover asked for (`targetPrimary` set to a standby): the operator acts on it."""
        status = obj.get("status") or {}
        if plural == "clusters" and status.get("targetPrimary") != status.get("currentPrimary"):
            key = (plural, obj["metadata"]["namespace"], obj["metadata"]["name"])
            self.pending[key] = self.settle_reads

    def collect_garbage(self, plural: str, namespace: str, name: str) -> None:
        """What the API server's garbage collector removes with its owner."""
        owned = {"clusters": "cnpg.io/cluster", "scheduledbackups": "cnpg.io/scheduled-backup"}.get(plural)
        if owned is None:
            return
        for key, obj in list(self.objects.items()):
            if key[1] == namespace and (obj["metadata"].get("labels") or {}).get(owned) == name:
                if plural == "clusters" and key[0] == "backups":
                    continue  # Backups outlive their cluster
                del self.objects[key]

    # ---- admission ---------------------------------------------------------------------------

    def admit(self, plural: str, current: dict[str, Any] | None, body: dict[str, Any]) -> None:
        """The CRD's schema (a PodMonitor's: its fields'), then the few rules of the operator's
        webhook the provisioner meets."""
        if cnpg_schema.is_custom(body):
            try:
                cnpg_schema.validate(body)
            except cnpg_schema.ManifestError as exc:
                raise Rejected(422, "Invalid", str(exc)) from None
        if plural == "clusters":
            admit_cluster(current, body)


def admit_cluster(current: Mapping[str, Any] | None, body: Mapping[str, Any]) -> None:
    """Rules of CloudNativePG's validating webhook for Clusters (a subset, from its source)."""
    name, spec = body["metadata"]["name"], body["spec"]
    if len(name) > 50 or not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name):
        raise Rejected(422, "Invalid", "cluster name must be a DNS-1035 label of at most 50 characters")
    if current is not None:
        old = cnpg_gib(current["spec"]["storage"]["size"])
        if cnpg_gib(spec["storage"]["size"]) < old:
            raise Rejected(422, "Invalid", f"can't shrink existing storage from {old}Gi")
    replica = spec.get("replica")
    if replica:
        external = {c["name"] for c in spec.get("externalClusters") or []}
        if "enabled" in replica and "primary" in replica:
            raise Rejected(422, "Invalid", "replica mode enabled is not compatible with the primary field")
        for key in ("source", "primary"):
            if key in replica and replica[key] not in external:
                raise Rejected(422, "Invalid", f"External cluster {replica[key]} not found")
        if replica.get("promotionToken") and replica.get("primary") != name:
            raise Rejected(422, "Invalid", "promotionToken is only allowed for primary clusters")
    recovery = (spec.get("bootstrap") or {}).get("recovery")
    if recovery and recovery.get("source") not in {c["name"] for c in spec.get("externalClusters") or []}:
        raise Rejected(422, "Invalid", f"External cluster {recovery.get('source')} not found")


def cnpg_gib(size: str) -> int:
    match = re.fullmatch(r"(\d+)Gi", size)
    assert match, size
    return int(match[1])


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }


def _matches(obj: dict[str, Any], selector: str) -> bool:
    labels = obj["metadata"].get("labels") or {}
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


def _fields_match(obj: dict[str, Any], selector: str) -> bool:
    """A field selector's equality terms (`involvedObject.name=pg-…`), each a dotted path."""
    for term in filter(None, selector.split(",")):
        path, _, value = term.partition("=")
        found: Any = obj
        for part in path.split("."):
            found = found.get(part) if isinstance(found, dict) else None
        if found != value:
            return False
    return True


def _merge(target: dict[str, Any], patch: Mapping[str, Any]) -> None:
    """JSON merge patch (RFC 7386)."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


def make_handler(cluster: FakeCluster) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            return

        def _reply(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> Any:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            return yaml.safe_load(raw) if raw else None

        def _authorize(self, match: re.Match[str], verb: str) -> None:
            resource = match["plural"] + (f"/{match['sub']}" if match["sub"] else "")
            call = (match["group"] or "", resource, verb)
            cluster.calls.add(call)
            if cluster.role is not None and not cluster.role.allows(match["ns"], call):
                cluster.denied.append((call, self.path))
                group = f' in API group "{call[0]}"' if call[0] else ""
                raise Rejected(
                    403,
                    "Forbidden",
                    f'{call[1]} is forbidden: User "{SERVICE_ACCOUNT}" cannot {verb} resource '
                    f'"{call[1]}"{group} in the namespace "{match["ns"]}"',
                )

        def _handle(
            self, work: Callable[[re.Match[str], dict[str, list[str]]], tuple[int, dict[str, Any]]]
        ) -> None:
            parts = urlsplit(self.path)
            query = parse_qs(parts.query)
            cluster.requests.append(
                Request(self.command, parts.path, query, self.headers.get("Content-Type"))
            )
            for index, (method, status) in enumerate(cluster.fail_next):
                if method == self.command:
                    del cluster.fail_next[index]
                    self._reply(status, _status(status, "Injected", f"injected {status}"))
                    return
            match = PATH.match(parts.path)
            if match is None:
                self._reply(404, _status(404, "NotFound", f"no route {parts.path}"))
                return
            try:
                with cluster.lock:
                    code, body = work(match, query)
            except Rejected as exc:
                self._reply(exc.code, _status(exc.code, exc.reason, exc.message))
                return
            self._reply(code, body)

        def do_GET(self) -> None:
            self._handle(self._get)

        def _get(self, match: re.Match[str], query: dict[str, list[str]]) -> tuple[int, dict[str, Any]]:
            plural, ns, name = match["plural"], match["ns"], match["name"]
            self._authorize(match, "get" if name else "list")
            if name is None:
                selector = (query.get("labelSelector") or [""])[0]
                fields = (query.get("fieldSelector") or [""])[0]
                items = [
                    o
                    for (p, n, _), o in sorted(cluster.objects.items())
                    if p == plural and n == ns and _matches(o, selector) and _fields_match(o, fields)
                ]
                return 200, {"kind": "List", "apiVersion": "v1", "items": items}
            cluster.on_read(plural, ns, name)
            obj = cluster.objects.get((plural, ns, name))
            if obj is None:
                raise Rejected(404, "NotFound", f'{plural} "{name}" not found')
            return 200, obj

        def do_PATCH(self) -> None:
            body = self._body()
            self._handle(lambda match, query: self._patch(match, query, body))

        def _patch(
            self, match: re.Match[str], query: dict[str, list[str]], body: Any
        ) -> tuple[int, dict[str, Any]]:
            plural, ns, name = match["plural"], match["ns"], match["name"]
            current = cluster.objects.get((plural, ns, name))
            self._authorize(match, "patch")
            content_type = self.headers.get("Content-Type")
            meta = (body or {}).get("metadata") or {}
            wanted_version = meta.get("resourceVersion")
            if wanted_version is not None and (
                current is None or current["metadata"]["resourceVersion"] != wanted_version
            ):
                raise Rejected(
                    409,
                    "Conflict",
                    "the object has been modified; please apply your changes to the latest version",
                )
            if content_type == "application/merge-patch+json":
                if current is None:
                    raise Rejected(404, "NotFound", f'{plural} "{name}" not found')
                meta.pop("resourceVersion", None)
                if match["sub"] == "status":  # the status subresource: nothing else changes
                    _merge(current.setdefault("status", {}), body.get("status") or {})
                    cluster._bump(current)
                    cluster.after_status_patch(plural, current)
                    return 200, current
                _merge(current, body)
                cluster._bump(current)
                return 200, current
            if content_type != "application/apply-patch+yaml":
                raise Rejected(415, "UnsupportedMediaType", f"unsupported patch type {content_type}")
            if not query.get("fieldManager"):
                raise Rejected(400, "BadRequest", "fieldManager is required for apply")
            if meta.get("name") != name or meta.get("namespace", ns) != ns:
                raise Rejected(400, "BadRequest", "name or namespace does not match the path")
            if current is None:
                self._authorize(match, "create")  # an apply that creates is authorized as create too
            cluster.admit(plural, current, body)
            obj = copy.deepcopy(body)
            obj["metadata"] = {**meta, "namespace": ns}
            obj["metadata"].pop("resourceVersion", None)
            obj["metadata"]["uid"] = (current or {}).get("metadata", {}).get(
                "uid"
            ) or f"uid-{next(cluster.versions)}"
            old_generation = int((current or {}).get("metadata", {}).get("generation") or 0)
            changed = current is None or current.get("spec") != body.get("spec")
            obj["metadata"]["generation"] = old_generation + 1 if changed else old_generation
            if current is not None and "status" in current:
                obj["status"] = current["status"]
            cluster._put(plural, ns, obj)
            cluster.after_apply(plural, obj, changed, current is None)
            return (201 if current is None else 200), obj

        def do_DELETE(self) -> None:
            self._body()
            self._handle(self._delete)

        def _delete(self, match: re.Match[str], _: dict[str, list[str]]) -> tuple[int, dict[str, Any]]:
            plural, ns, name = match["plural"], match["ns"], match["name"] or ""
            self._authorize(match, "delete")
            obj = cluster.objects.pop((plural, ns, name), None)
            if obj is None:
                raise Rejected(404, "NotFound", f'{plural} "{name}" not found')
            cluster.pending.pop((plural, ns, name), None)
            cluster.collect_garbage(plural, ns, name)
            return 200, _status(200, "Success", "deleted") | {"status": "Success"}

    return Handler


@contextmanager
def fake_api(role: Role | None = None) -> Iterator[tuple[str, FakeCluster]]:
    """A running fake API server (enforcing `role` when given): its base URL and its state."""
    cluster = FakeCluster(role=role)
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(cluster))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", cluster
    finally:
        server.shutdown()
        server.server_close()
