"""The OpenAPI document, made fit to generate clients from: the responses every route can give
(problem bodies with their headers), the headers each success carries, a description for every
field, the tags described. `tests/integration/test_openapi.py` fails when a route lacks an
operationId, a summary, a description or a declared response, so routes added later comply.

A route declares what is its own: `operation_id` (stable, camelCase), `summary`, `description`,
`responses=errors.responses(...)` for the problems it answers beyond the common ones, and
`headers(...)` for the headers of its success. The common ones are added here: 500 and 422 (an
unknown query parameter is refused everywhere) on every operation, 429 on every one a rate limit
counts; 401 and 403 on every operation that takes a key; `security: []` on the public ones;
X-Request-ID on every response and the RateLimit headers on those a rate limit counts; Retry-After
on 429 and 503.
"""

from __future__ import annotations

from typing import Any

from controlplane.api.models import plan_name_schema
from controlplane.api.problems import PROBLEM_MEDIA_TYPE, Problem, responses
from controlplane.api.ratelimit import UNLIMITED_PATHS

# Every header the API sends that a client may read, by name.
HEADERS: dict[str, dict[str, Any]] = {
    "X-Request-ID": {
        "description": "The request's id (the client's own X-Request-ID when well-formed, else one"
        " made); it is in the logs and the audit log.",
        "schema": {"type": "string"},
        "example": "4f1c2d0e9b8a4c6f8e1d2c3b4a596877",
    },
    "ETag": {
        "description": "The instance's version: send it back in If-Match to change it only if nobody"
        " changed it since.",
        "schema": {"type": "string"},
        "example": '"7"',
    },
    "Location": {
        "description": "The URL of the instance this request made.",
        "schema": {"type": "string"},
        "example": "/v1/instances/1b4e28ba-2fa1-11d2-883f-0016d3cca427",
    },
    "Idempotent-Replayed": {
        "description": "`true` when this is the stored answer to an earlier request with the same"
        " Idempotency-Key (nothing new was made).",
        "schema": {"type": "string", "enum": ["true"]},
    },
    "Cache-Control": {
        "description": "`no-store` on an answer that carries a password or a new key: never cached.",
        "schema": {"type": "string"},
        "example": "no-store",
    },
    "Retry-After": {
        "description": "Seconds to wait before trying again.",
        "schema": {"type": "integer", "minimum": 0},
        "example": 1,
    },
    "RateLimit-Policy": {
        "description": "The key's rate limit: requests per window (`q`) and the window in seconds"
        " (`w`), e.g. `100;w=60` (IETF draft-ietf-httpapi-ratelimit-headers).",
        "schema": {"type": "string"},
        "example": "100;w=60",
    },
    "RateLimit": {
        "description": "What is left of the key's rate limit: remaining requests (`r`) and seconds"
        " until the window resets (`t`), e.g. `limit=100, remaining=99, reset=60`.",
        "schema": {"type": "string"},
        "example": "limit=100, remaining=99, reset=60",
    },
}

# Sent on every response (the RateLimit ones on those a rate limit counts: `/v1`).
COMMON_HEADERS = ("X-Request-ID", "RateLimit-Policy", "RateLimit")

# What each tag holds.
TAGS = [
    {
        "name": "instances",
        "description": "Customers' databases: create, read, change, delete, retry, follow.",
    },
    {"name": "backups", "description": "Backups of a database, and restores of one whose data is lost."},
    {"name": "organisations and keys", "description": "Organisations (admin) and their API keys."},
    {"name": "sre", "description": "SRE views and actions across organisations (an admin key)."},
    {"name": "webhooks", "description": "Events from Stripe (signed, no API key)."},
    {
        "name": "notifications",
        "description": "The organisation's usage and billing state, and where its events are sent"
        " (signed webhook endpoints, email).",
    },
    {"name": "reference", "description": "The plans, the lifecycles and the CA certificate (no key)."},
    {"name": "health", "description": "Liveness, readiness and metrics (no key)."},
]

