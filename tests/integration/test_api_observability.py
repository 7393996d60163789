"""The API's own telemetry: the request histogram on /metrics, one access-log line per request
(without a key or a password), the queue and billing gauges of the leader's pass."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from controlplane.db import connection as db
from controlplane.db.connection import AsyncConn
from controlplane.db.job_rows import NewJob, enqueue
from controlplane.runtime.logs import JsonFormatter
from reconciler.maintenance import Gauges
from tests.api_support import Tenant
from tests.console_support import sign_in
from tests.factories import TEST_ACTOR

pytest_plugins = ("tests.api_fixtures",)

HISTOGRAM = "http_server_request_duration_seconds"


def requests_counted(metrics_text: str, **labels: str) -> float:
    """The request count (the histogram's `_count`) of the series with `labels`, from /metrics."""
    for family in text_string_to_metric_families(metrics_text):
        if family.name == HISTOGRAM:
            for sample in family.samples:
                if sample.name == HISTOGRAM + "_count" and sample.labels == labels:
                    return sample.value
    return 0.0


async def test_metrics_has_the_request_histogram_after_a_request(
    client: httpx.AsyncClient, tenant: Tenant
) -> None:
    created = await client.post("/v1/instances", json={"name": "h1", "plan": "dev"}, headers=tenant.headers)
    assert created.status_code == 202
    labels = {"method": "POST", "route": "/v1/instances", "status_class": "2xx"}
    before = requests_counted((await client.get("/metrics")).text, **labels)
    assert before >= 1
    iid = created.json()["id"]
    await client.get(f"/v1/instances/{iid}", headers=tenant.headers)
    await client.post("/v1/instances", json={"name": "h2", "plan": "dev"}, headers=tenant.headers)
    text = (await client.get("/metrics")).text
    assert requests_counted(text, **labels) == before + 1
    # The route is the template, never the path with an instance's id in it.
    routed = {"method": "GET", "route": "/v1/instances/{instance_id}", "status_class": "2xx"}
    assert requests_counted(text, **routed) >= 1
    assert iid not in text
    family = next(f for f in text_string_to_metric_families(text) if f.name == HISTOGRAM)
    assert family.type == "histogram"
    assert {"le", "method", "route", "status_class"} >= set(family.samples[0].labels)


@pytest.fixture
def access_lines(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.DEBUG):
        yield caplog


def access_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "controlplane.access"]


async def test_each_request_writes_one_access_line_without_secrets(
    client: httpx.AsyncClient, tenant: Tenant, access_lines: pytest.LogCaptureFixture
) -> None:
    """A create, a 404, a 409 and a 401 (the four that wrote nothing before): one INFO line each,
    with method, route, status, duration, request id and organisation; no key anywhere in the log."""
    missing = uuid.uuid4()
    new = {"name": "logged", "plan": "dev"}
    asked: list[tuple[str, str, dict[str, str] | None, dict[str, str]]] = [
        ("POST", "/v1/instances", new, tenant.headers),
        ("GET", f"/v1/instances/{missing}", None, tenant.headers),
        ("POST", "/v1/instances", new, tenant.headers),
        ("GET", "/v1/instances", None, {"Authorization": "Bearer cpk_not_a_key_of_anyone"}),
    ]
    expected = [
        (202, "/v1/instances", True),
        (404, "/v1/instances/{instance_id}", True),
        (409, "/v1/instances", True),
        (401, "/v1/instances", False),
    ]
    for (method, path, body, headers), (status, route, by_org) in zip(asked, expected, strict=True):
        access_lines.clear()
        response = await client.request(method, path, headers=headers, json=body)
        assert response.status_code == status, response.text
        (line,) = access_records(access_lines)
        assert line.levelno == logging.INFO
        assert (line.method, line.route, line.status) == (method, route, status)  # type: ignore[attr-defined]
        assert line.request_id == response.headers["x-request-id"]  # type: ignore[attr-defined]
        assert line.duration_ms >= 0  # type: ignore[attr-defined]
        assert getattr(line, "org_id", None) == (str(tenant.org_id) if by_org else None)
        assert line.getMessage() == f"{method} {route} {status} {line.duration_ms:.1f}ms"  # type: ignore[attr-defined]
    # The console's sign-in carries the key in its body: the log has its line, never the key.
    access_lines.clear()
    assert (await sign_in(client, tenant.key)).status_code == 303
    assert [(r.method, r.route) for r in access_records(access_lines)][-1] == ("POST", "/sign-in")  # type: ignore[attr-defined]
    written = "\n".join(JsonFormatter().format(record) for record in access_lines.records)
    assert "controlplane.access" in written
    # The key's secret part (`cpk_<prefix>_<secret>`; the secret may itself hold an underscore).
    for secret in (tenant.key, "cpk_not_a_key_of_anyone", tenant.key.split("_", 2)[2]):
        assert secret not in written


async def test_probes_and_scrapes_are_logged_at_debug_only(
    client: httpx.AsyncClient, access_lines: pytest.LogCaptureFixture
) -> None:
    for path in ("/healthz", "/metrics"):
        access_lines.clear()
        assert (await client.get(path)).status_code == 200
        (line,) = access_records(access_lines)
        assert line.levelno == logging.DEBUG


def gauge(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


async def test_the_leaders_gauges_show_the_queue_by_kind_and_the_billing_holds(
    fresh_database: str, conn: AsyncConn
) -> None:
    waiting = await enqueue(conn, NewJob("report_usage", payload={"period": "p"}), TEST_ACTOR)
    await enqueue(conn, NewJob("report_usage", payload={"period": "q"}, delay_s=3600), TEST_ACTOR)
    await conn.execute(
        "UPDATE jobs SET run_at = now() - interval '90 seconds' WHERE id = %s", (waiting.job["id"],)
    )
    await conn.execute(
        "INSERT INTO organisations (name, billing_hold) VALUES ('held-1', true), ('held-2', true)"
    )
    await conn.execute("INSERT INTO organisations (name, past_due_since) VALUES ('late', now())")
    async with db.pool(fresh_database, max_size=2) as pool:
        await Gauges(pool, ["deliver_notification", "report_usage"]).run_once()
    assert gauge("controlplane_queue_depth", kind="report_usage") == 2
    assert 90 <= (gauge("controlplane_queue_oldest_age_seconds", kind="report_usage") or 0) < 3600
    assert gauge("controlplane_queue_depth", kind="deliver_notification") == 0
    assert gauge("controlplane_queue_oldest_age_seconds", kind="deliver_notification") == 0
    assert gauge("controlplane_billing_organisations", state="held") == 2
    assert gauge("controlplane_billing_organisations", state="grace") == 1
