"""Billing decisions (pure): what a Stripe subscription status means for an organisation's hold."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
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


class HoldAction(StrEnum):
    HOLD = "hold"
    RELEASE = "release"
    NO_CHANGE = "no_change"
    STALE = "stale"


@dataclass(frozen=True)
class HoldDecision:
    action: HoldAction
    reason: str

    @property
    def applies(self) -> bool:
        """True when the decision changes the organisation's billing record (hold or release)."""
        return self.action in (HoldAction.HOLD, HoldAction.RELEASE)


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
    data = event.get("data")
    obj = data.get("object") if isinstance(data, Mapping) else None
    obj = obj if isinstance(obj, Mapping) else {}
    customer = obj.get("customer")
    if isinstance(customer, Mapping):
        customer = customer.get("id")
    status = obj.get("status")
    created = event.get("created")
    return SubscriptionEvent(
        id=str(event["id"]),
        type=str(event.get("type", "")),
        created=created if isinstance(created, int) and not isinstance(created, bool) else 0,
        customer_id=customer if isinstance(customer, str) and customer else None,
        status=status if isinstance(status, str) and status else None,
    )


def is_subscription_event(event_type: str) -> bool:
    return event_type in SUBSCRIPTION_EVENT_TYPES


def decide(status: str | None, event_created: int, last_applied_created: int | None) -> HoldDecision:
    """Hold, release, no change, or stale, from the subscription status and the event ordering.

    Only hold and release advance the organisation's watermark (`last_applied_created`), so a
    `past_due` event never hides an older decisive one that arrives after it.
    """
    if last_applied_created is not None and event_created < last_applied_created:
        return HoldDecision(
            HoldAction.STALE,
            f"event of {event_created} is older than the last applied ({last_applied_created})",
        )
    if status in HOLD_STATUSES:
        return HoldDecision(HoldAction.HOLD, f"subscription {status}")
    if status in RELEASE_STATUSES:
        return HoldDecision(HoldAction.RELEASE, f"subscription {status}")
    return HoldDecision(HoldAction.NO_CHANGE, f"subscription {status or 'without status'}: no change")


# How far a signature's timestamp may be from our clock, either way (Stripe's default, 300 s).
SIGNATURE_TOLERANCE_S = 300


def signed_at(header: str) -> int | None:
    """The time (`t=`) of a Stripe-Signature header, or None when it has none."""
    stamps = [part[2:] for part in header.split(",") if part.startswith("t=")]
    try:
        return int(stamps[0])
    except (IndexError, ValueError):
        return None


def signature_time_problem(header: str, now: float, tolerance_s: float = SIGNATURE_TOLERANCE_S) -> str | None:
    """Why the `t=` of a (verified) Stripe-Signature header is not acceptable at `now`, or None.

    Stripe's library refuses only a timestamp too far in the past; one in the future is refused
    here too: a signature made "later" than now is a replay prepared in advance or a clock that
    is wrong, and in both cases the event must not be applied.
    """
    timestamp = signed_at(header)
    if timestamp is None:
        return "the signature has no timestamp"
    if timestamp < now - tolerance_s:
        return f"the signature is {now - timestamp:.0f} s old (more than {tolerance_s:.0f} s)"
    if timestamp > now + tolerance_s:
        return f"the signature is dated {timestamp - now:.0f} s ahead of our clock (over {tolerance_s:.0f} s)"
    return None


def created_problem(created: int, header: str, tolerance_s: float = SIGNATURE_TOLERANCE_S) -> str | None:
    """Why a verified event's `created` cannot order it, or None: it is later than the signature's
    time (beyond the tolerance), which Stripe never sends (an event exists before any delivery of it
    is signed). Taken as the organisation's watermark, such a time would make every genuine event
    that follows `stale` until that moment came."""
    timestamp = signed_at(header)
    if timestamp is not None and created > timestamp + tolerance_s:
        return (
            f"the event's created time is {created - timestamp} s after its signature's"
            f" (over {tolerance_s:.0f} s): an event is created before it is sent"
        )
    return None
