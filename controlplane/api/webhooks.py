"""Stripe webhooks: verified on the raw body, then applied by the billing use case
(`controlplane.services.billing`: stored by event id with their outcome and effect)."""

from __future__ import annotations

import json
from typing import Any

import stripe
from fastapi import APIRouter, Request

from controlplane import billing, metrics
from controlplane.api import errors
from controlplane.api.errors import ProblemError
from controlplane.api.models import WebhookAck
from controlplane.api.state import app_state
from controlplane.services.billing import apply_stripe_event
from controlplane.transitions import Actor

router = APIRouter(tags=["webhooks"])


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
    configured = app.settings.billing.stripe_webhook_secret
    secret = None if configured is None else configured.get_secret_value()
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
    parsed = billing.parse_event(event)
    async with app.pool.connection() as conn:
        applied = await apply_stripe_event(
            conn, Actor("stripe", parsed.id), errors.request_id(request), parsed, app.policy
        )
    metrics.WEBHOOKS.labels(applied.outcome).inc()
    return {"received": True, "outcome": applied.outcome}
