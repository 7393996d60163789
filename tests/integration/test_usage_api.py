"""GET /v1/usage over a scripted week: exact to the second per instance, plan and billing class,
scoped to the organisation, problem+json on bad input."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

import httpx

from controlplane.core import metering
from controlplane.db.connection import AsyncConn
from controlplane.services import tenants, usage
from tests.factories import append_event, make_instance, walk

pytest_plugins = ("tests.api_fixtures",)

DAY = timedelta(days=1)
# A week from a midnight: (offset, event, state reached, detail).
WEEK: list[tuple[timedelta, str, str, dict[str, Any]]] = [
    (timedelta(minutes=1), "start_provisioning", "provisioning", {}),
    (timedelta(minutes=3, seconds=20), "provisioned", "ready", {}),
    (DAY + timedelta(hours=10), "update", "updating", {}),
    (DAY + timedelta(hours=10, minutes=2, seconds=7), "updated", "ready", {"plan": "large"}),
    (3 * DAY, "suspend", "suspended", {}),
    (3 * DAY + timedelta(hours=6), "resume", "ready", {}),
    (5 * DAY + timedelta(hours=12), "deprovision", "deprovisioning", {}),
    (5 * DAY + timedelta(hours=12, minutes=4), "deprovisioned", "deleted", {"backup": "final-1"}),
]


async def scripted_week(conn: AsyncConn, org: uuid.UUID, start: datetime, name: str) -> uuid.UUID:
    cursor = await conn.execute(
        "INSERT INTO instances (org_id, name, spec, state, created_at)"
        " VALUES (%s, %s, %s, 'pending', %s) RETURNING id",
        (org, name, '{"plan": "small", "region": "local"}', start),
    )
    row = await cursor.fetchone()
    assert row is not None
    instance: uuid.UUID = row["id"]
    await append_event(
        conn, "instance", instance, None, "pending", "create", 0, at=start, detail={"spec": {"plan": "small"}}
    )
    previous = "pending"
    for version, (offset, event, state, detail) in enumerate(WEEK, start=1):
        await append_event(
            conn, "instance", instance, previous, state, event, version, at=start + offset, detail=detail
        )
        previous = state
    return instance


async def test_the_usage_of_a_scripted_week_is_exact_and_the_organisations_own(
    conn: AsyncConn, client: httpx.AsyncClient
) -> None:
    org, key = await tenants.create_org(conn, "acme-usage")
    other, _ = await tenants.create_org(conn, "globex-usage")
    now = await usage.db_now(conn)
    start = metering.period_floor(now - 8 * DAY, DAY)
    await conn.execute("SELECT cp_ensure_event_partitions(%s, %s)", (now, start))
    instance = await scripted_week(conn, org["id"], start, "orders")
    await scripted_week(conn, other["id"], start, "theirs")
    params = {"from": start.isoformat(), "to": (start + 7 * DAY).isoformat()}
    answer = await client.get(
        "/v1/usage", params=params, headers={"Authorization": f"Bearer {key.plaintext}"}
    )
    assert answer.status_code == 200, answer.text
    report = answer.json()
    got = {(item["plan"], item["billing"]): item["seconds"] for item in report["items"]}
    assert {item["instance_id"] for item in report["items"]} == {str(instance)}
    ready_small = DAY + timedelta(hours=10) - timedelta(minutes=3, seconds=20)
    updating = timedelta(minutes=2, seconds=7)
    ready_large = (3 * DAY - (DAY + timedelta(hours=10, minutes=2, seconds=7))) + (
        5 * DAY + timedelta(hours=12) - (3 * DAY + timedelta(hours=6))
    )
    assert got == {
        ("small", "not_billed"): (timedelta(minutes=3, seconds=20) + timedelta(0)).total_seconds(),
        ("small", "billed"): (ready_small + updating).total_seconds(),
        ("large", "billed"): ready_large.total_seconds(),
        ("large", "storage_only"): timedelta(hours=6).total_seconds(),
        ("large", "not_billed"): timedelta(minutes=4).total_seconds(),
    }
    assert sum(got.values()) == (5 * DAY + timedelta(hours=12, minutes=4)).total_seconds()
    print("\n--- usage of a scripted week ---")
    for item in report["totals"]:
        print(
            f"{item['plan']:>6} {item['billing']:>13} {item['seconds']:>10.0f} s"
            f"  {item['seconds'] / 3600:8.3f} h"
        )


async def test_storage_grown_mid_period_is_billed_at_the_old_size_until_the_growth_and_the_new_after(
    conn: AsyncConn, client: httpx.AsyncClient
) -> None:
    """A dev database (1 GB) grown to 3 GB at 1:20 (the update applied at 1:21), then to 4 GB at
    2:40: the usage API and the period's Stripe meter events count each size for its own time."""
    org, key = await tenants.create_org(conn, "acme-grown")
    await conn.execute(
        "UPDATE organisations SET stripe_customer_id = 'cus_grown' WHERE id = %s", (org["id"],)
    )
    now = await usage.db_now(conn)
    start = metering.period_floor(now - 2 * DAY, DAY)
    await conn.execute("SELECT cp_ensure_event_partitions(%s, %s)", (now, start))
    cursor = await conn.execute(
        "INSERT INTO instances (org_id, name, spec, state, created_at)"
        " VALUES (%s, 'grown', '{\"plan\": \"dev\"}', 'pending', %s) RETURNING id",
        (org["id"], start),
    )
    row = await cursor.fetchone()
    assert row is not None
    instance: uuid.UUID = row["id"]
    await append_event(
        conn, "instance", instance, None, "pending", "create", 0, at=start, detail={"spec": {"plan": "dev"}}
    )
    minute = timedelta(minutes=1)
    moves: list[tuple[timedelta, str, str, str, dict[str, Any]]] = [
        (timedelta(0), "pending", "start_provisioning", "provisioning", {}),
        (10 * minute, "provisioning", "provisioned", "ready", {"plan": "dev"}),
        (80 * minute, "ready", "update", "updating", {"storage_gb": 3}),
        (81 * minute, "updating", "updated", "ready", {"plan": "dev", "storage_gb": 3}),
        (160 * minute, "ready", "update", "updating", {"storage_gb": 4}),
        (160 * minute, "updating", "updated", "ready", {"plan": "dev", "storage_gb": 4}),
    ]
    for version, (offset, source, event, target, detail) in enumerate(moves, start=1):
        await append_event(
            conn, "instance", instance, source, target, event, version, at=start + offset, detail=detail
        )
    headers = {"Authorization": f"Bearer {key.plaintext}"}
    params = {"from": start.isoformat(), "to": (start + 3 * 60 * minute).isoformat()}
    report = (await client.get("/v1/usage", params=params, headers=headers)).json()
    billed = 71 * 60 * 1 + 79 * 60 * 3 + 20 * 60 * 4  # GB x seconds of each size
    assert [(i["billing"], i["seconds"], i["storage_gb_seconds"]) for i in report["items"]] == [
        ("billed", 170 * 60.0, float(billed)),
        ("not_billed", 10 * 60.0, 0.0),  # no storage is billed before the database is ready
    ]
    assert [t["storage_gb_seconds"] for t in report["totals"]] == [float(billed), 0.0]
    # Stripe: the hour of the first growth gets 20 min at 1 GB, 1 min updating at 1 GB, 39 min at 3 GB.
    hour = timedelta(hours=1)
    names = {"billed": "compute", "storage_only": "storage", usage.STORAGE_METER: "gb"}
    events = await usage.period_events(conn, start + hour, start + 2 * hour, names)
    assert {(e.event_name, e.value, e.storage) for e in events} == {
        ("compute", 3600, False),
        ("gb", 21 * 60 * 1 + 39 * 60 * 3, True),
    }
    assert len({e.identifier for e in events}) == 2


