"""Routes of an organisation's notifications (webhook endpoints, email addresses, the delivery log),
its usage and its billing state. Thin: the use cases are controlplane.services.notifications,
.usage and .billing_policy; their refusals are rendered by controlplane.api.problems."""

from __future__ import annotations

import typing
import uuid
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from controlplane.api import problems as errors
from controlplane.api import views
from controlplane.api.auth import Customer, customer
from controlplane.api.models import Strict
from controlplane.api.state import app_state
from controlplane.core import cursors, metering
from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.services import billing_policy, idempotency, notices, usage
from controlplane.services import notifications as service

router = APIRouter(tags=["notifications"])
Caller = Annotated[Customer, Depends(customer)]
DEFAULT_LIMIT = 50
MAX_LIMIT = 100
EVENT_TYPES = ", ".join(f"`{name}`" for name in notices.EVENT_TYPES)


# The event types a target subscribes to (`*`: all of them).
EventType = Literal[
    "instance.ready",
    "instance.failed",
    "instance.degraded",
    "instance.recovered",
    "instance.failover",
    "instance.suspended",
    "instance.resumed",
    "instance.deleted",
    "instance.deadline_overdue",
    "instance.storage_grown",
    "instance.storage_full",
    "billing.past_due",
    "*",
]
assert set(typing.get_args(EventType)) == {*notices.EVENT_TYPES, "*"}


class WebhookEndpointCreate(Strict):
    url: str = Field(
        min_length=10,
        max_length=2048,
        pattern=r"^https?://[A-Za-z0-9.\[\]:-]+(/[!-~]*)?$",
        description="https URL the events are POSTed to (its host must resolve to public addresses)",
    )
    event_types: list[EventType] = Field(min_length=1, max_length=20, description=f"of {EVENT_TYPES}, or `*`")
    description: str = Field("", max_length=200, pattern=r"^[^\x00-\x1f\x7f]*$")


class NotificationEmailCreate(Strict):
    address: str = Field(
        min_length=3,
        max_length=254,
        pattern=r"^[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+$",
        description="the email address notifications are sent to",
    )
    event_types: list[EventType] = Field(min_length=1, max_length=20, description=f"of {EVENT_TYPES}, or `*`")


class WebhookEndpoint(BaseModel):
    id: uuid.UUID
    url: str = Field(description="the https URL events are POSTed to")
    event_types: list[str] = Field(description="the event types sent to it (`*`: all)")
    description: str
    created_at: datetime
    enabled: bool = Field(description="whether deliveries are made to it")
    disabled_at: datetime | None = Field(
        description="when it was disabled after sustained failure (null while enabled)"
    )
    disabled_reason: str | None = Field(description="why it was disabled (null while enabled)")
    # The signing secret: in the answer to the registration only (null everywhere else).
    secret: str | None = Field(
        None, description="the signing secret: in the answer to the registration only, null everywhere else"
    )


class WebhookEndpointPage(BaseModel):
    items: list[WebhookEndpoint]
    next_cursor: str | None


class NotificationEmail(BaseModel):
    id: uuid.UUID
    address: str = Field(description="the email address notifications are sent to")
    event_types: list[str] = Field(description="the event types sent to it (`*`: all)")
    created_at: datetime


class NotificationEmailPage(BaseModel):
    items: list[NotificationEmail]
    next_cursor: str | None


class Delivery(BaseModel):
    id: uuid.UUID
    event_id: str = Field(
        description="the event's id, the same on every attempt (receivers de-duplicate by it)"
    )
    event_type: str = Field(description="the event's type, e.g. instance.ready")
    instance_id: uuid.UUID | None
    state: str
    attempts: int = Field(description="attempts made so far")
    last_status: int | None = Field(description="HTTP status of the last attempt (null if none answered)")
    last_error: str | None
    created_at: datetime
    last_attempt_at: datetime | None = Field(description="when the last attempt was made")
    delivered_at: datetime | None = Field(
        description="when an attempt was answered with a 2xx (null until then)"
    )


class DeliveryPage(BaseModel):
    items: list[Delivery]
    next_cursor: str | None


_GB_SECONDS = (
    "allocated storage over that time, in GB-seconds (GB allocated x seconds, as the allocation "
    "changed: 3600 per GB-hour); 0 in a class that costs nothing"
)


class UsageLine(BaseModel):
    instance_id: uuid.UUID
    plan: str
    billing: str
    seconds: float = Field(description="billable seconds in the window")
    storage_gb_seconds: float = Field(description=_GB_SECONDS)


