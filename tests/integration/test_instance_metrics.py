"""A customer database's metrics: sampled by the reconciler's observation of a real server, served
by the API to its organisation only, rolled up and pruned by the leader's maintenance; storage
autoscaling decided from those samples (injected observation and time), through the update path;
and a real database beyond its allocation held to it, read-only, until its allocation holds it."""

from __future__ import annotations

import uuid
from datetime import timedelta

from controlplane.core.dbmetrics import GIB, DatabaseStats
from controlplane.core.failures import STORAGE_FULL
from controlplane.core.kinds import RESUME, SUSPEND, UPDATE
from controlplane.db.connection import AsyncConn
from controlplane.runtime.settings import Settings
from provisioners.base import Observation
from provisioners.local import LocalProvisioner
from provisioners.noop import NoopProvisioner
from reconciler.maintenance import MetricsRetention
from tests.api_support import make_ready, make_tenant, serving
from tests.factories import make_instance
from tests.operations_support import (
    instance,
    instance_in,
    job_finished,
    ready_instance,
    registry_for,
    run_until,
    scalar,
)
from tests.provisioning_support import connect, credentials
from tests.reconciler_support import live_jobs, read_only, reconciling


async def test_metrics_of_a_real_server_after_writes_in_the_api_for_its_organisation_only(
    conn: AsyncConn, local_settings: Settings
) -> None:
    local = LocalProvisioner(local_settings)
    owner = await make_tenant(conn)
    stranger = await make_tenant(conn)
    iid = await ready_instance(conn, local_settings, registry_for(local), org_id=owner.org_id)
    async with reconciling(local_settings, local) as rec:
        await rec.run_once()
        with connect(credentials(local_settings, await instance(conn, iid))) as customer:
            customer.execute("CREATE TABLE t AS SELECT g AS x FROM generate_series(1, 5000) g")
            customer.execute("SELECT count(*) FROM t").fetchone()
        # The next sample, a sampling interval later (injected: the scan's clock).
        later = await scalar(conn, "SELECT now() + interval '11 seconds'")
        await rec.run_once(later)
    assert await scalar(conn, "SELECT count(*) FROM instance_metrics WHERE instance_id = %s", (iid,)) == 2
    async with serving(local_settings) as api:
        span = {
            "from": (later - timedelta(minutes=5)).isoformat(),
            "to": (later + timedelta(seconds=1)).isoformat(),
        }
        response = await api.get(f"/v1/instances/{iid}/metrics", params=span, headers=owner.headers)
        assert response.status_code == 200, response.text
        body = response.json()
        assert (body["resolution_s"], body["step_s"], body["plan"]) == (10, 10, "dev")
        assert body["max_connections"] == 20
        *_, first, last = body["points"]
        assert last["rows_written_per_s"] > 0 and last["rows_read_per_s"] > 0
        assert last["transactions_per_s"] > 0
        assert 0 <= last["cache_hit_ratio"] <= 1
        assert last["size_bytes"] > first["size_bytes"] - 1 and last["allocated_bytes"] == GIB
        assert last["max_connections"] == 20 and last["replication_lag_s"] is None
        # Another organisation: not found, as every instance route answers it.
        refused = await api.get(f"/v1/instances/{iid}/metrics", headers=stranger.headers)
        assert refused.status_code == 404
        # A range beyond the retention is refused, not served empty.
        too_long = {"from": (later - timedelta(days=40)).isoformat(), "to": later.isoformat()}
        bad = await api.get(f"/v1/instances/{iid}/metrics", params=too_long, headers=owner.headers)
        assert bad.status_code == 422


def _stats(used_bytes: int) -> DatabaseStats:
    return DatabaseStats(1, 20, 100, 10, 10, 90, 10, used_bytes)


class Filling(NoopProvisioner):
    """A provisioner whose one database reports the used space a test sets."""

    def __init__(self) -> None:
        super().__init__()
        self.used = 0

    async def observe(self, instance_id: uuid.UUID) -> Observation:
        return Observation(True, running=True, healthy=True, read_only=False, stats=_stats(self.used))


async def filling(conn: AsyncConn, settings: Settings, storage_gb: int) -> uuid.UUID:
    """A ready instance with `storage_gb` allocated."""
    owner = await make_tenant(conn)
    iid: uuid.UUID = (await make_instance(conn, owner.org_id, storage_gb=storage_gb))["id"]
    await make_ready(conn, settings, iid)
    return iid


