"""The health endpoints of the worker and the reconciler: what their own loops report, over HTTP."""

from __future__ import annotations

import httpx
import pytest

from controlplane.cli.process_roles import serve_health_and_metrics
from controlplane.runtime.liveness import Liveness
from controlplane.runtime.postgres import free_port

pytestmark = pytest.mark.unit


def test_live_while_the_loop_turns_ready_while_the_database_answers() -> None:
    loop = Liveness("worker", stale_after_s=60)
    assert not loop.live(now=0).ok and not loop.ready(now=0).ok  # not started
    loop.turned(now=100)
    assert loop.live(now=150).ok and not loop.ready(now=150).ok  # no round trip yet
    loop.reached(True)
    assert loop.ready(now=150).ok
    loop.reached(False)
    assert loop.live(now=150).ok and loop.ready(now=150).detail.endswith("database failed")
    loop.reached(True)
    hung = loop.live(now=161 + 60)
    assert not hung.ok and "last turned 121 s ago" in hung.detail and not loop.ready(now=221).ok


def test_the_metrics_port_serves_health_readiness_and_metrics() -> None:
    loop, port = Liveness("reconciler", stale_after_s=60), free_port()
    serve_health_and_metrics(port, "127.0.0.1", loop)
    base = f"http://127.0.0.1:{port}"
    assert httpx.get(f"{base}/healthz", timeout=5).status_code == 503
    loop.turned()
    assert httpx.get(f"{base}/healthz", timeout=5).status_code == 200
    assert httpx.get(f"{base}/readyz", timeout=5).status_code == 503
    loop.reached(True)
    ready = httpx.get(f"{base}/readyz", timeout=5)
    assert ready.status_code == 200 and ready.text.startswith("reconciler: its loop turned")
    metrics = httpx.get(f"{base}/metrics", timeout=5)
    assert metrics.status_code == 200 and "controlplane_" in metrics.text


def test_the_image_healthcheck_asks_the_roles_own_health_endpoint() -> None:
    from controlplane.runtime import healthcheck

    assert healthcheck.health_url({}) == "http://127.0.0.1:8700/healthz"  # serve
    assert healthcheck.health_url({"CONTROLPLANE_API_PORT": "9000"}).endswith(":9000/healthz")
    loop, port = Liveness("worker", stale_after_s=60), free_port()
    environ = {"CONTROLPLANE_API_PORT": "1", "CONTROLPLANE_METRICS_PORT": str(port)}  # worker, reconcile
    assert healthcheck.main(environ) == 1  # nothing listens yet
    serve_health_and_metrics(port, "127.0.0.1", loop)
    assert healthcheck.main(environ) == 1  # its loop has not turned
    loop.turned()
    assert healthcheck.main(environ) == 0
