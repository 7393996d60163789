"""The pure billing decision: statuses, ordering, and event parsing."""

from __future__ import annotations

import pytest

from controlplane.core import billing_rules as billing
from controlplane.core.billing_rules import HoldAction


@pytest.mark.parametrize("status", ["unpaid", "canceled", "incomplete_expired", "paused"])
def test_hold_statuses(status: str) -> None:
    assert billing.decide(status, 10, None).action is HoldAction.HOLD


@pytest.mark.parametrize("status", ["active", "trialing"])
def test_release_statuses(status: str) -> None:
    assert billing.decide(status, 10, 5).action is HoldAction.RELEASE


@pytest.mark.parametrize("status", ["past_due", "incomplete", None, "something-new"])
def test_other_statuses_change_nothing(status: str | None) -> None:
    decision = billing.decide(status, 10, None)
    assert decision.action is HoldAction.NO_CHANGE and not decision.applies


def test_an_event_older_than_the_last_applied_is_stale() -> None:
    assert billing.decide("unpaid", 9, 10).action is HoldAction.STALE
    assert billing.decide("unpaid", 10, 10).action is HoldAction.HOLD  # same second: applied in arrival order


def test_parse_event_reads_subscription_fields_defensively() -> None:
    event = {
        "id": "evt_1",
        "type": "customer.subscription.updated",
        "created": 123,
        "data": {"object": {"customer": "cus_1", "status": "unpaid"}},
    }
    parsed = billing.parse_event(event)
    assert (parsed.customer_id, parsed.status, parsed.created) == ("cus_1", "unpaid", 123)
    odd = billing.parse_event({"id": "evt_2", "data": "x", "created": "soon"})
    assert (odd.customer_id, odd.status, odd.created, odd.type) == (None, None, 0, "")
    nested = billing.parse_event({"id": "e", "data": {"object": {"customer": {"id": "cus_2"}}}})
    assert nested.customer_id == "cus_2"
    assert billing.is_subscription_event("customer.subscription.deleted")
    assert not billing.is_subscription_event("invoice.paid")


def test_a_created_time_later_than_the_signature_beyond_the_tolerance_is_refused() -> None:
    header = "t=1000,v1=x"
    assert billing.signed_at(header) == 1000 and billing.signed_at("v1=x") is None
    assert billing.created_problem(1000, header) is None
    assert billing.created_problem(1300, header) is None
    assert billing.created_problem(1301, header) is not None
    assert billing.created_problem(0, header) is None  # old events are ordered by decide: stale