class UsageTotal(BaseModel):
    plan: str
    billing: str
    seconds: float = Field(description="billable seconds in the window")
    storage_gb_seconds: float = Field(description=_GB_SECONDS)


class Usage(BaseModel):
    organisation_id: uuid.UUID = Field(description="the organisation the usage is of")
    start: datetime = Field(alias="from")
    end: datetime = Field(alias="to")
    as_of: datetime = Field(description="the time the usage was computed at (the window's end at most)")
    items: list[UsageLine]
    totals: list[UsageTotal] = Field(
        description="the seconds and storage GB-seconds per plan and billing class over all instances"
    )


class Billing(BaseModel):
    hold: bool = Field(description="whether a billing hold is on (the databases are suspended: read-only)")
    status: str | None
    past_due_since: datetime | None = Field(
        description="when the subscription became past due (null if it is not)"
    )
    suspends_at: datetime | None = Field(
        description="when a past-due subscription's databases become read-only unless paid"
    )
    grace_period_s: float = Field(description="seconds between past due and suspension")
    deprovision_after_days: float | None = Field(
        description="days suspended after which the databases are deleted (with a final backup); null: never"
    )


def _endpoint(row: Any, secret: str | None = None) -> dict[str, Any]:
    return {
        "id": row["id"],
        "url": row["address"],
        "event_types": row["event_types"],
        "description": row["description"],
        "created_at": row["created_at"],
        "enabled": row["disabled_at"] is None,
        "disabled_at": row["disabled_at"],
        "disabled_reason": row["disabled_reason"],
        "secret": secret,
    }


def _email(row: Any) -> dict[str, Any]:
    return {
        "id": row["id"],
        "address": row["address"],
        "event_types": row["event_types"],
        "created_at": row["created_at"],
    }


def _after(cursor: str | None) -> tuple[datetime, uuid.UUID] | None:
    if not cursor:
        return None
    created_s, id_s = cursors.decode_cursor(cursor, 2)
    try:
        return datetime.fromisoformat(created_s), uuid.UUID(id_s)
    except ValueError:
        raise cursors.bad_cursor() from None


Limit = Annotated[int, Query(ge=1, description=f"page size; values above {MAX_LIMIT} are capped")]


async def _register(
    request: Request, who: Customer, asked: service.NewTarget, key: str | None, shown: Any
) -> JSONResponse:
    """201 with the target, in one transaction with its Idempotency-Key record; a replay answers the
    same target without its secret (the secret is shown once, and never stored in clear)."""
    state = app_state(request)
    digest = idempotency.request_hash(
        "POST",
        request.url.path,
        {"address": asked.address, "types": sorted(asked.event_types), "d": asked.description},
    )
    once_shown: list[str] = []

    async def run(conn: AsyncConn) -> idempotency.StoredResponse:
        registered = await service.register(conn, asked, state.box, state.settings.notifications)
        if registered.secret is not None:
            once_shown.append(registered.secret)
        body = shown(registered.target)
        location = f"{request.url.path}/{registered.target['id']}"
        return idempotency.StoredResponse(201, body, {"Location": location})

    answer = await idempotency.once_per_key(state.pool, who.org_id, idempotency.Keyed(key, digest), run)
    return views.answered(answer, {"secret": once_shown[-1]} if once_shown else None)


@router.post(
    "/v1/webhook-endpoints",
    status_code=201,
    response_model=WebhookEndpoint,
    responses=errors.responses(400, 401, 403, 409, 413, 422),
    operation_id="createWebhookEndpoint",
    description=(
        "Registers an https endpoint for the organisation's events. Each delivery is a POST signed like "
        'Stripe\'s (`Controlplane-Signature: t=<unix time>,v1=<HMAC-SHA256 of "t.body" with the secret>`),'
        " carries the event's id for de-duplication, and is retried with backoff for up to a day; an "
        "endpoint that keeps failing is disabled. The URL must resolve to public addresses unless the "
        "operator allows private ones."
    ),
    summary="Register a webhook endpoint: its signing secret is in this answer only",
)
async def create_webhook_endpoint(
    body: WebhookEndpointCreate,
    request: Request,
    who: Caller,
    idempotency_key: Annotated[str | None, Header(max_length=idempotency.MAX_KEY_LENGTH)] = None,
) -> JSONResponse:
    asked = service.NewTarget(who.org_id, "webhook", body.url, list(body.event_types), body.description)

    def shown(row: Any) -> dict[str, Any]:
        return WebhookEndpoint.model_validate(_endpoint(row)).model_dump(mode="json")

    return await _register(request, who, asked, idempotency_key, shown)