# The description of each field that its model leaves undescribed: by `Model.field`, else by
# field name (the same field means the same thing in every model).
FIELDS: dict[str, str] = {
    "id": "The object's id (a UUID; an event's is a number, increasing).",
    "name": "The object's name.",
    "items": "The objects of this page.",
    "next_cursor": "Pass as `cursor` to get the next page; null on the last page.",
    "state": "Where the object is in its lifecycle (GET /v1/lifecycle lists the states).",
    "kind": "What kind of object this is.",
    "created_at": "When it was made (RFC 3339).",
    "updated_at": "When it was last changed (RFC 3339).",
    "state_version": "Counts the object's state changes: the version If-Match compares.",
    "label": "A short human label.",
    "event": "The lifecycle event (the move) that was applied.",
    "detail": "Structured details of the event.",
    "deletion_protection": "When true, deletion is refused until it is turned off.",
    "state_entered_at": "When the object entered its current state (RFC 3339).",
    "region": "Where the instance runs.",
    "reason": "Why, in words.",
    "plan": "The plan (GET /v1/plans lists them).",
    "job_id": "The id of the job concerned.",
    "instance_id": "The id of the instance concerned.",
    "deadline_at": "When the current state times out if nothing moves it on (RFC 3339).",
    "billing_hold": "True while the organisation's billing holds its instances suspended.",
    "attempt": "Which attempt this is (1 for the first).",
    "at": "When it happened (RFC 3339).",
    "allowed_actions": "What the customer may do in the current state.",
    "to_state": "The state after the event.",
    "from_state": "The state before the event (null for the creation).",
    "time_in_state_s": "Seconds since the object entered its current state.",
    "taken_at": "When the backup was taken (RFC 3339).",
    "stripe_customer_id": "The organisation's Stripe customer (cus_...), if billed through Stripe.",
    "status": "The status.",
    "states": "The states.",
    "state_info": "The current state's label, description, severity and billing class.",
    "started_at": "When it started (RFC 3339).",
    "finished_at": "When it finished (RFC 3339).",
    "spec_generation": "Counts the changes of the declared spec (plan); each is carried out by an update.",
    "observed_generation": "The spec generation the running instance has reached.",
    "size_bytes": "The size in bytes.",
    "severity": "How much attention the state needs: ok, info, warning or critical.",
    "request_id": "The X-Request-ID of the request that caused it.",
    "prefix": "The key's first characters, to recognise it by (the key itself is never shown again).",
    "message": "What happened, in the customer's words.",
    "instance": "The instance.",
    "fence": "The fencing token of the job's current claim.",
    "description": "A longer description.",
    "deletion_requested": "True once deletion has been asked for (it starts as soon as it can).",
    "connection": "How to connect, once the instance has been ready.",
    "billing": "How the state is billed: billed, not billed, or held.",
    "actor": "Who or what caused it: its kind (customer, admin, worker, reconciler, stripe, system) and id.",
    "worker": "The worker that recorded it.",
    "verdict": "The job's outcome as its handler reported it.",
    "user": "The database user to connect as.",
    "uri": "A libpq connection URI (TLS, the server's certificate verified).",
    "type": "A URI naming the kind of problem (urn:controlplane:problem:<kind>).",
    "transitions": "Every move: from a state, by an event, to a state.",
    "transitional": "True for a state the instance passes through (no customer waits in it).",
    "to": "The state after the move.",
    "from": "The state before the move.",
    "title": "A short summary of the kind of problem.",
    "terminal": "The states nothing leaves.",
    "initial": "The state each object starts in.",
    "storage_gb": "The volume of each server, in GB.",
    "steps": "The steps of the operation, in order.",
    "step": "The step's name.",
    "severities": "The severities a state can have.",
    "settings": "The PostgreSQL settings the plan sets.",
    "run_at": "When the job may run next (RFC 3339).",
    "revoked_at": "When the key was revoked (RFC 3339); null while live.",
    "recorded_at": "When the backup was recorded (RFC 3339).",
    "received": "True: the event was received.",
    "priority": "The job's priority (lower runs first).",
    "port": "The TCP port.",
    "host": "The host name to connect to.",
    "dbname": "The database name.",
    "p50_s": "The median stay, in seconds.",
    "p95_s": "The 95th percentile of the stays, in seconds.",
    "max_s": "The longest stay, in seconds.",
    "outcome": "What the event did (applied, duplicate, ignored, ...).",
    "org_id": "The organisation's id.",
    "org": "The organisation.",
    "memory": "Memory per server (a Kubernetes quantity).",
    "cpu": "CPU per server (a Kubernetes quantity).",
    "max_attempts": "How many attempts the job gets before it fails.",
    "last_error": "The last attempt's error.",
    "key": "The API key: shown in this answer only, keep it safe.",
    "job": "The job.",
    "heartbeat_at": "When the job's holder last heartbeated (RFC 3339).",
    "failure_reasons": "Every typed failure reason: its code, message, hint and whether a retry can help.",
    "errors": "One entry per field that is not valid: the field and what is wrong with it.",
    "error_kind": "Whether the last error was temporary (retried) or permanent.",
    "entity": "Which lifecycle: instance or job.",
    "empty": "True: re-create the instance empty, accepting that its data is lost.",
    "customer_actions": "What customers may do in each state.",
    "current_state": "The state the object is in now.",
    "code": "A stable code for the failure reason (GET /v1/lifecycle lists them).",
    "claimed_by": "The worker holding the job.",
    "billing_status": "The organisation's last Stripe subscription status.",
    "billing_classes": "The billing classes a state can have.",
    "backups": "The plan's backup schedule.",
    "detail_text": "A sentence about this occurrence of the problem.",
    "Problem.detail": "A sentence about this occurrence of the problem.",
    "Problem.instance": "The path of the request the problem is about.",
    "Problem.status": "The HTTP status code.",
    "Problem.request_id": "The request's X-Request-ID: quote it when reporting the problem.",
    "Problem.allowed_actions": "What the customer may do in the current state.",
    "Plan.name": "The plan's name, as `plan` takes it.",
    "Health.status": "ok, or what is wrong.",
    "Health.detail": "What the check found.",
    "InstanceCreate.region": "Where to run it (default `local`).",
    "InstanceCreate.deletion_protection": "Refuse deletion until it is turned off (default false).",
    "InstanceUpdate.plan": "A new plan (a new spec generation, carried out by an update).",
    "InstanceUpdate.deletion_protection": "Turn deletion protection on or off (at once).",
    "KeyCreate.name": "A name to recognise the key by.",
    "OrgCreate.name": "The organisation's name (unique).",
    "OrgCreate.stripe_customer_id": "Its Stripe customer (cus_...), if billed through Stripe.",
    "JobAction.reason": "Why: recorded in the job's events as the operator's.",
    "OrgCreated.key": "The organisation's first API key (shown once).",
    "NewApiKey.prefix": "The key's first characters, to recognise it by.",
    "Failure.message": "What happened, in the customer's words.",
    "PublishedReason.message": "What happened, in the customer's words.",
    "AdminStep.step": "The step's name.",
    "AdminStep.code": "The failure code of a failed step.",
    "Progress.steps": "The steps of the operation, in order, each with its state and times.",
    "Lifecycles.instance": "The instance lifecycle.",
    "Lifecycles.job": "The job lifecycle.",
    "StepName.name": "The step's name.",
    "Step.name": "The step's name.",
    "Stuck.instances_past_deadline": "Live instances past their state's deadline, the most overdue first.",
    "Stuck.jobs_without_heartbeat": "Held jobs whose holder went silent, the longest silent first.",
    "JobEvent.state_version": "The job's version after the event.",
}

