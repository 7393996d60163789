"""An in-process Kubernetes API for tests: apply, get, list by label, delete, 404, 409, a fake controller."""

from __future__ import annotations

import itertools
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml

PATH = re.compile(
    r"^/(?:api/v1|apis/(?P<group>[a-z.]+)/(?P<version>v[0-9a-z]+))"
    r"/namespaces/(?P<ns>[a-z0-9-]+)/(?P<plural>[a-z]+)(?:/(?P<name>[a-z0-9.-]+))?$"
)


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    content_type: str | None


@dataclass
class FakeCluster:
    """What the fake API server stores, and the knobs a test turns."""

    objects: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    # Status codes to answer the next matching requests with: (method, status), consumed in order.
    fail_next: list[tuple[str, int]] = field(default_factory=list)
    # The fake controller: StatefulSets become ready and Jobs succeed as soon as they are applied.
    controller_ready: bool = True
    lock: threading.Lock = field(default_factory=threading.Lock)
    versions: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def of_kind(self, plural: str) -> list[dict[str, Any]]:
        return [obj for (p, _, _), obj in sorted(self.objects.items()) if p == plural]

    def simulate_controller(self, plural: str, obj: dict[str, Any]) -> None:
        if plural == "statefulsets":
            replicas = int(obj["spec"].get("replicas") or 0)
            ready = replicas if self.controller_ready else 0
            revision = f"{obj['metadata']['name']}-{obj['metadata']['generation']}"
            obj["status"] = {
                "observedGeneration": obj["metadata"]["generation"],
                "replicas": replicas,
                "readyReplicas": ready,
                "updatedReplicas": ready,
                "currentRevision": revision if self.controller_ready else "old",
                "updateRevision": revision,
            }
        elif plural == "jobs":
            obj["status"] = {"succeeded": 1} if self.controller_ready else {"active": 1}


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

        def _route(self) -> tuple[re.Match[str], dict[str, list[str]]] | None:
            parts = urlsplit(self.path)
            query = parse_qs(parts.query)
            cluster.requests.append(
                Request(self.command, parts.path, query, self.headers.get("Content-Type"))
            )
            for index, (method, status) in enumerate(cluster.fail_next):
                if method == self.command:
                    del cluster.fail_next[index]
                    self._reply(status, _status(status, "Injected", f"injected {status}"))
                    return None
            match = PATH.match(parts.path)
            if match is None:
                self._reply(404, _status(404, "NotFound", f"no route {parts.path}"))
                return None
            return match, query

        def do_GET(self) -> None:
            routed = self._route()
            if routed is None:
                return
            match, query = routed
            plural, ns, name = match["plural"], match["ns"], match["name"]
            with cluster.lock:
                if name is None:
                    selector = (query.get("labelSelector") or [""])[0]
                    items = [
                        o
                        for (p, n, _), o in sorted(cluster.objects.items())
                        if p == plural and n == ns and _matches(o, selector)
                    ]
                    self._reply(200, {"kind": "List", "apiVersion": "v1", "items": items})
                    return
                obj = cluster.objects.get((plural, ns, name))
            if obj is None:
                self._reply(404, _status(404, "NotFound", f"{plural} {name!r} not found"))
            else:
                self._reply(200, obj)

        def do_PATCH(self) -> None:
            routed = self._route()
            if routed is None:
                return
            match, query = routed
            plural, ns, name = match["plural"], match["ns"], match["name"]
            if self.headers.get("Content-Type") != "application/apply-patch+yaml":
                self._reply(415, _status(415, "UnsupportedMediaType", "only server-side apply here"))
                return
            if not query.get("fieldManager"):
                self._reply(400, _status(400, "BadRequest", "fieldManager is required for apply"))
                return
            body = self._body()
            meta = body.get("metadata") or {}
            if meta.get("name") != name or meta.get("namespace", ns) != ns:
                self._reply(400, _status(400, "BadRequest", "name or namespace does not match the path"))
                return
            with cluster.lock:
                current = cluster.objects.get((plural, ns, name))
                wanted_version = meta.get("resourceVersion")
                if wanted_version is not None and (
                    current is None or current["metadata"]["resourceVersion"] != wanted_version
                ):
                    self._reply(409, _status(409, "Conflict", "the object has been modified"))
                    return
                obj = dict(body)
                obj["metadata"] = {
                    **meta,
                    "namespace": ns,
                    "uid": (current or {}).get("metadata", {}).get("uid") or f"uid-{next(cluster.versions)}",
                    "resourceVersion": str(next(cluster.versions)),
                }
                old_generation = int((current or {}).get("metadata", {}).get("generation") or 0)
                changed = current is None or current.get("spec") != body.get("spec")
                obj["metadata"]["generation"] = old_generation + 1 if changed else old_generation
                if current is not None and "status" in current:
                    obj["status"] = current["status"]
                cluster.simulate_controller(plural, obj)
                cluster.objects[(plural, ns, name)] = obj
            self._reply(201 if current is None else 200, obj)

        def do_DELETE(self) -> None:
            routed = self._route()
            if routed is None:
                return
            match, _ = routed
            self._body()
            with cluster.lock:
                obj = cluster.objects.pop((match["plural"], match["ns"], match["name"] or ""), None)
            if obj is None:
                self._reply(404, _status(404, "NotFound", "not found"))
            else:
                self._reply(200, _status(200, "Success", "deleted") | {"status": "Success"})

    return Handler


@contextmanager
def fake_api() -> Iterator[tuple[str, FakeCluster]]:
    """A running fake API server: its base URL and its state."""
    cluster = FakeCluster()
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(cluster))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", cluster
    finally:
        server.shutdown()
        server.server_close()
