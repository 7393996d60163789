"""The billing policy beyond suspend and resume: the grace period after `past_due`, and the optional
deletion of instances suspended by billing for too long (with their final backup).

A `past_due` subscription starts the organisation's grace period (and notifies it, naming the
date its databases become read-only); once the period is over the reconciler puts the
organisation on hold, which suspends its instances as an unpaid subscription does. A payment
(active) ends the grace period or the hold. With `CONTROLPLANE_DEPROVISION_AFTER_DAYS` set, an
instance suspended by billing for that long is deleted by the reconciler (its final backup is
kept; the deletion's audit rows name the reconciler and why). Both dates are shown to the
customer (`billing_view`).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from controlplane.core.refusals import DomainError
from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.db.transitions import Actor
from controlplane.runtime.settings import BillingSettings
from controlplane.services import instances
from controlplane.services.billing import hold_instances
from controlplane.services.policy import Policy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Enforced:
    held: list[uuid.UUID]
    deleted: list[uuid.UUID]


async def enforce(
    conn: AsyncConn, now: datetime, billing: BillingSettings, actor: Actor, policy: Policy
) -> Enforced:
    """Hold the organisations whose grace period is over; delete instances suspended too long."""
    held: list[uuid.UUID] = []
    async with conn.transaction():
        cursor = await conn.execute(sql.GRACE_OVER, {"grace_s": billing.grace_period_s, "now": now})
        for row in await cursor.fetchall():
            await conn.execute(sql.HOLD_AFTER_GRACE, {"id": row["id"]})
            count = await hold_instances(conn, row["id"], actor, policy, None)
            log.warning("organisation %s: grace period over; %d instance(s) to suspend", row["id"], count)
            held.append(row["id"])
    deleted: list[uuid.UUID] = []
    if billing.deprovision_after_days is not None:
        after_s = billing.deprovision_after_days * 86400
        cursor = await conn.execute(sql.LONG_SUSPENDED, {"after_s": after_s, "now": now})
        for row in await cursor.fetchall():
            request = instances.RequestDeletion(row["org_id"], row["id"], skip_final_backup=False)
            try:
                await instances.request_deletion(conn, actor, None, request, policy)
            except DomainError as exc:  # moved meanwhile (resumed, protected): not deleted
                log.info("instance %s not deleted after its suspension: %s", row["id"], exc)
                continue
            log.warning(
                "instance %s: suspended by billing since %s, over %s days; deleted with a final backup",
                row["id"],
                row["state_entered_at"],
                billing.deprovision_after_days,
            )
            deleted.append(row["id"])
    return Enforced(held, deleted)


def billing_view(org: dict[str, Any], billing: BillingSettings) -> dict[str, Any]:
    """What a customer sees of the organisation's billing: the hold, the grace period, the policy."""
    since = org.get("past_due_since")
    suspends_at = (
        since + timedelta(seconds=billing.grace_period_s) if since and not org["billing_hold"] else None
    )
    return {
        "hold": bool(org["billing_hold"]),
        "status": org.get("billing_status"),
        "past_due_since": since,
        "suspends_at": suspends_at,
        "grace_period_s": billing.grace_period_s,
        "deprovision_after_days": billing.deprovision_after_days,
    }


def deletes_at(suspended_since: datetime | None, billing: BillingSettings) -> datetime | None:
    """When an instance suspended by billing since `suspended_since` is deleted (None: never)."""
    if suspended_since is None or billing.deprovision_after_days is None:
        return None
    return suspended_since + timedelta(days=billing.deprovision_after_days)
