"""RFC 9457 problem responses: the error kinds, their handlers (domain refusals mapped in one place),
and the request body size limit."""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Sequence
from typing import Any

import psycopg
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from psycopg_pool import PoolTimeout
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane.core.refusals import (
    AlreadyReplaced,
    AmbiguousName,
    Conflict,
    DeletionProtected,
    DomainError,
    IdempotencyInFlight,
    IdempotencyMismatch,
    InvalidRequest,
    InvalidState,
    LimitReached,
    NameTaken,
    NotFound,
    NotRetryable,
    OutsideWindow,
    PreconditionFailed,
    Unsupported,
)
from controlplane.db import connection as db
from controlplane.runtime import logs, metrics

log = logging.getLogger(__name__)

PROBLEM_MEDIA_TYPE = "application/problem+json"
TYPE_PREFIX = "urn:controlplane:problem:"

# Every kind of error the API answers with: (HTTP status, title). The `type` is TYPE_PREFIX + kind.
KINDS: dict[str, tuple[int, str]] = {
    "bad-request": (400, "Bad request"),
    "bad-signature": (400, "Webhook signature is not valid"),
    "unauthorized": (401, "Authentication required"),
    "forbidden": (403, "Not allowed for this key"),
    "not-found": (404, "Not found"),
    "ambiguous-name": (404, "The name is ambiguous: use an id"),
    "method-not-allowed": (405, "Method not allowed"),
    "not-acceptable": (406, "Not acceptable"),
    "invalid-state": (409, "Not allowed in the current state"),
    "deletion-protected": (409, "Deletion protection is on"),
    "not-retryable": (409, "A retry cannot help"),
    "already-replaced": (409, "Already retried"),
    "name-taken": (409, "Name already in use"),
    "conflict": (409, "Conflict"),
    "limit-reached": (409, "Limit reached"),
    "idempotency-in-flight": (409, "A request with this Idempotency-Key is in progress"),
    "busy": (409, "The resource is busy; retry shortly"),
    "precondition-failed": (412, "Precondition failed"),
    "payload-too-large": (413, "Request body too large"),
    "unsupported-media-type": (415, "Unsupported media type"),
    "validation": (422, "Request is not valid"),
    "idempotency-mismatch": (422, "Idempotency-Key reused with a different request"),
    "rate-limited": (429, "Too many requests"),
    "internal": (500, "Internal server error"),
    "unavailable": (503, "Service unavailable"),
}


# The problem kind of each domain refusal; the most specific class first.
DOMAIN_KINDS: tuple[tuple[type[DomainError], str], ...] = (
    (DeletionProtected, "deletion-protected"),
    (NotRetryable, "not-retryable"),
    (InvalidState, "invalid-state"),
    (AmbiguousName, "ambiguous-name"),
    (NotFound, "not-found"),
    (NameTaken, "name-taken"),
    (LimitReached, "limit-reached"),
    (AlreadyReplaced, "already-replaced"),
    (IdempotencyInFlight, "idempotency-in-flight"),
    (IdempotencyMismatch, "idempotency-mismatch"),
    (Conflict, "conflict"),
    (PreconditionFailed, "precondition-failed"),
    (InvalidRequest, "validation"),
    (Unsupported, "validation"),
)


class Problem(BaseModel):
    """An RFC 9457 problem document, with the extension members this API uses."""

    model_config = ConfigDict(extra="allow")

    type: str
    title: str
    status: int
    detail: str | None = None
    instance: str | None = None
    request_id: str | None = None
    current_state: str | None = None
    allowed_actions: list[str] | None = None
    errors: list[dict[str, Any]] | None = None


class ProblemError(Exception):
    """Raise to answer with a problem of `kind`; extensions become extra members of the body."""

    def __init__(
        self, kind: str, detail: str | None = None, *, headers: dict[str, str] | None = None, **ext: Any
    ):
        if kind not in KINDS:
            raise ValueError(f"unknown problem kind {kind!r}")
        super().__init__(detail or kind)
        self.kind = kind
        self.status, self.title = KINDS[kind]
        self.detail = detail
        self.headers = headers or {}
        self.ext = ext


def problem_body(kind: str, detail: str | None, instance: str | None, **ext: Any) -> dict[str, Any]:
    status, title = KINDS[kind]
    body: dict[str, Any] = {
        "type": TYPE_PREFIX + kind,
        "title": title,
        "status": status,
        "detail": detail,
        "instance": instance,
    }
    body.update({k: v for k, v in ext.items() if v is not None})
    return body


def problem_response(
    kind: str,
    detail: str | None = None,
    *,
    instance: str | None = None,
    headers: dict[str, str] | None = None,
    **ext: Any,
) -> JSONResponse:
    body = problem_body(kind, detail, instance, **ext)
    return JSONResponse(body, status_code=body["status"], headers=headers, media_type=PROBLEM_MEDIA_TYPE)


def request_id(request: Request) -> str | None:
    value = getattr(request.state, "request_id", None)
    return value if isinstance(value, str) else None