# Statuses every operation can answer, whatever it declares.
ALWAYS = (429, 500)

# The project's licence (LICENSE), as the document's `info.license`.
LICENSE = {"name": "Apache License 2.0", "identifier": "Apache-2.0"}


def servers(public_url: str | None) -> list[dict[str, str]]:
    """Where the API is: the configured public URL, else the host that serves the document."""
    if public_url:
        return [{"url": public_url.rstrip("/"), "description": "this installation (CONTROLPLANE_PUBLIC_URL)"}]
    return [{"url": "/", "description": "the host serving this document"}]


def headers(*names: str) -> dict[str, Any]:
    """The `headers` of a success response, by name (for a route's `responses={200: ...}`)."""
    return {name: {"$ref": f"#/components/headers/{name}"} for name in names}


def finish(schema: dict[str, Any]) -> dict[str, Any]:
    """Complete the generated document (in place; returned for convenience)."""
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    schemas["Problem"] = Problem.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas["PlanName"] = plan_name_schema()
    components["headers"] = HEADERS
    schema["tags"] = TAGS
    common = responses(*ALWAYS)
    for path, path_item in schema.get("paths", {}).items():
        for operation in path_item.values():
            _complete(operation, common, limited=not path.startswith(UNLIMITED_PATHS))
    for name, model in schemas.items():
        for field, prop in model.get("properties", {}).items():
            if "description" not in prop:
                text = FIELDS.get(f"{name}.{field}") or FIELDS.get(field)
                if text:
                    prop["description"] = text
    return schema


def _complete(operation: dict[str, Any], common: dict[int | str, dict[str, Any]], *, limited: bool) -> None:
    # Public (no key): said explicitly, so that a reader (or a linter) never takes it for forgotten.
    operation.setdefault("security", [])
    answers = operation.setdefault("responses", {})
    # What no rate limit counts (health, metrics) is never refused for it and carries no RateLimit.
    wanted: list[int] = list(ALWAYS) if limited else [500]
    if operation.get("security"):
        wanted += [401, 403]
    wanted.append(422)  # every operation refuses a query parameter it does not take
    extra = responses(*[s for s in wanted if s not in ALWAYS])
    for status in wanted:
        key = str(status)
        if key not in answers:
            answers[key] = dict((common | extra)[status])
    for status, answer in answers.items():
        answer_headers = answer.setdefault("headers", {})
        for name in COMMON_HEADERS if limited else COMMON_HEADERS[:1]:
            answer_headers.setdefault(name, {"$ref": f"#/components/headers/{name}"})
        if status in ("429", "503"):
            answer_headers.setdefault("Retry-After", {"$ref": "#/components/headers/Retry-After"})
        if status.startswith(("4", "5")):
            answer.setdefault(
                "content", {PROBLEM_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}}
            )


__all__ = ["FIELDS", "HEADERS", "PROBLEM_MEDIA_TYPE", "finish", "headers"]