@router.get(
    "/v1/webhook-endpoints",
    response_model=WebhookEndpointPage,
    responses=errors.responses(401, 403, 422),
    operation_id="listWebhookEndpoints",
    description=(
        "The organisation's webhook endpoints, oldest first, with whether each is enabled and, if not, "
        "why. The signing secret is never shown again."
    ),
    summary="List the organisation's webhook endpoints (oldest first, cursor paginated)",
)
async def list_webhook_endpoints(
    request: Request, who: Caller, cursor: str | None = None, limit: Limit = DEFAULT_LIMIT
) -> dict[str, Any]:
    return await _targets(request, who, "webhook", cursor, limit, _endpoint)


async def _targets(
    request: Request, who: Customer, kind: service.Kind, cursor: str | None, limit: int, shown: Any
) -> dict[str, Any]:
    """A page of the organisation's targets of a kind, oldest first, and the next page's cursor."""
    limit = min(limit, MAX_LIMIT)
    async with app_state(request).pool.connection() as conn:
        rows = await service.page(conn, who.org_id, kind, limit + 1, _after(cursor))
    page, next_cursor = _page_of(rows, limit)
    return {"items": [shown(row) for row in page], "next_cursor": next_cursor}


def _page_of(rows: Any, limit: int) -> tuple[Any, str | None]:
    return cursors.page_of(rows, limit, lambda r: cursors.encode_cursor(r["created_at"].isoformat(), r["id"]))


@router.get(
    "/v1/webhook-endpoints/{endpoint_id}",
    response_model=WebhookEndpoint,
    responses=errors.responses(401, 403, 404, 422),
    operation_id="getWebhookEndpoint",
    description=(
        "One webhook endpoint of the organisation: its URL, event types, and whether it is enabled (an "
        "endpoint disabled after sustained failure says why)."
    ),
    summary="A webhook endpoint: whether it is enabled, and why not",
)
async def get_webhook_endpoint(endpoint_id: uuid.UUID, request: Request, who: Caller) -> dict[str, Any]:
    async with app_state(request).pool.connection() as conn:
        return _endpoint(await service.get(conn, who.org_id, "webhook", endpoint_id))


@router.delete(
    "/v1/webhook-endpoints/{endpoint_id}",
    status_code=204,
    responses=errors.responses(401, 403, 404, 422),
    operation_id="deleteWebhookEndpoint",
    description=(
        "Removes a webhook endpoint: no new delivery is made to it, and deliveries still queued for it "
        "are dropped."
    ),
    summary="Remove a webhook endpoint: nothing more is sent to it",
)
async def delete_webhook_endpoint(endpoint_id: uuid.UUID, request: Request, who: Caller) -> Response:
    async with app_state(request).pool.connection() as conn:
        await service.remove(conn, who.org_id, "webhook", endpoint_id)
    return Response(status_code=204)


@router.get(
    "/v1/webhook-endpoints/{endpoint_id}/deliveries",
    response_model=DeliveryPage,
    responses=errors.responses(401, 403, 404, 422),
    operation_id="listWebhookDeliveries",
    description=(
        "The delivery log of one endpoint, newest first: each event sent or to be sent, its attempts, the"
        " last HTTP status or error, and when it was delivered."
    ),
    summary="The delivery log of a webhook endpoint (newest first, cursor paginated)",
)
async def list_webhook_deliveries(
    endpoint_id: uuid.UUID,
    request: Request,
    who: Caller,
    cursor: str | None = None,
    limit: Limit = DEFAULT_LIMIT,
) -> dict[str, Any]:
    limit = min(limit, MAX_LIMIT)
    async with app_state(request).pool.connection() as conn:
        rows = await service.deliveries(conn, who.org_id, endpoint_id, limit + 1, _after(cursor))
    page, next_cursor = cursors.page_of(
        rows, limit, lambda r: cursors.encode_cursor(r["created_at"].isoformat(), r["id"])
    )
    return {"items": list(page), "next_cursor": next_cursor}


