"""The billing use case: apply one verified Stripe event, exactly once, to its organisation's hold.

The event is stored by id (a duplicate is a no-op) in the transaction that applies its effect:
the hold is decided from the subscription status (`controlplane.core.billing_rules.decide`, tolerant of
out-of-order delivery), and the organisation's instances get their suspend or resume jobs.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from controlplane.core import billing_rules as billing
from controlplane.core import kinds, lifecycle
from controlplane.db import connection as db
from controlplane.db import job_rows as jobs
from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.db.transitions import Actor
from controlplane.runtime import crashpoints
from controlplane.services import notices
from controlplane.services.policy import Policy

log = logging.getLogger(__name__)

Outcome = Literal["duplicate", "ignored", "unknown_customer", "stale", "no_change", "hold", "release"]
# A hold suspends the instances that can be suspended; a release resumes those the hold suspended.
SUSPENDABLE = lifecycle.INSTANCE.states_allowing("suspend")
RESUMABLE = lifecycle.INSTANCE.states_allowing("resume")


@dataclass(frozen=True)
class StripeEventApplied:
    outcome: Outcome
    # The jobs enqueued for the organisation's instances (suspend on a hold, resume on a release).
    jobs_enqueued: int = 0


async def apply_stripe_event(
    conn: AsyncConn,
    actor: Actor,
    request_id: str | None,
    event: billing.SubscriptionEvent,
    policy: Policy,
) -> StripeEventApplied:
    """Store a verified Stripe event and apply its effect in one transaction."""
    async with db.transaction(conn):
        cursor = await conn.execute(
            sql.RECORD_STRIPE_EVENT,
            {
                "id": event.id,
                "type": event.type,
                "customer": event.customer_id,
                "created": event.created,
                "status": event.status,
            },
        )
        if await cursor.fetchone() is None:
            return StripeEventApplied("duplicate")
        crashpoints.reached("webhook.after_record")
        applied = await _apply(conn, event, actor, policy, request_id)
        await conn.execute(sql.SET_STRIPE_EVENT_OUTCOME, {"outcome": applied.outcome, "id": event.id})
    return applied


async def _apply(
    conn: AsyncConn,
    event: billing.SubscriptionEvent,
    actor: Actor,
    policy: Policy,
    request_id: str | None,
) -> StripeEventApplied:
    if not billing.is_subscription_event(event.type) or event.customer_id is None:
        return StripeEventApplied("ignored")
    cursor = await conn.execute(sql.LOCK_ORGANISATION_OF_CUSTOMER, {"customer": event.customer_id})
    org = await cursor.fetchone()
    if org is None:
        return StripeEventApplied("unknown_customer")
    decision = billing.decide(event.status, event.created, org["billing_event_created"])
    outcome: Outcome = decision.action.value
    if not decision.applies:
        if event.status == "past_due" and decision.action is billing.HoldAction.NO_CHANGE:
            await _past_due(conn, org["id"], event, policy)
        return StripeEventApplied(outcome)
    hold = decision.action is billing.HoldAction.HOLD
    await conn.execute(
        sql.SET_BILLING_HOLD,
        {"hold": hold, "status": event.status, "created": event.created, "id": org["id"]},
    )
    await conn.execute(sql.CLEAR_PAST_DUE, {"id": org["id"]})
    if hold:
        count = await hold_instances(conn, org["id"], actor, policy, request_id)
        kind = kinds.SUSPEND
    else:
        kind = kinds.RESUME
        cursor = await conn.execute(
            sql.ORG_INSTANCES_SUSPENDED_BY_BILLING, {"org": org["id"], "states": list(RESUMABLE)}
        )
        targets = [row["id"] for row in await cursor.fetchall()]
        payload = kinds.ResumePayload(billing=True)
        await _enqueue_all(conn, kind, targets, payload, actor, policy, request_id)
        count = len(targets)
    log.info(
        "billing %s for organisation %s (%s): %d %s job(s)",
        decision.action.value,
        org["id"],
        decision.reason,
        count,
        kind,
    )
    return StripeEventApplied(outcome, count)


async def hold_instances(
    conn: AsyncConn, org_id: uuid.UUID, actor: Actor, policy: Policy, request_id: str | None
) -> int:
    """Enqueue the suspension of the organisation's instances that can be suspended (a hold)."""
    cursor = await conn.execute(sql.ORG_INSTANCES_IN, {"org": org_id, "states": list(SUSPENDABLE)})
    targets = [row["id"] for row in await cursor.fetchall()]
    payload = kinds.SuspendPayload(billing=True)
    await _enqueue_all(conn, kinds.SUSPEND, targets, payload, actor, policy, request_id)
    return len(targets)


async def _enqueue_all(
    conn: AsyncConn,
    kind: str,
    targets: list[uuid.UUID],
    payload: kinds.Payload,
    actor: Actor,
    policy: Policy,
    request_id: str | None,
) -> None:
    await jobs.enqueue_many(
        conn,
        [
            jobs.NewJob(kind, target, payload=payload, max_attempts=policy.job_max_attempts)
            for target in targets
        ],
        actor,
        request_id=request_id,
    )


async def _past_due(
    conn: AsyncConn, org_id: uuid.UUID, event: billing.SubscriptionEvent, policy: Policy
) -> None:
    """Start the grace period (once) and tell the customer when the databases become read-only."""
    cursor = await conn.execute(
        sql.MARK_PAST_DUE, {"id": org_id, "created": event.created, "status": event.status}
    )
    row = await cursor.fetchone()
    assert row is not None
    if not row["started"]:
        return
    suspends_at = row["past_due_since"] + timedelta(seconds=policy.grace_period_s)
    body = {
        "id": f"evt_billing_{event.id}",
        "type": "billing.past_due",
        "created": event.created,
        "organisation_id": str(org_id),
        "data": {
            "past_due_since": row["past_due_since"].isoformat(),
            "suspends_at": suspends_at.isoformat(),
            "message": "The subscription is past due: the databases become read-only on"
            f" {suspends_at:%Y-%m-%d %H:%M} UTC unless the invoice is paid.",
        },
    }
    await notices.queue_notice(conn, org_id, None, "billing.past_due", body)


async def apply_on_mapping(conn: AsyncConn, org_id: object, customer_id: str) -> str | None:
    """An organisation was just linked to `customer_id` (in the caller's transaction): the newest
    decisive event that arrived for that customer before (recorded as `unknown_customer`) decides
    its hold now, as it would have had the link existed (a later `past_due` does not hide it). A
    new organisation has no instance yet, so only the hold is recorded; the event's outcome
    becomes `hold_on_mapping` or `release_on_mapping`. Returns that outcome, or None when no
    such event is held."""
    decisive = sorted(billing.HOLD_STATUSES | billing.RELEASE_STATUSES)
    cursor = await conn.execute(
        sql.NEWEST_UNMAPPED_STRIPE_EVENT, {"customer": customer_id, "decisive": decisive}
    )
    event = await cursor.fetchone()
    if event is None:
        return None
    decision = billing.decide(event["status"], event["created"], None)
    if decision.applies:
        await conn.execute(
            sql.SET_BILLING_HOLD,
            {
                "hold": decision.action is billing.HoldAction.HOLD,
                "status": event["status"],
                "created": event["created"],
                "id": org_id,
            },
        )
    outcome = f"{decision.action.value}_on_mapping"
    await conn.execute(sql.SET_STRIPE_EVENT_OUTCOME, {"outcome": outcome, "id": event["id"]})
    log.info(
        "billing %s for organisation %s from event %s, received before the link", outcome, org_id, event["id"]
    )
    return outcome
