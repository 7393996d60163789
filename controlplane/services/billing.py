"""The billing use case: apply one verified Stripe event, exactly once, to its organisation's hold.

The event is stored by id (a duplicate is a no-op) in the transaction that applies its effect:
the hold is decided from the subscription status (`controlplane.billing.decide`, tolerant of
out-of-order delivery), and the organisation's instances get their suspend or resume jobs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from controlplane import billing, crashpoints, db, jobs, kinds, lifecycle, sql
from controlplane.db import AsyncConn
from controlplane.services.policy import Policy
from controlplane.transitions import Actor

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
        return StripeEventApplied(outcome)
    hold = decision.action is billing.Action.HOLD
    await conn.execute(
        sql.SET_BILLING_HOLD,
        {"hold": hold, "status": event.status, "created": event.created, "id": org["id"]},
    )
    if hold:
        kind = kinds.SUSPEND
        cursor = await conn.execute(sql.ORG_INSTANCES_IN, {"org": org["id"], "states": list(SUSPENDABLE)})
        payload: kinds.Payload = kinds.SuspendPayload(billing=True)
    else:
        kind = kinds.RESUME
        cursor = await conn.execute(
            sql.ORG_INSTANCES_SUSPENDED_BY_BILLING, {"org": org["id"], "states": list(RESUMABLE)}
        )
        payload = kinds.ResumePayload(billing=True)
    targets = [row["id"] for row in await cursor.fetchall()]
    await jobs.enqueue_many(
        conn,
        [
            jobs.NewJob(kind, target, payload=payload, max_attempts=policy.job_max_attempts)
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
    return StripeEventApplied(outcome, len(targets))


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
                "hold": decision.action is billing.Action.HOLD,
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
