"""The use cases called directly, as a console or a CLI would: no HTTP, typed requests and refusals."""

from __future__ import annotations

import pytest

from controlplane.audit import verify as audit
from controlplane.core import billing_rules as billing
from controlplane.core import kinds
from controlplane.core.refusals import (
    DeletionProtected,
    InvalidState,
    NameTaken,
    NotFound,
    PreconditionFailed,
)
from controlplane.db.connection import AsyncConn
from controlplane.db.transitions import Actor
from controlplane.services import instances
from controlplane.services.billing import apply_stripe_event
from controlplane.services.policy import Policy
from tests.factories import make_org, walk

CUSTOMER = Actor("customer", "key-1")
POLICY = Policy(job_max_attempts=3, pending_deadline_s=60)


async def _jobs(conn: AsyncConn) -> list[tuple[str, dict[str, object], int]]:
    cursor = await conn.execute("SELECT kind, payload, max_attempts FROM jobs ORDER BY created_at, kind")
    return [(r["kind"], r["payload"], r["max_attempts"]) for r in await cursor.fetchall()]


async def test_create_change_and_delete_without_the_api(conn: AsyncConn) -> None:
    org = await make_org(conn)
    asked = instances.CreateInstance(org, "orders", "dev", "local")
    created = await instances.create(conn, CUSTOMER, "req-1", asked, POLICY)
    inst = created.instance
    assert (inst.state, inst.plan, created.enqueued) == ("pending", "dev", kinds.PROVISION)
    assert await _jobs(conn) == [("provision", {}, 3)]

    with pytest.raises(NameTaken, match="orders"):
        await instances.create(conn, CUSTOMER, "req-2", asked, POLICY)
    assert (await (await conn.execute("SELECT count(*) AS n FROM instances")).fetchone()) == {"n": 1}

    stale = instances.Versions(frozenset({"1.1.0.0"}), '"1.1.0.0"')
    with pytest.raises(PreconditionFailed) as refused:
        await instances.change(
            conn, CUSTOMER, None, instances.ChangeInstance(org, inst.id, "small", None, stale), POLICY
        )
    assert refused.value.current_version == inst.state_version

    # Not ready yet: the new plan is recorded (a new generation) and applied once it is.
    changed = await instances.change(
        conn, CUSTOMER, None, instances.ChangeInstance(org, inst.id, "small"), POLICY
    )
    assert (changed.instance.plan, changed.instance.spec_generation, changed.enqueued) == ("small", 2, None)

    protect = instances.ChangeInstance(org, inst.id, deletion_protection=True)
    await instances.change(conn, CUSTOMER, None, protect, POLICY)
    with pytest.raises(DeletionProtected) as protected:
        await instances.request_deletion(
            conn, CUSTOMER, None, instances.RequestDeletion(org, inst.id), POLICY
        )
    assert protected.value.current_state == "pending" and "delete" not in protected.value.allowed_actions

    unprotect = instances.ChangeInstance(org, inst.id, deletion_protection=False)
    await instances.change(conn, CUSTOMER, None, unprotect, POLICY)
    await walk(conn, inst.id, "start_provisioning", "provisioned")
    deleted = await instances.request_deletion(
        conn, CUSTOMER, "req-3", instances.RequestDeletion(org, inst.id, skip_final_backup=True), POLICY
    )
    assert deleted.enqueued == kinds.DEPROVISION and deleted.instance.deletion_requested
    assert (await _jobs(conn))[-1] == ("deprovision", {"skip_final_backup": True}, 3)
    with pytest.raises(InvalidState, match="deletion has been requested"):
        await instances.change(conn, CUSTOMER, None, instances.ChangeInstance(org, inst.id, "medium"), POLICY)

    other_org = await make_org(conn)
    with pytest.raises(NotFound):
        await instances.load(conn, other_org, inst.id)
    assert await audit.verify(conn) == []


async def test_a_stripe_event_is_applied_once(conn: AsyncConn) -> None:
    org = await make_org(conn, stripe_customer_id="cus_1")
    created = await instances.create(conn, CUSTOMER, None, instances.CreateInstance(org, "a", "dev"), POLICY)
    await walk(conn, created.instance.id, "start_provisioning", "provisioned")
    event = billing.SubscriptionEvent("evt_1", "customer.subscription.updated", 100, "cus_1", "unpaid")
    first = await apply_stripe_event(conn, Actor("stripe", "evt_1"), None, event, POLICY)
    again = await apply_stripe_event(conn, Actor("stripe", "evt_1"), None, event, POLICY)
    assert (first.outcome, first.jobs_enqueued, again.outcome) == ("hold", 1, "duplicate")
    assert (await _jobs(conn))[-1] == ("suspend", {"billing": True}, 3)