@router.post(
    "/v1/notification-emails",
    status_code=201,
    response_model=NotificationEmail,
    responses=errors.responses(400, 401, 403, 409, 413, 422),
    operation_id="createNotificationEmail",
    description=(
        "Adds an email address that the organisation's notifications are sent to by SMTP, for the event "
        "types given."
    ),
    summary="Add an email address that notifications are sent to",
)
async def create_notification_email(
    body: NotificationEmailCreate,
    request: Request,
    who: Caller,
    idempotency_key: Annotated[str | None, Header(max_length=idempotency.MAX_KEY_LENGTH)] = None,
) -> JSONResponse:
    asked = service.NewTarget(who.org_id, "email", body.address, list(body.event_types))

    def shown(row: Any) -> dict[str, Any]:
        return NotificationEmail.model_validate(_email(row)).model_dump(mode="json")

    return await _register(request, who, asked, idempotency_key, shown)


@router.get(
    "/v1/notification-emails",
    response_model=NotificationEmailPage,
    responses=errors.responses(401, 403, 422),
    operation_id="listNotificationEmails",
    description=(
        "The email addresses the organisation's notifications are sent to, oldest first, with their event"
        " types."
    ),
    summary="List the email addresses notifications are sent to (oldest first, cursor paginated)",
)
async def list_notification_emails(
    request: Request, who: Caller, cursor: str | None = None, limit: Limit = DEFAULT_LIMIT
) -> dict[str, Any]:
    return await _targets(request, who, "email", cursor, limit, _email)


@router.delete(
    "/v1/notification-emails/{email_id}",
    status_code=204,
    responses=errors.responses(401, 403, 404, 422),
    operation_id="deleteNotificationEmail",
    description="Removes an email address: no further notification is sent to it.",
    summary="Stop sending notifications to an email address",
)
async def delete_notification_email(email_id: uuid.UUID, request: Request, who: Caller) -> Response:
    async with app_state(request).pool.connection() as conn:
        await service.remove(conn, who.org_id, "email", email_id)
    return Response(status_code=204)


@router.get(
    "/v1/usage",
    response_model=Usage,
    responses=errors.responses(401, 403, 422),
    operation_id="getUsage",
    description=(
        "Billable time from the audit log over [from, to): seconds per instance, plan and billing class "
        "(`billed`, `storage_only`, `not_billed`, from the lifecycle metadata: time degraded for lost data, "
        "with no server, is `storage_only`), and the allocated storage over that time in GB-seconds (the "
        "allocation in effect as it grew: the old size until a growth is applied, the new one after), "
        "with totals per plan and class. Exact to the second across plan changes, growths and restarts."
    ),
    summary="The organisation's usage over [from, to): seconds per instance, plan and billing class",
)
async def get_usage(
    request: Request,
    who: Caller,
    start: Annotated[datetime, Query(alias="from", description="RFC 3339 time with zone")],
    end: Annotated[datetime, Query(alias="to", description="RFC 3339 time with zone")],
) -> dict[str, Any]:
    async with app_state(request).pool.connection() as conn:
        as_of = await usage.db_now(conn)
        lines = await usage.usage_of_org(conn, who.org_id, start, end, as_of)
    totals = metering.totals_by(lines, "plan", "billing")
    storage = metering.totals_by(lines, "plan", "billing", field="gb_seconds")
    return {
        "organisation_id": who.org_id,
        "from": start,
        "to": end,
        "as_of": as_of,
        "items": [
            {
                "instance_id": line.instance_id,
                "plan": line.plan,
                "billing": line.billing,
                "seconds": line.seconds,
                "storage_gb_seconds": line.gb_seconds,
            }
            for line in lines
        ],
        "totals": [
            {
                "plan": plan,
                "billing": billing,
                "seconds": seconds,
                "storage_gb_seconds": storage[(plan, billing)],
            }
            for (plan, billing), seconds in totals.items()
        ],
    }


@router.get(
    "/v1/billing",
    response_model=Billing,
    responses=errors.responses(401, 403),
    operation_id="getBilling",
    description=(
        "The organisation's billing state: whether a billing hold is on, the subscription status, when a "
        "past-due grace period started and when the databases become read-only, and the policy (grace "
        "period, deprovisioning after a long suspension)."
    ),
    summary="The organisation's billing state: the hold, the grace period and when it ends, the policy",
)
async def get_billing(request: Request, who: Caller) -> dict[str, Any]:
    state = app_state(request)
    async with state.pool.connection() as conn:
        cursor = await conn.execute(sql.ORGANISATION_BILLING, {"id": who.org_id})
        row = await cursor.fetchone()
    assert row is not None
    return billing_policy.billing_view(dict(row), state.settings.billing)