async def test_bad_usage_windows_are_problems(conn: AsyncConn, client: httpx.AsyncClient) -> None:
    _, key = await tenants.create_org(conn, "acme-bad-usage")
    headers = {"Authorization": f"Bearer {key.plaintext}"}
    for params in (
        {"from": "2026-05-01T00:00:00Z"},
        {"from": "yesterday", "to": "2026-05-02T00:00:00Z"},
        {"from": "2026-05-02T00:00:00Z", "to": "2026-05-01T00:00:00Z"},
        {"from": "2026-05-01T00:00:00", "to": "2026-05-02T00:00:00"},
        {"from": "2024-01-01T00:00:00Z", "to": "2026-05-02T00:00:00Z"},
    ):
        answer = await client.get("/v1/usage", params=params, headers=headers)
        assert answer.status_code == 422, (params, answer.text)
        assert answer.headers["content-type"].startswith("application/problem+json")
    assert (
        await client.get("/v1/usage", params={"from": "2026-05-01T00:00:00Z", "to": "2026-05-02T00:00:00Z"})
    ).status_code == 401


async def test_time_degraded_for_lost_data_is_shown_storage_only(
    conn: AsyncConn, client: httpx.AsyncClient
) -> None:
    """A day: ready, degraded while still serving (billed), ready, degraded for lost data with no
    server while a decision is awaited (storage only, as the instance itself says), then restored."""
    org, key = await tenants.create_org(conn, "acme-lost")
    headers = {"Authorization": f"Bearer {key.plaintext}"}
    now = await usage.db_now(conn)
    start = metering.period_floor(now - 2 * DAY, DAY)
    await conn.execute("SELECT cp_ensure_event_partitions(%s, %s)", (now, start))
    cursor = await conn.execute(
        "INSERT INTO instances (org_id, name, spec, state, created_at)"
        " VALUES (%s, 'lost', '{\"plan\": \"small\"}', 'pending', %s) RETURNING id",
        (org["id"], start),
    )
    row = await cursor.fetchone()
    assert row is not None
    instance: uuid.UUID = row["id"]
    await append_event(
        conn, "instance", instance, None, "pending", "create", 0, at=start, detail={"spec": {"plan": "small"}}
    )
    hours = timedelta(hours=1)
    day: list[tuple[timedelta, str, str, str, dict[str, Any]]] = [
        (timedelta(0), "pending", "start_provisioning", "provisioning", {}),
        (timedelta(0), "provisioning", "provisioned", "ready", {}),
        (2 * hours, "ready", "degrade", "degraded", {"code": "unhealthy"}),
        (3 * hours, "degraded", "recover", "ready", {}),
        (5 * hours, "ready", "degrade", "degraded", {"code": "data_lost"}),
        (12 * hours, "degraded", "recover", "ready", {"plan": "small"}),
        (DAY, "ready", "degrade", "degraded", {"code": "data_lost"}),
    ]
    for version, (offset, source, event, target, detail) in enumerate(day, start=1):
        await append_event(
            conn, "instance", instance, source, target, event, version, at=start + offset, detail=detail
        )
    params = {"from": start.isoformat(), "to": (start + DAY).isoformat()}
    report = (await client.get("/v1/usage", params=params, headers=headers)).json()
    assert [(i["billing"], i["seconds"]) for i in report["items"]] == [
        ("billed", (2 + 1 + 2 + 12) * 3600.0),
        ("storage_only", 7 * 3600.0),
    ]
    # small's 10 GB volume, held all along.
    assert report["totals"] == [
        {"plan": "small", "billing": "billed", "seconds": 17 * 3600.0, "storage_gb_seconds": 17 * 36000.0},
        {
            "plan": "small",
            "billing": "storage_only",
            "seconds": 7 * 3600.0,
            "storage_gb_seconds": 7 * 36000.0,
        },
    ]
    # An instance degraded for lost data now says so too.
    lost = await make_instance(conn, org["id"])
    await walk(
        conn, lost["id"], "start_provisioning", "provisioned", "degrade", patch={"failure_code": "data_lost"}
    )
    shown = (await client.get(f"/v1/instances/{lost['id']}", headers=headers)).json()["state_info"]
    assert (shown["billing"], shown["billing_by_failure"]) == ("storage_only", {"data_lost": "storage_only"})