def _for_request(request: Request, kind: str, detail: str | None, **ext: Any) -> JSONResponse:
    headers = ext.pop("headers", None)
    return problem_response(
        kind,
        detail,
        instance=request.url.path,
        headers=headers,
        request_id=request_id(request),
        **ext,
    )


def _field(loc: Sequence[Any]) -> str:
    parts = [str(p) for p in loc]
    if parts and parts[0] in {"body", "query", "path", "header"}:
        where, rest = parts[0], parts[1:]
        return f"{where}.{'.'.join(rest)}" if rest else where
    return ".".join(parts)


def validation_errors(errors: Sequence[Any]) -> list[dict[str, Any]]:
    out = []
    for error in errors:
        # A validator's own sentence, without pydantic's "Value error, " before it.
        message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
        if error.get("type") == "extra_forbidden":
            message = "unknown field"
        out.append({"field": _field(error.get("loc", ())), "message": message})
    return out


def _summary(errors: Sequence[dict[str, Any]]) -> str:
    return "; ".join(f"{e['field']}: {e['message']}" for e in errors)


async def _on_problem(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ProblemError)
    return _for_request(request, exc.kind, exc.detail, headers=exc.headers or None, **exc.ext)


def domain_problem(exc: DomainError) -> ProblemError:
    """The problem a domain refusal is answered with: its kind, its sentence, the state it names."""
    kind = next((k for cls, k in DOMAIN_KINDS if isinstance(exc, cls)), "bad-request")
    if isinstance(exc, NotRetryable):
        return ProblemError(
            kind,
            exc.detail,
            current_state=exc.current_state,
            allowed_actions=exc.allowed_actions,
            failure=exc.failure,
        )
    if isinstance(exc, AmbiguousName):
        return ProblemError(kind, exc.detail, candidates=exc.candidates)
    if isinstance(exc, AlreadyReplaced):
        return ProblemError(kind, exc.detail, replaced_by=str(exc.replaced_by))
    if isinstance(exc, InvalidState):
        return ProblemError(
            kind, exc.detail, current_state=exc.current_state, allowed_actions=exc.allowed_actions
        )
    if isinstance(exc, PreconditionFailed):
        return ProblemError(kind, exc.detail, current_state=exc.current_state)
    if isinstance(exc, InvalidRequest):
        field = f"{exc.location}.{exc.field}"
        errors = [{"field": field, "message": str(exc)}]
        if isinstance(exc, OutsideWindow):
            window = None if exc.window is None else {"earliest": exc.window[0], "latest": exc.window[1]}
            return ProblemError(kind, f"{field}: {exc}", errors=errors, recoverable_window=window)
        return ProblemError(kind, f"{field}: {exc}", errors=errors)
    return ProblemError(kind, exc.detail)


async def _on_domain(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, DomainError)
    return await _on_problem(request, domain_problem(exc))


async def _on_validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = validation_errors(exc.errors())
    detail = _summary(errors) or "request is not valid"
    return _for_request(request, "validation", detail, errors=errors)


_HTTP_KINDS = {
    400: "bad-request",
    401: "unauthorized",
    403: "forbidden",
    404: "not-found",
    405: "method-not-allowed",
    406: "not-acceptable",
    409: "conflict",
    412: "precondition-failed",
    413: "payload-too-large",
    415: "unsupported-media-type",
    422: "validation",
    429: "rate-limited",
    503: "unavailable",
}


def _allowed_methods(request: Request) -> list[str]:
    """Every method of every route at this path (Starlette names only the first route's)."""
    methods: set[str] = set()
    for route in request.app.routes:
        match, _ = route.matches({**request.scope, "method": ""})
        if match is not Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


async def _on_http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    kind = _HTTP_KINDS.get(exc.status_code, "internal" if exc.status_code >= 500 else "bad-request")
    detail = exc.detail if isinstance(exc.detail, str) else None
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        headers["Allow"] = ", ".join(_allowed_methods(request))
    response = _for_request(request, kind, detail, headers=headers or None)
    if response.status_code != exc.status_code:
        body = json.loads(bytes(response.body))
        body["status"] = exc.status_code
        response = JSONResponse(
            body, status_code=exc.status_code, headers=exc.headers, media_type=PROBLEM_MEDIA_TYPE
        )
    return response


