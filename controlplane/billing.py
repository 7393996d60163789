"""Billing decisions (pure): what a Stripe subscription status means for an organisation's hold."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

# Subscription statuses that put the organisation on hold (its instances are suspended).
HOLD_STATUSES = frozenset({"unpaid", "canceled", "incomplete_expired", "paused"})
# Subscription statuses that lift the hold (instances suspended by billing resume).
RELEASE_STATUSES = frozenset({"active", "trialing"})
# Event types that carry a subscription object whose status we decide from.
SUBSCRIPTION_EVENT_TYPES = frozenset(
    {
        "customer.subscription.created",
        "customer.subscription.updated",
        "customer.subscription.deleted",
        "customer.subscription.paused",
        "customer.subscription.resumed",
    }
)


class Action(str, Enum):
    HOLD = "hold"
    RELEASE = "release"
    NO_CHANGE = "no_change"
    STALE = "stale"


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str

    @property
    def applies(self) -> bool:
        """True when the decision changes the organisation's billing record (hold or release)."""
        return self.action in (Action.HOLD, Action.RELEASE)


@dataclass(frozen=True)
class SubscriptionEvent:
    """The parts of a Stripe event that billing decisions read."""

    id: str
    type: str
    created: int
    customer_id: str | None
    status: str | None


def parse_event(event: Mapping[str, Any]) -> SubscriptionEvent:
    """Extract id, type, created, customer and subscription status from a Stripe event object."""
    obj = event.get("data", {}).get("object", {}) or {}
    customer = obj.get("customer") if isinstance(obj, Mapping) else None
    if isinstance(customer, Mapping):
        customer = customer.get("id")
    status = obj.get("status") if isinstance(obj, Mapping) else None
    return SubscriptionEvent(
        id=str(event["id"]),
        type=str(event.get("type", "")),
        created=int(event.get("created") or 0),
        customer_id=str(customer) if customer else None,
        status=str(status) if status else None,
    )


def is_subscription_event(event_type: str) -> bool:
    return event_type in SUBSCRIPTION_EVENT_TYPES


def decide(status: str | None, event_created: int, last_applied_created: int | None) -> Decision:
    """Hold, release, no change, or stale, from the subscription status and the event ordering.

    Only hold and release advance the organisation's watermark (`last_applied_created`), so a
    `past_due` event never hides an older decisive one that arrives after it.
    """
    if last_applied_created is not None and event_created < last_applied_created:
        return Decision(Action.STALE, f"event created at {event_created} is older than {last_applied_created}")
    if status in HOLD_STATUSES:
        return Decision(Action.HOLD, f"subscription {status}")
    if status in RELEASE_STATUSES:
        return Decision(Action.RELEASE, f"subscription {status}")
    return Decision(Action.NO_CHANGE, f"subscription {status or 'without status'}: no change")
