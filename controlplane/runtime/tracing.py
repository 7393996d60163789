"""Tracing with OpenTelemetry: off unless an OTLP endpoint is configured.

Spans: one per API request (the root of its trace), per job (continuing the trace of the request
that enqueued it, carried in the job's payload as a W3C `traceparent`), per step of an instance
job, per provisioner call and per SQL statement made inside a request or a job. Provisioner calls
and SQL statements are never roots: the reconciler's passes and the worker's claims make no
traces of their own.

Off, every entry point here is one test of a module variable: no tracer, no span, no context.
The tracer is this module's own (`install`), not OpenTelemetry's global one, so that tests can
install an in-memory exporter and take it away again.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from controlplane.runtime.settings import Settings

P = ParamSpec("P")
T = TypeVar("T")

# The W3C trace context: the `traceparent` (and `tracestate`) a job's payload carries.
_PROPAGATOR = TraceContextTextMapPropagator()
CARRIER_KEYS = frozenset(_PROPAGATOR.fields)
TRACES_PATH = "/v1/traces"

# An empty context: a span started under it has no parent (a new trace), whatever is current.
ROOT = Context()

_tracer: trace.Tracer | None = None


def install(provider: TracerProvider | None) -> None:
    """Trace through `provider` from now on (None: tracing off)."""
    global _tracer
    _tracer = None if provider is None else provider.get_tracer("controlplane")


def enabled() -> bool:
    return _tracer is not None


def active() -> bool:
    """Tracing is on and a recorded span (a request's, a job's) is current: its children are wanted."""
    return _tracer is not None and trace.get_current_span().is_recording()


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a collector's base URL (or of the traces URL itself)."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith(TRACES_PATH) else endpoint + TRACES_PATH


def configure(settings: Settings, service: str) -> TracerProvider | None:
    """At process start: spans batched to the OTLP endpoint of `settings`, as `service`; the provider
    (to shut down at exit, which sends what is left), or None when tracing is off."""
    endpoint = settings.tracing.otlp_endpoint
    if not endpoint:
        install(None)
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    provider = TracerProvider(
        resource=Resource.create({"service.name": service, "service.namespace": "controlplane"}),
        sampler=ParentBased(TraceIdRatioBased(settings.tracing.trace_sample_ratio)),
    )
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
    install(provider)
    return provider


@contextlib.contextmanager
def span(
    name: str,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Mapping[str, str | int | float | bool] | None = None,
    parent: Context | None = None,
    links: list[Link] | None = None,
) -> Iterator[Span | None]:
    """A span around the block, child of the current one (or of `parent`); None when tracing is off.
    An exception leaving the block is recorded on it and sets its status to error."""
    tracer = _tracer
    if tracer is None:
        yield None
        return
    with tracer.start_as_current_span(
        name, context=parent, kind=kind, attributes=attributes, links=links
    ) as current:
        yield current


@contextlib.contextmanager
def child_span(
    name: str, attributes: Mapping[str, str | int | float | bool] | None = None
) -> Iterator[Span | None]:
    """A span around the block only under a recorded one (never a root); else nothing."""
    if not active():
        yield None
        return
    with span(name, attributes=attributes) as current:
        yield current


def carrier() -> dict[str, str]:
    """The current trace context as W3C headers (`traceparent`), for a job's payload; empty when
    tracing is off or no span is current."""
    if _tracer is None:
        return {}
    found: dict[str, str] = {}
    _PROPAGATOR.inject(found)
    return found


def parent_of(payload: Mapping[str, Any] | None) -> Context | None:
    """The trace context a job's payload carries (None: off, or none carried: the job is a root)."""
    if _tracer is None or not payload or "traceparent" not in payload:
        return None
    return _PROPAGATOR.extract({key: str(payload[key]) for key in CARRIER_KEYS if key in payload})


def link_to(headers: Mapping[str, str]) -> list[Link]:
    """A link to the trace a request's own `traceparent` header names (none: no link)."""
    if _tracer is None or "traceparent" not in headers:
        return []
    context = trace.get_current_span(_PROPAGATOR.extract(headers)).get_span_context()
    return [Link(context)] if context.is_valid else []


def set_error(current: Span | None, description: str) -> None:
    if current is not None:
        current.set_status(StatusCode.ERROR, description)


Attributes = Mapping[str, str | int | float | bool]


def traced_call(
    name: str, method: Callable[P, Awaitable[T]], describe: Callable[..., Attributes] | None = None
) -> Callable[P, Awaitable[T]]:
    """`method` in a child span named `name` on every call (under a recorded span only), with the
    attributes `describe` finds in the call's arguments."""

    @functools.wraps(method)
    async def call(*args: P.args, **kwargs: P.kwargs) -> T:
        if not active():
            return await method(*args, **kwargs)
        with span(name, attributes=describe(*args, **kwargs) if describe else None):
            return await method(*args, **kwargs)

    return call