def _query_names(dependant: Any) -> set[str]:
    names = {param.alias for param in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return names


async def refuse_unknown_query(request: Request) -> None:
    """A query parameter the route does not declare is refused (422), as unknown body fields are."""
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    if dependant is None or not request.query_params:
        return
    known = _query_names(dependant)
    unknown = sorted(set(request.query_params) - known)
    if unknown:
        errors = [{"field": f"query.{name}", "message": "unknown parameter"} for name in unknown]
        raise ProblemError("validation", _summary(errors), errors=errors)


def install(app: FastAPI) -> None:
    app.add_exception_handler(ProblemError, _on_problem)
    app.add_exception_handler(DomainError, _on_domain)
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(StarletteHTTPException, _on_http)


def responses(*statuses: int, signed: bool = False) -> dict[int | str, dict[str, Any]]:
    """OpenAPI response entries documenting problem bodies for `statuses` (`signed`: the route
    checks a webhook signature, so its 400 may also be about that)."""
    schema = {"$ref": "#/components/schemas/Problem"}
    return {
        status: {
            "description": _describe(status, signed),
            "content": {PROBLEM_MEDIA_TYPE: {"schema": schema}},
        }
        for status in statuses
    }


# Problem kinds only a signed webhook route answers.
SIGNATURE_KINDS = frozenset({"bad-signature"})


def _describe(status: int, signed: bool = False) -> str:
    titles = sorted(
        {
            title
            for kind, (s, title) in KINDS.items()
            if s == status and (signed or kind not in SIGNATURE_KINDS)
        }
    )
    return "; ".join(titles) or "Problem"


def _scope_request_id(scope: Scope) -> str | None:
    value: str | None = scope.get("state", {}).get("request_id")
    return value


def _scope_problem(scope: Scope, kind: str, detail: str) -> JSONResponse:
    """A problem answered by a middleware, outside any route."""
    return problem_response(kind, detail, instance=scope.get("path"), request_id=_scope_request_id(scope))


class _HttpMiddleware:
    """An ASGI middleware for HTTP requests; anything else (lifespan, websockets) passes through."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.http(scope, receive, send)

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


class BodySizeLimit(_HttpMiddleware):
    """Refuse a request body over `max_bytes` with 413 before any route reads it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        super().__init__(app)
        self.max_bytes = max_bytes

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message], receive), send)
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            chunks.append(body)
            more = bool(message.get("more_body", False))
        whole: Message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([whole], receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = _scope_problem(
            scope, "payload-too-large", f"the request body is larger than {self.max_bytes} bytes"
        )
        await response(scope, receive, send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay


# When a client may try again after the database refused a request for the moment (seconds).
RETRY_AFTER_S = "1"


def database_refusal(exc: BaseException) -> tuple[str, str, str] | None:
    """(reason, problem kind, detail) of a database error that is no fault of the request, all of
    them answered with Retry-After; None for any other error (a bug: a 500).

    A lock another session holds past the lock timeout, and a race lost again and again, are 409:
    the row is busy, the database is fine. A statement past its timeout, a read-only database and
    an unreachable one are 503.
    """
    if isinstance(exc, psycopg.errors.LockNotAvailable):
        return "lock_timeout", "busy", "the resource is locked by another operation; retry shortly"
    if isinstance(exc, db.LOST_RACE):
        return "lost_race", "busy", "concurrent changes to the resource; retry shortly"
    if isinstance(exc, psycopg.errors.QueryCanceled):
        return "statement_timeout", "unavailable", "the database did not answer in time; retry shortly"
    if isinstance(exc, db.READ_ONLY):
        return "read_only", "unavailable", "the database is read-only for now; retry shortly"
    if isinstance(exc, psycopg.OperationalError | PoolTimeout):
        # The database went away (a restart, a failover): the client may retry.
        return "unavailable", "unavailable", "the database is unavailable; retry shortly"
    return None


class CatchAll(_HttpMiddleware):
    """Log any unhandled exception and answer a 500 problem that carries no trace of it."""

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            response = self._answer(scope, exc)  # logged either way
            if not started:
                await response(scope, receive, send)

    @staticmethod
    def _answer(scope: Scope, exc: Exception) -> JSONResponse:
        """The problem answering `exc` (unless the response has started), logged."""
        if isinstance(exc, psycopg.DataError):
            # A value the database cannot store (a NUL character in text, a number out of range):
            # the request is refused whole, its transaction rolled back.
            log.info("refused a value in %s %s: %s", *_what(scope), exc)
            detail = f"a value in the request cannot be stored: {str(exc).strip()[:200]}"
            return _scope_problem(scope, "validation", detail)
        refusal = database_refusal(exc)
        if refusal is not None:
            reason, kind, detail = refusal
            metrics.DATABASE_REFUSALS.labels(reason).inc()
            log.warning("database refusal (%s) in %s %s: %s", reason, *_what(scope), exc)
            response = _scope_problem(scope, kind, detail)
            response.headers["Retry-After"] = RETRY_AFTER_S
            return response
        log.exception("unhandled error in %s %s (request %s)", *_what(scope), _scope_request_id(scope))
        return _scope_problem(scope, "internal", "an internal error occurred; it has been logged")


def _what(scope: Scope) -> tuple[str | None, str | None]:
    return scope.get("method"), scope.get("path")


class RequestId(_HttpMiddleware):
    """Accept a well-formed X-Request-ID or make one; expose it in scope state and the response."""

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        token = logs.REQUEST_ID.set(request_id)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                headers.append((b"x-request-id", request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            logs.REQUEST_ID.reset(token)


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
