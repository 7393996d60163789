"""Tracing: a create's trace runs from its request through its worker's job to each step, each
provisioner call and the SQL statements inside them, exported to an in-memory exporter."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from controlplane.db.connection import AsyncConn
from controlplane.runtime import tracing
from controlplane.runtime.settings import Settings
from provisioners.noop import NoopProvisioner
from tests.api_support import create, make_tenant, serving
from tests.operations_support import instance_in, registry_for, run_until, scalar


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    """Tracing on for the test, every span finished kept in memory; off again after it."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    try:
        yield exporter
    finally:
        tracing.install(None)
        provider.shutdown()


def chain(span: ReadableSpan, spans: dict[int, ReadableSpan]) -> list[str]:
    """The names from `span` up to its trace's root."""
    names = [span.name]
    while span.parent is not None:
        span = spans[span.parent.span_id]
        names.append(span.name)
    return names


async def test_a_creates_trace_continues_through_its_worker_and_its_steps(
    settings: Settings, conn: AsyncConn, exported: InMemorySpanExporter
) -> None:
    tenant = await make_tenant(conn)
    async with serving(settings) as client:
        iid = uuid.UUID((await create(client, tenant, "traced"))["id"])
    # The job carries the request's trace context in its payload.
    traceparent = await scalar(
        conn, "SELECT payload->>'traceparent' FROM jobs WHERE instance_id = %s AND kind = 'provision'", (iid,)
    )
    await run_until(settings, registry_for(NoopProvisioner()), instance_in(iid, "ready"))

    finished = exported.get_finished_spans()
    spans = {s.context.span_id: s for s in finished}
    (request,) = [s for s in finished if s.name == "POST /v1/instances"]
    assert request.parent is None and request.kind is SpanKind.SERVER
    assert request.attributes is not None and request.attributes["http.response.status_code"] == 202
    assert request.attributes["http.route"] == "/v1/instances"
    assert request.attributes["controlplane.org_id"] == str(tenant.org_id)
    trace_id = request.context.trace_id
    assert traceparent.startswith(f"00-{trace_id:032x}-")

    (step,) = [s for s in finished if s.name == "step initialize_database"]
    assert chain(step, spans) == ["step initialize_database", "job provision", "POST /v1/instances"]
    job = spans[step.parent.span_id] if step.parent else None
    assert job is not None and job.kind is SpanKind.CONSUMER
    assert job.attributes is not None and job.attributes["controlplane.instance.id"] == str(iid)
    # Every step of the provisioning, in the same trace, under the job.
    steps = [s for s in finished if s.name.startswith("step ")]
    provisioning = {"step allocate_storage", "step configure_network", "step initialize_database"}
    assert {s.name for s in steps} >= provisioning
    assert all(s.context.trace_id == trace_id and s.parent == job.context for s in steps)
    # The provisioner's call inside the step, and the SQL statements of the request and the step.
    (call,) = [s for s in finished if s.parent == step.context and s.name.startswith("provisioner ")]
    assert call.name == "provisioner initialize_database"
    assert call.attributes is not None and call.attributes["controlplane.provisioner"] == "noop"
    statements = {s.name for s in finished if s.parent in (request.context, job.context, step.context)}
    assert {
        "sql CREATE_INSTANCE_WITH_JOB",
        "sql TRANSITION_ONE[instance]",
        "sql RECORD_STEP_STARTED",
        "sql RECORD_STEP_ENDED",
    } <= statements
    sql_span = next(s for s in finished if s.name == "sql RECORD_STEP_STARTED")
    assert sql_span.attributes is not None and sql_span.kind is SpanKind.CLIENT
    assert "%(job_id)s" in str(sql_span.attributes["db.query.text"])  # placeholders, never values
    # No statement outside a request or a job is a trace of its own (the worker's claims, polls).
    roots = [s for s in finished if s.parent is None]
    assert {s.name for s in roots} == {"POST /v1/instances"}