async def test_storage_autoscaling_grows_after_five_minutes_nearly_full_through_an_audited_update(
    conn: AsyncConn, settings: Settings
) -> None:
    iid = await filling(conn, settings, 8)
    fill = Filling()
    async with reconciling(settings, fill) as rec:
        now = await scalar(conn, "SELECT now()")
        fill.used = int(7.5 * GIB)  # 94 % of 8 GiB: at most 10 % free
        for step in range(0, 300, 10):  # 4 min 50 s nearly full: not yet
            summary = await rec.run_once(now + timedelta(seconds=step))
            assert "storage_grown" not in summary.actions
        summary = await rec.run_once(now + timedelta(seconds=300))
        assert summary.actions == {"storage_grown": 1}
    row = await instance(conn, iid)
    assert (row["spec"]["storage_gb"], row["spec_generation"]) == (9, 2)
    (job,) = await live_jobs(conn, iid)
    assert job["kind"] == UPDATE and job["payload"]["reason"].startswith("storage autoscaling: 94% of 8 GB")
    assert job["payload"]["spec_generation"] == 2
    # The worker applies it: ready -> updating -> ready, the reason in the audit row of the move.
    await run_until(settings, registry_for(fill), job_finished(job["id"]))
    assert (await instance(conn, iid))["observed_generation"] == 2
    cursor = await conn.execute(
        "SELECT event, reason, detail FROM instance_events"
        " WHERE instance_id = %s AND event IN ('update', 'updated') ORDER BY id",
        (iid,),
    )
    (update, updated) = await cursor.fetchall()
    assert update["reason"].startswith("storage autoscaling: 94% of 8 GB used for 5 min")
    assert updated["detail"]["storage_gb"] == 9 and updated["reason"] == "plan dev applied, 9 GB allocated"


async def test_storage_autoscaling_respects_cooldown_and_maximum_and_warns_at_it(
    conn: AsyncConn, settings: Settings
) -> None:
    iid = await filling(conn, settings, 9)  # dev's maximum is 10 GB: 9 grows to 10, then only a warning
    fill = Filling()
    fill.used = int(8.5 * GIB)
    async with reconciling(settings, fill) as rec:
        now = await scalar(conn, "SELECT now()")
        for step in range(0, 310, 10):
            await rec.run_once(now + timedelta(seconds=step))
        row = await instance(conn, iid)
        assert row["spec"]["storage_gb"] == 10 and row["storage_grown_at"] is not None
        fill.used = int(9.5 * GIB)
        grown_at = row["storage_grown_at"]
        # Within the cooldown nothing grows; past it, at the maximum, the customer is warned once.
        for step in range(320, 700, 10):
            summary = await rec.run_once(now + timedelta(seconds=step))
            assert "storage_grown" not in summary.actions
        row = await instance(conn, iid)
        assert row["spec"]["storage_gb"] == 10 and row["storage_grown_at"] == grown_at
        assert row["storage_full_warned_at"] is not None
        warned = row["storage_full_warned_at"]
        summary = await rec.run_once(now + timedelta(seconds=710))
        assert "storage_full_warned" not in summary.actions
    assert (await instance(conn, iid))["storage_full_warned_at"] == warned


async def test_metrics_are_rolled_up_and_pruned_after_their_retention(
    conn: AsyncConn, settings: Settings
) -> None:
    iid = uuid.uuid4()
    base = await scalar(
        conn, "SELECT date_bin('5 minutes', now(), TIMESTAMPTZ '2000-01-01') - interval '2 days'"
    )
    for i in range(60):  # 10 minutes of 10-second samples, two days old
        await conn.execute(
            "INSERT INTO instance_metrics VALUES (%s, 10, %s, %s, 20, %s, 0, 0, 0, 0, %s, %s, NULL, NULL)",
            (iid, base + timedelta(seconds=10 * i), i % 3, 100 + i, 1000 + i, GIB),
        )
    async with reconciling(settings, NoopProvisioner()) as rec:
        keeping = MetricsRetention(settings.replace(metrics_sample_keep_s=3 * 86_400), rec.pool)
        pruning = MetricsRetention(settings, rec.pool)
        await keeping.run_once(base + timedelta(minutes=11))
        await keeping.run_once(base + timedelta(minutes=11))  # again: nothing more
        await pruning.run_once(base + timedelta(days=1, minutes=20))
        await pruning.run_once(base + timedelta(days=1, minutes=20))
    # Two 5-minute rows (counters at their last value), the fine samples pruned after a day.
    coarse = "SELECT count(*) FROM instance_metrics WHERE resolution_s = 300 AND instance_id = %s"
    assert await scalar(conn, coarse, (iid,)) == 2
    last = "SELECT max(transactions) FROM instance_metrics WHERE resolution_s = 300 AND at = %s"
    assert await scalar(conn, last, (base,)) == 129
    assert (
        await scalar(
            conn, "SELECT count(*) FROM instance_metrics WHERE resolution_s = 10 AND instance_id = %s", (iid,)
        )
        == 0
    )
    assert (
        await scalar(
            conn,
            "SELECT count(*) FROM instance_metrics WHERE resolution_s = 300 AND instance_id = %s",
            (iid,),
        )
        == 2
    )


