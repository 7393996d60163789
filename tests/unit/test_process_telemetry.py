"""What a serving process sets up for its own telemetry: JSON log lines without terminal escape
codes, no `_created` series, tracing off unless an endpoint is configured."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import prometheus_client
import pytest
import uvicorn
from prometheus_client import CollectorRegistry, Counter, generate_latest

from controlplane.db.job_rows import NewJob
from controlplane.runtime import logs, metrics, tracing
from controlplane.runtime.settings import Settings


@pytest.fixture
def json_lines() -> Iterator[io.StringIO]:
    """What uvicorn's loggers write, through the control plane's JSON formatter."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.JsonFormatter())
    logger = logging.getLogger("uvicorn.error")
    before = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield out
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before)


def test_uvicorn_lines_in_json_carry_no_terminal_escape_codes(json_lines: io.StringIO) -> None:
    # uvicorn logs where it listens with a coloured copy of the message in `color_message`.
    config = uvicorn.Config(app="none:app", host="127.0.0.1", port=0, log_config=None)  # as run_api
    config.bind_socket().close()
    lines = [json.loads(line) for line in json_lines.getvalue().splitlines()]
    assert any(line["msg"].startswith("Uvicorn running on") for line in lines), lines
    assert all("color_message" not in line for line in lines)
    assert "\x1b" not in json_lines.getvalue() and "\\u001b" not in json_lines.getvalue()


def test_created_series_are_off_once_the_process_starts() -> None:
    registry = CollectorRegistry()
    Counter("cp_probe", "A counter of this test.", registry=registry).inc()
    # Importing the metrics changes nothing: only a process's start does.
    assert b"cp_probe_created" in generate_latest(registry)
    try:
        metrics.configure_process()
        assert b"cp_probe_created" not in generate_latest(registry)
        assert b"cp_probe_total 1.0" in generate_latest(registry)
    finally:
        prometheus_client.enable_created_metrics()  # type: ignore[no-untyped-call]


def test_tracing_is_off_without_an_endpoint() -> None:
    assert tracing.configure(Settings(), "controlplane-test") is None
    assert not tracing.enabled() and not tracing.active()
    with tracing.span("nothing") as span:
        assert span is None
        assert tracing.carrier() == {}
    assert tracing.parent_of({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) is None


def test_the_otlp_endpoint_is_the_collectors_traces_url() -> None:
    assert tracing.traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert tracing.traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert tracing.traces_url("https://c.example/v1/traces") == "https://c.example/v1/traces"
    provider = tracing.configure(Settings(otlp_endpoint="http://127.0.0.1:9/"), "controlplane-test")
    try:
        assert provider is not None and tracing.enabled()
        assert provider.resource.attributes["service.name"] == "controlplane-test"
    finally:
        tracing.install(None)
        if provider is not None:
            provider.shutdown()


def test_a_job_enqueued_inside_a_span_carries_its_trace_context() -> None:
    from opentelemetry.sdk.trace import TracerProvider

    job = NewJob("report_usage", payload={"period": "p"})
    assert json.loads(job.payload_json()) == {"period": "p"}  # tracing off: nothing added
    provider = TracerProvider()
    tracing.install(provider)
    try:
        assert json.loads(job.payload_json()) == {"period": "p"}  # no span current: nothing either
        with tracing.span("request") as span:
            assert span is not None
            payload = json.loads(job.payload_json())
            assert payload["period"] == "p"
            context = span.get_span_context()
            assert payload["traceparent"].startswith(f"00-{context.trace_id:032x}-{context.span_id:016x}-")
            parent = tracing.parent_of(payload)
        with tracing.span("job", parent=parent) as job_span:
            assert job_span is not None
            assert job_span.get_span_context().trace_id == context.trace_id
    finally:
        tracing.install(None)
        provider.shutdown()
