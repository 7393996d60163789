"""The billing policy beyond suspend and resume: a past-due subscription's grace period (with its
notice, then the hold), and the deletion of instances suspended by billing for too long."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

from controlplane.core import billing_rules as billing
from controlplane.db.connection import AsyncConn
from controlplane.runtime.secretbox import load_box
from controlplane.runtime.settings import Settings
from controlplane.services import billing_policy, tenants
from controlplane.services import notifications as notification_service
from controlplane.services.billing import apply_stripe_event
from controlplane.services.policy import Policy
from tests.factories import TEST_ACTOR, make_instance, walk

RECONCILER = TEST_ACTOR


async def _one(conn: AsyncConn, query: str, *args: object) -> dict[str, Any]:
    cursor = await conn.execute(query, args)
    row = await cursor.fetchone()
    assert row is not None
    return dict(row)


async def test_past_due_starts_a_grace_period_with_a_notice_then_suspends(
    conn: AsyncConn, settings: Settings
) -> None:
    org, _ = await tenants.create_org(conn, "acme-grace", "cus_grace")
    await notification_service.register(
        conn,
        notification_service.NewTarget(org["id"], "email", "billing@example.com", ["billing.past_due"]),
        load_box(settings),
        settings.notifications,
    )
    instance = await make_instance(conn, org["id"])
    await walk(conn, instance["id"], "start_provisioning", "provisioned")
    policy = Policy.from_settings(settings)
    event = billing.SubscriptionEvent(
        "evt_1", "customer.subscription.updated", 1_800_000_000, "cus_grace", "past_due"
    )
    assert (await apply_stripe_event(conn, TEST_ACTOR, None, event, policy)).outcome == "no_change"
    state = await _one(
        conn, "SELECT billing_hold, past_due_since FROM organisations WHERE id = %s", org["id"]
    )
    since = state["past_due_since"]
    assert state["billing_hold"] is False and since is not None
    notice = await _one(conn, "SELECT event_type, body FROM notification_deliveries")
    grace = timedelta(seconds=settings.billing.grace_period_s)
    assert notice["event_type"] == "billing.past_due"
    assert notice["body"]["data"]["suspends_at"] == (since + grace).isoformat()
    view = billing_policy.billing_view(state | {"billing_status": "past_due"}, settings.billing)
    assert view["suspends_at"] == since + grace

    # A second past-due event neither moves the grace period nor notifies again.
    later = billing.SubscriptionEvent(
        "evt_2", "customer.subscription.updated", 1_800_000_100, "cus_grace", "past_due"
    )
    await apply_stripe_event(conn, TEST_ACTOR, None, later, policy)
    assert (await _one(conn, "SELECT count(*) FROM notification_deliveries"))["count"] == 1

    before = await billing_policy.enforce(
        conn, since + grace - timedelta(seconds=1), settings.billing, RECONCILER, policy
    )
    assert before.held == []
    after = await billing_policy.enforce(conn, since + grace, settings.billing, RECONCILER, policy)
    assert after.held == [org["id"]]
    job = await _one(
        conn, "SELECT kind, payload FROM jobs WHERE instance_id = %s AND kind = 'suspend'", instance["id"]
    )
    assert job["payload"] == {"billing": True}
    assert (await _one(conn, "SELECT billing_hold FROM organisations WHERE id = %s", org["id"]))[
        "billing_hold"
    ] is True

    # A payment ends it: the hold is released and the grace period forgotten.
    paid = billing.SubscriptionEvent(
        "evt_3", "customer.subscription.updated", 1_800_000_200, "cus_grace", "active"
    )
    assert (await apply_stripe_event(conn, TEST_ACTOR, None, paid, policy)).outcome == "release"
    state = await _one(
        conn, "SELECT billing_hold, past_due_since FROM organisations WHERE id = %s", org["id"]
    )
    assert state == {"billing_hold": False, "past_due_since": None}


async def test_instances_suspended_too_long_are_deleted_with_their_final_backup_only_when_asked(
    conn: AsyncConn, settings: Settings
) -> None:
    org, _ = await tenants.create_org(conn, "acme-long", "cus_long")
    instance = await make_instance(conn, org["id"])
    await walk(conn, instance["id"], "start_provisioning", "provisioned")
    await walk(conn, instance["id"], "suspend", patch={"suspended_by_billing": True})
    protected = await make_instance(conn, org["id"])
    await conn.execute("UPDATE instances SET deletion_protection = true WHERE id = %s", (protected["id"],))
    await walk(conn, protected["id"], "start_provisioning", "provisioned")
    await walk(conn, protected["id"], "suspend", patch={"suspended_by_billing": True})
    row = await _one(conn, "SELECT state_entered_at FROM instances WHERE id = %s", instance["id"])
    later = row["state_entered_at"] + timedelta(days=31)
    policy = Policy.from_settings(settings)
    off = await billing_policy.enforce(conn, later, settings.billing, RECONCILER, policy)
    assert off.deleted == []  # off by default
    on = settings.replace(deprovision_after_days=30)
    early = await billing_policy.enforce(conn, later - timedelta(days=2), on.billing, RECONCILER, policy)
    assert early.deleted == []
    done = await billing_policy.enforce(conn, later, on.billing, RECONCILER, policy)
    assert done.deleted == [instance["id"]]
    job = await _one(
        conn, "SELECT kind, payload FROM jobs WHERE instance_id = %s AND kind = 'deprovision'", instance["id"]
    )
    assert job["payload"].get("skip_final_backup") in (None, False)
    marked = await _one(
        conn, "SELECT deletion_requested_at, skip_final_backup FROM instances WHERE id = %s", instance["id"]
    )
    assert marked["deletion_requested_at"] is not None and marked["skip_final_backup"] is False
    audit = await _one(
        conn,
        "SELECT actor_kind, actor_id FROM job_events e JOIN jobs j ON j.id = e.job_id"
        " WHERE j.kind = 'deprovision'",
    )
    assert (audit["actor_kind"], audit["actor_id"]) == (RECONCILER.kind, RECONCILER.id)
    assert (await billing_policy.enforce(conn, later, on.billing, RECONCILER, policy)).deleted == []
    shown = billing_policy.deletes_at(row["state_entered_at"], on.billing)
    assert shown == row["state_entered_at"] + timedelta(days=30)
    assert uuid.UUID(str(protected["id"])) not in done.deleted
