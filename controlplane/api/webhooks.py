"""Stripe webhooks: verified on the raw body, recorded by event id with their outcome and effect."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import stripe
from fastapi import APIRouter, Request

from controlplane import billing, jobs, kinds, metrics
from controlplane.api import errors
from controlplane.api.errors import ProblemError
from controlplane.api.models import WebhookAck
from controlplane.api.state import app_state
from controlplane.db import AsyncConn
from controlplane.transitions import Actor

log = logging.getLogger(__name__)

router = APIRouter(tags=["webhooks"])


async def record_event(
    conn: AsyncConn, event: Mapping[str, Any], *, max_attempts: int = 5, request_id: str | None = None
) -> str:
    """Store a verified Stripe event and apply its effect in one transaction; return the outcome.

    Outcomes: duplicate, ignored, unknown_customer, stale, no_change, hold, release.
    """
    parsed = billing.parse_event(event)
    actor = Actor("stripe", parsed.id)
    async with conn.transaction():
        cursor = await conn.execute(
            "INSERT INTO stripe_events (id, type, customer_id, created, outcome)"
            " VALUES (%s, %s, %s, %s, 'received') ON CONFLICT (id) DO NOTHING RETURNING id",
            (parsed.id, parsed.type, parsed.customer_id, parsed.created),
        )
        if await cursor.fetchone() is None:
            return "duplicate"
        outcome = await _apply(conn, parsed, actor, max_attempts, request_id)
        await conn.execute("UPDATE stripe_events SET outcome = %s WHERE id = %s", (outcome, parsed.id))
    return outcome


async def _apply(
    conn: AsyncConn,
    event: billing.SubscriptionEvent,
    actor: Actor,
    max_attempts: int,
    request_id: str | None,
) -> str:
    if not billing.is_subscription_event(event.type) or event.customer_id is None:
        return "ignored"
    cursor = await conn.execute(
        "SELECT id, billing_event_created FROM organisations WHERE stripe_customer_id = %s FOR UPDATE",
        (event.customer_id,),
    )
    org = await cursor.fetchone()
    if org is None:
        return "unknown_customer"
    decision = billing.decide(event.status, event.created, org["billing_event_created"])
    if not decision.applies:
        return decision.action.value
    hold = decision.action is billing.Action.HOLD
    await conn.execute(
        "UPDATE organisations SET billing_hold = %s, billing_status = %s, billing_event_created = %s"
        " WHERE id = %s",
        (hold, event.status, event.created, org["id"]),
    )
    if hold:
        kind = kinds.SUSPEND
        query = "SELECT id FROM instances WHERE org_id = %s AND state = 'ready'"
    else:
        kind = kinds.RESUME
        query = "SELECT id FROM instances WHERE org_id = %s AND state = 'suspended' AND suspended_by_billing"
    targets = [row["id"] for row in await (await conn.execute(query, (org["id"],))).fetchall()]
    await jobs.enqueue_many(
        conn,
        [
            jobs.NewJob(kind, target, payload={"billing": True}, max_attempts=max_attempts)
            for target in targets
        ],
        actor,
        request_id=request_id,
    )
    log.info(
        "billing %s for organisation %s (%s): %d %s job(s)",
        decision.action.value,
        org["id"],
        decision.reason,
        len(targets),
        kind,
    )
    return decision.action.value


@router.post(
    "/v1/webhooks/stripe",
    response_model=WebhookAck,
    responses=errors.responses(400, 413, 503),
    summary="Stripe events (signed with the webhook secret)",
    openapi_extra={
        "parameters": [
            {
                "name": "Stripe-Signature",
                "in": "header",
                "required": True,
                "schema": {"type": "string"},
                "description": "t=<unix time>,v1=<HMAC-SHA256 of 't.<raw body>' keyed by the webhook secret>",
            }
        ],
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"type": "object", "description": "a Stripe event"}}},
        },
    },
)
async def stripe_webhook(request: Request) -> Any:
    app = app_state(request)
    secret = app.settings.stripe_webhook_secret
    if not secret:
        raise ProblemError("unavailable", "Stripe webhooks are not configured (no webhook secret)")
    payload = await request.body()
    signature = request.headers.get("stripe-signature")
    if not signature:
        metrics.WEBHOOKS.labels("bad_signature").inc()
        raise ProblemError("bad-signature", "the Stripe-Signature header is missing")
    try:
        stripe.Webhook.construct_event(payload, signature, secret)
        event = json.loads(payload)
    except stripe.SignatureVerificationError:
        metrics.WEBHOOKS.labels("bad_signature").inc()
        raise ProblemError("bad-signature", "the signature does not match or is too old") from None
    except (ValueError, TypeError, AttributeError, KeyError):
        # Signed, but not a JSON object the library can turn into an event.
        metrics.WEBHOOKS.labels("bad_payload").inc()
        raise ProblemError("bad-request", "the payload is not a Stripe event") from None
    if not isinstance(event, dict) or not isinstance(event.get("id"), str):
        metrics.WEBHOOKS.labels("bad_payload").inc()
        raise ProblemError("bad-request", "the payload is not a Stripe event")
    request_id = getattr(request.state, "request_id", None)
    async with app.pool.connection() as conn:
        outcome = await record_event(
            conn, event, max_attempts=app.settings.job_max_attempts, request_id=request_id
        )
    metrics.WEBHOOKS.labels(outcome).inc()
    return {"received": True, "outcome": outcome}