async def test_a_real_database_beyond_its_allocation_is_held_read_only_until_its_allocation_holds_it(
    conn: AsyncConn, local_settings: Settings
) -> None:
    settings = local_settings.replace(storage_autoscale=False)  # the customer's move, not autoscaling's
    local = LocalProvisioner(settings)
    registry = registry_for(local)
    owner = await make_tenant(conn)
    iid = await ready_instance(conn, settings, registry, org_id=owner.org_id)
    info = credentials(settings, await instance(conn, iid))
    now = await scalar(conn, "SELECT now()")
    async with reconciling(settings, local) as rec:
        await rec.run_once(now)  # its first sample, and its first backup enqueued

        async def idle(c: AsyncConn) -> bool:
            return not await live_jobs(c, iid)

        await run_until(settings, registry, idle)  # the backup taken: no job under way
        fresh = await scalar(
            conn, "SELECT max(size_bytes) FROM instance_metrics WHERE instance_id = %s", (iid,)
        )
        # dev's allocation is 1 GB; here one GB is what the new database holds and 4 MiB more, so
        # that a real write of some 10 MB outgrows it.
        rec.gb_bytes = fresh + 4 * 2**20
        assert (await rec.run_once(now + timedelta(seconds=10))).actions == {}
        with connect(info) as customer:
            customer.execute(
                "CREATE TABLE filler AS SELECT g, repeat('x', 500) AS pad FROM generate_series(1, 20000) g"
            )
        summary = await rec.run_once(now + timedelta(seconds=20))
        assert summary.actions == {f"enqueue_{SUSPEND}": 1}
        (job,) = await live_jobs(conn, iid)
        assert job["payload"]["code"] == STORAGE_FULL and job["payload"]["reason"].startswith(
            "storage full: "
        )
        await run_until(settings, registry, instance_in(iid, "suspended"))
        assert read_only(info)  # a write fails, even in a session asking for read-write
        row = await instance(conn, iid)
        assert (row["failure_code"], row["suspended_by_billing"]) == (STORAGE_FULL, False)
        # Still beyond it: held.
        assert (await rec.run_once(now + timedelta(seconds=30))).actions == {}

        async with serving(settings) as api:
            shown = (await api.get(f"/v1/instances/{iid}", headers=owner.headers)).json()
            assert shown["state"] == "suspended" and shown["failure"]["code"] == STORAGE_FULL
            assert "larger plan" in shown["failure"]["hint"]
            events = (await api.get(f"/v1/instances/{iid}/events", headers=owner.headers)).json()["items"]
            suspended = [e for e in events if e["event"] == "suspend"]
            assert suspended and "outgrew its storage allocation" in suspended[-1]["reason"]
            # The customer moves to a larger plan (small: 10 GB), recorded while it is suspended.
            moved = await api.patch(f"/v1/instances/{iid}", json={"plan": "small"}, headers=owner.headers)
            assert moved.status_code == 202, moved.text

        # The allocation holds the data again: resumed, then the new plan applied.
        summary = await rec.run_once(now + timedelta(seconds=40))
        assert summary.actions == {f"enqueue_{RESUME}": 1}
        await run_until(settings, registry, instance_in(iid, "ready"))
        summary = await rec.run_once(now + timedelta(seconds=50))
        assert summary.actions == {f"enqueue_{UPDATE}": 1}
        await run_until(
            settings,
            registry,
            lambda c: scalar(c, "SELECT observed_generation = 2 FROM instances WHERE id = %s", (iid,)),
        )
    assert not read_only(info)
    with connect(info) as customer:
        customer.execute("INSERT INTO filler VALUES (0, 'after')")
        assert customer.execute("SELECT pad FROM filler WHERE g = 0").fetchone() == ("after",)
    row = await instance(conn, iid)
    assert (row["state"], row["failure_code"], row["failure_reason"]) == ("ready", None, None)
    cursor = await conn.execute(
        "SELECT event, actor_kind, reason, detail FROM instance_events"
        " WHERE instance_id = %s AND event IN ('suspend', 'resume') ORDER BY id",
        (iid,),
    )
    suspend, resume = await cursor.fetchall()
    assert suspend["detail"]["code"] == STORAGE_FULL and suspend["reason"].startswith("storage full: ")
    assert resume["reason"].startswith("storage allocation holds the data again")


async def test_the_noop_provisioner_reports_metrics_only_when_asked_and_the_pass_samples_them(
    conn: AsyncConn, settings: Settings
) -> None:
    """What the bench's sampled freshness variant relies on (`noop_observe_stats`)."""
    iid = await filling(conn, settings, 1)
    count = "SELECT count(*) FROM instance_metrics WHERE instance_id = %s"
    async with reconciling(settings, NoopProvisioner()) as rec:
        await rec.run_once()
    assert await scalar(conn, count, (iid,)) == 0
    sampling = NoopProvisioner.from_settings(settings.replace(noop_observe_stats=True))
    async with reconciling(settings, sampling) as rec:
        now = await scalar(conn, "SELECT now()")
        assert (await rec.run_once(now)).actions == {}  # a small database: nothing to decide
        await rec.run_once(now + timedelta(seconds=10))
    assert await scalar(conn, count, (iid,)) == 2
    sizes = await scalar(
        conn, "SELECT array_agg(DISTINCT size_bytes) FROM instance_metrics WHERE instance_id = %s", (iid,)
    )
    assert sizes == [8 * 2**20]
