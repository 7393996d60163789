"""Usage reported to Stripe: the real `stripe` client against a recording server on loopback; each
period once, through the job queue, even when Stripe's first answers are errors; reconciled with
the usage recomputed from the log."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

from controlplane.core import metering
from controlplane.db import job_rows as jobs
from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.handlers import operations
from controlplane.handlers.usage_reports import event_names
from controlplane.runtime.settings import Settings
from controlplane.services import usage
from controlplane.services.usage import REPORT_USAGE
from provisioners.noop import NoopProvisioner
from tests.factories import TEST_ACTOR, append_event, make_org
from tests.operations_support import run_until
from tests.stripe_server import API_KEY, stripe_server

HOUR = timedelta(hours=1)
# (minutes after the start, event, state reached, detail)
SCRIPT: list[tuple[float, str, str, dict[str, Any]]] = [
    (0, "start_provisioning", "provisioning", {}),
    (10, "provisioned", "ready", {}),
    (100, "suspend", "suspended", {}),
    (130, "resume", "ready", {}),
]


async def scripted_instance(
    conn: AsyncConn, org: uuid.UUID, start: datetime, plan: str = "standard"
) -> uuid.UUID:
    """An instance whose log is SCRIPT from `start` (its creation moved back to `start`)."""
    cursor = await conn.execute(
        "INSERT INTO instances (org_id, name, spec, state) VALUES (%s, %s, %s, 'pending') RETURNING id",
        (org, f"db-{uuid.uuid4().hex[:6]}", f'{{"plan": "{plan}", "region": "local"}}'),
    )
    row = await cursor.fetchone()
    assert row is not None
    instance: uuid.UUID = row["id"]
    await conn.execute("UPDATE instances SET created_at = %s WHERE id = %s", (start, instance))
    await append_event(
        conn, "instance", instance, None, "pending", "create", 0, at=start, detail={"spec": {"plan": plan}}
    )
    previous = "pending"
    for version, (minute, event, state, detail) in enumerate(SCRIPT, start=1):
        at = start + timedelta(minutes=minute)
        await append_event(conn, "instance", instance, previous, state, event, version, at=at, detail=detail)
        previous = state
    return instance


async def _reports_done(conn: AsyncConn) -> bool:
    cursor = await conn.execute(
        "SELECT count(*) FILTER (WHERE state NOT IN ('completed', 'abandoned')) AS live,"
        " count(*) FILTER (WHERE state = 'abandoned') AS abandoned FROM jobs WHERE kind = %s",
        (REPORT_USAGE,),
    )
    row = await cursor.fetchone()
    assert row is not None and row["abandoned"] == 0
    return bool(row["live"] == 0)


async def test_each_period_reaches_stripe_once_despite_an_outage_and_matches_the_log(
    conn: AsyncConn, settings: Settings
) -> None:
    now = await usage.db_now(conn)
    start = metering.period_floor(now - 4 * HOUR, HOUR)
    await conn.execute("SELECT cp_ensure_event_partitions(%s, %s)", (now, start))
    org = await make_org(conn, stripe_customer_id="cus_metered")
    instance = await scripted_instance(conn, org, start)
    await make_org(conn)  # an organisation without a Stripe customer is not reported
    settle = timedelta(minutes=5)
    # The first pass reports the last settled period only; later passes each period after it.
    assert await usage.enqueue_due_reports(conn, start + HOUR + settle, HOUR, settle, TEST_ACTOR, 50) == [
        start
    ]
    later = await usage.enqueue_due_reports(conn, start + 3 * HOUR + settle, HOUR, settle, TEST_ACTOR, 50)
    assert later == [start + HOUR, start + 2 * HOUR]
    assert (
        await usage.enqueue_due_reports(conn, start + 3 * HOUR + settle, HOUR, settle, TEST_ACTOR, 50) == []
    )

    with stripe_server(fail_first=3) as (base, recorder):
        configured = settings.replace(stripe_api_key=API_KEY, stripe_api_base=base)
        registry = operations.registry(NoopProvisioner())
        await run_until(
            configured, registry, _reports_done, timeout_s=120, supervise_at=now + timedelta(days=1)
        )
        assert recorder.failed == 3 and recorder.problems == [] and recorder.duplicates == 0
        sent = {
            (e["timestamp"], e["event_name"], e["payload"]["plan"]): int(e["payload"]["value"])
            for e in recorder.accepted.values()
        }
        t = [int((start + n * HOUR).timestamp()) for n in range(3)]
        compute, storage = "database_compute_seconds", "database_storage_seconds"
        assert sent == {
            (t[0], compute, "standard"): 50 * 60,
            (t[1], compute, "standard"): 40 * 60,
            (t[1], storage, "standard"): 20 * 60,
            (t[2], compute, "standard"): 50 * 60,
            (t[2], storage, "standard"): 10 * 60,
        }
        assert {e["payload"]["stripe_customer_id"] for e in recorder.accepted.values()} == {"cus_metered"}
        assert {e["payload"]["instance_id"] for e in recorder.accepted.values()} == {str(instance)}

        # Reconciliation: the usage recomputed from the log is what Stripe acknowledged.
        recomputed = {}
        for n in range(3):
            for event in await usage.period_events(
                conn, start + n * HOUR, start + (n + 1) * HOUR, event_names(configured.billing)
            ):
                recomputed[event.identifier] = event.value
        cursor = await conn.execute(sql.METER_EVENTS_SENT)
        recorded = {row["identifier"]: row["value"] for row in await cursor.fetchall()}
        accepted = {identifier: int(e["payload"]["value"]) for identifier, e in recorder.accepted.items()}
        assert recomputed == recorded == accepted

        # A report run again (a crash after Stripe answered, before it was recorded) bills nothing twice.
        await conn.execute("DELETE FROM meter_events_sent WHERE period_start = %s", (start,))
        period = {"period_start": start.isoformat(), "period_end": (start + HOUR).isoformat()}
        await jobs.enqueue(conn, jobs.NewJob(REPORT_USAGE, None, payload=period), TEST_ACTOR)
        requests = recorder.requests
        await run_until(configured, registry, _reports_done, timeout_s=120)
        assert recorder.requests == requests + 1 and recorder.duplicates == 0
        assert len(recorder.accepted) == 5
        # The same a day later, when Stripe no longer remembers the Idempotency-Key: it refuses the
        # identifier it has, and the report records the event as sent.
        await conn.execute("DELETE FROM meter_events_sent WHERE period_start = %s", (start,))
        recorder.by_key.clear()
        await jobs.enqueue(conn, jobs.NewJob(REPORT_USAGE, None, payload=period), TEST_ACTOR)
        await run_until(configured, registry, _reports_done, timeout_s=120)
        assert recorder.duplicates == 1 and len(recorder.accepted) == 5
        cursor = await conn.execute(
            "SELECT count(*) FROM meter_events_sent WHERE period_start = %s", (start,)
        )
        row = await cursor.fetchone()
        assert row is not None and row["count"] == 1
