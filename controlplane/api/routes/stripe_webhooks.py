"""Stripe webhooks: verified on the raw body, then applied by the billing use case
(`controlplane.services.billing`: stored by event id with their outcome and effect)."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import stripe
from fastapi import APIRouter, Request

from controlplane.api import problems as errors
from controlplane.api.models import WebhookAck
from controlplane.api.problems import ProblemError
from controlplane.api.state import app_state
from controlplane.core import billing_rules as billing
from controlplane.db import connection as db
from controlplane.db.transitions import Actor
from controlplane.runtime import metrics
from controlplane.services.billing import apply_stripe_event

log = logging.getLogger(__name__)
router = APIRouter(tags=["webhooks"])


@router.post(
    "/v1/webhooks/stripe",
    response_model=WebhookAck,
    responses=errors.responses(400, 413, 503, signed=True),
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
    operation_id="receiveStripeEvent",
    description=(
        "Stripe's subscription events, verified against the webhook secret on the raw body; an event is "
        "applied once (a redelivery answers its first outcome)."
    ),
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
        # The signature only: its time is checked below, both ways (the library looks only back).
        stripe.WebhookSignature.verify_header(payload, signature, secret, tolerance=None)
    except stripe.SignatureVerificationError:
        metrics.WEBHOOKS.labels("bad_signature").inc()
        raise ProblemError("bad-signature", "the signature does not match or is too old") from None
    except ValueError:  # not UTF-8: it cannot have been signed as text
        metrics.WEBHOOKS.labels("bad_payload").inc()
        raise ProblemError("bad-request", "the payload is not a Stripe event") from None
    untimely = billing.signature_time_problem(signature, time.time())
    if untimely is not None:
        metrics.WEBHOOKS.labels("bad_signature").inc()
        log.warning("Stripe webhook refused: %s (check this host's clock if it keeps happening)", untimely)
        raise ProblemError("bad-signature", untimely)
    event = signed_event(payload)
    parsed = billing.parse_event(event)
    future = billing.created_problem(parsed.created, signature)
    if future is not None:
        metrics.WEBHOOKS.labels("bad_payload").inc()
        log.warning("Stripe webhook %r refused: %s", parsed.id, future)
        raise ProblemError("bad-request", future)
    actor, request_id = Actor("stripe", parsed.id), errors.request_id(request)
    applied = await db.in_transaction(
        app.pool, lambda conn: apply_stripe_event(conn, actor, request_id, parsed, app.policy)
    )
    metrics.WEBHOOKS.labels(applied.outcome).inc()
    return {"received": True, "outcome": applied.outcome}


def signed_event(payload: bytes) -> dict[str, Any]:
    """The event a verified body holds, or a 400 problem when it is not one the control plane can
    record whole: not JSON, nested too deep for the parser, not an event object, or holding text
    that no database can store (a lone surrogate such as "\\ud800": JSON can spell it, UTF-8 cannot).
    """
    why = None
    event: Any = None
    try:
        event = json.loads(payload)
    except RecursionError:
        why = "the payload is nested too deeply"
    except ValueError:
        why = "the payload is not a Stripe event"
    else:
        if not isinstance(event, dict) or not isinstance(event.get("id"), str):
            why = "the payload is not a Stripe event"
        elif not _storable(event):
            why = "the payload holds text that is not valid Unicode (a lone surrogate)"
    if why is not None:
        metrics.WEBHOOKS.labels("bad_payload").inc()
        raise ProblemError("bad-request", why)
    return dict(event)


def _storable(event: dict[str, Any]) -> bool:
    try:
        json.dumps(event, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
