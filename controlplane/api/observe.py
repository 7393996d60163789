"""What each API request leaves behind: its duration in the request histogram, one access-log line,
and, when tracing is on, the span at the root of its trace."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from opentelemetry.trace import SpanKind
from starlette.routing import Match
from starlette.types import Message, Receive, Scope, Send

from controlplane.api.problems import _HttpMiddleware
from controlplane.runtime import metrics, tracing

access_log = logging.getLogger("controlplane.access")

# The route of a path no route serves (a 404): one series for all of them, not one per path.
UNMATCHED = "unmatched"
# Methods outside these are counted as `_OTHER` (as OpenTelemetry does): a client cannot make series.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "CONNECT", "TRACE"})
# Probes and scrapes: logged at DEBUG unless they fail, so the log at INFO is about traffic.
QUIET_ROUTES = frozenset({"/healthz", "/readyz", "/metrics"})


def route_template(scope: Scope, asked: Scope) -> str:
    """The template of the route that served (or would have served) the request: what the router
    put in the `scope`, else (a mount; a request refused before routing: rate limit, body size) the
    first route that matches the request as it was `asked`; UNMATCHED when none does."""
    path = getattr(scope.get("route"), "path", None)
    if isinstance(path, str):
        return path
    for candidate in getattr(asked.get("app"), "routes", ()):
        match, child = candidate.matches(asked)
        if match is not Match.NONE:
            path = getattr(child.get("route", candidate), "path", None)
            if isinstance(path, str):
                return path
    return UNMATCHED


class Observe(_HttpMiddleware):
    """Measures, logs and (tracing on) traces every HTTP request. Installed inside RequestId (its
    lines carry the request id) and outside CatchAll (an error is seen as the 500 it became)."""

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        asked = dict(scope)  # the router adds to the scope (and a mount changes its paths)
        status = 0

        async def watching(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            if tracing.enabled():
                await self._traced(scope, asked, receive, watching, lambda: status)
            else:
                await self.app(scope, receive, watching)
        finally:
            # No answer started: the request ended in an error no handler answered (or its client left).
            record(scope, asked, status or 500, time.perf_counter() - started)

    async def _traced(
        self, scope: Scope, asked: Scope, receive: Receive, send: Send, status: Callable[[], int]
    ) -> None:
        """The request in a server span: a new trace, linked to the one a client's own `traceparent`
        names (a customer neither joins the operator's traces nor decides their sampling)."""
        method = _method(scope)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])}
        attributes = {"http.request.method": method, "url.path": str(scope.get("path", ""))}
        links = tracing.link_to(headers)
        with tracing.span(
            method, kind=SpanKind.SERVER, attributes=attributes, parent=tracing.ROOT, links=links
        ) as span:
            try:
                await self.app(scope, receive, send)
            finally:
                if span is not None:
                    code = status() or 500
                    route = route_template(scope, asked)
                    span.update_name(f"{method} {route}")
                    span.set_attribute("http.route", route)
                    span.set_attribute("http.response.status_code", code)
                    request_id = _state(scope).get("request_id")
                    if request_id:
                        span.set_attribute("controlplane.request_id", str(request_id))
                    org_id = _state(scope).get("org_id")
                    if org_id:
                        span.set_attribute("controlplane.org_id", str(org_id))
                    if code >= 500:
                        tracing.set_error(span, str(code))


def record(scope: Scope, asked: Scope, status: int, duration_s: float) -> None:
    """The request in the histogram and the access log: method, route, status, duration, request
    id, organisation. Never a header, a query string or a body: no key or password reaches the log."""
    method = _method(scope)
    route = route_template(scope, asked)
    metrics.HTTP_REQUEST_DURATION.labels(method, route, f"{status // 100}xx").observe(duration_s)
    level = logging.DEBUG if route in QUIET_ROUTES and status < 500 else logging.INFO
    if not access_log.isEnabledFor(level):
        return
    state = _state(scope)
    duration_ms = round(duration_s * 1000, 3)  # the line and its field say the same number
    extra: dict[str, object] = {
        "method": method,
        "route": route,
        "status": status,
        "duration_ms": duration_ms,
        "request_id": state.get("request_id"),
    }
    if state.get("org_id"):
        extra["org_id"] = str(state["org_id"])
    access_log.log(level, "%s %s %d %.1fms", method, route, status, duration_ms, extra=extra)


def _method(scope: Scope) -> str:
    method = str(scope.get("method", ""))
    return method if method in METHODS else "_OTHER"


def _state(scope: Scope) -> dict[str, object]:
    state = scope.get("state")
    return state if isinstance(state, dict) else {}
