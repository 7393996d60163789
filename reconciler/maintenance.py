"""The reconciler leader's once-only duties, a service each with `run_once(now)`, and their runner.

The duties: job supervision, the gauges, the orphan sweep, the audit log's upkeep, usage reports,
the billing policy, the customer databases' metrics (roll-up and retention), the backups' upkeep
(verification, expiry). `Maintenance` runs
them; the reconciler's loop calls it while it leads."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TypeVar

from psycopg_pool import AsyncConnectionPool

from controlplane.audit.checkpoints import AuditMaintenance, MaintenanceResult
from controlplane.core import lifecycle
from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.db.transitions import Actor
from controlplane.queue.registry import JobRegistry
from controlplane.queue.supervisor import PassResult, Supervisor
from controlplane.runtime import metrics
from controlplane.runtime.secretbox import load_box
from controlplane.runtime.settings import Settings
from controlplane.services import billing_policy, usage
from controlplane.services.policy import Policy
from provisioners.base import InstanceSpec, Provisioner

log = logging.getLogger(__name__)

LIVE_INSTANCE_STATES = lifecycle.INSTANCE.live_states()
LIVE_JOB_STATES = lifecycle.JOB.live_states()
# Attempts of a usage report job (Stripe may refuse for a while; the period is kept by its start).
USAGE_REPORT_ATTEMPTS = 50
T = TypeVar("T")


class Gauges:
    """The gauges of live instances and jobs by state, of instances past their deadline, of the
    queue by kind (depth, age of the oldest due job) and of organisations on billing hold."""

    def __init__(self, pool: AsyncConnectionPool[AsyncConn], kinds: Iterable[str] = ()) -> None:
        self.pool = pool
        # The job kinds whose queue gauges are exported (0 when none waits); others as they appear.
        self.kinds = set(kinds)

    async def run_once(self, now: datetime | None = None) -> None:
        """Counts as of the database's clock (`now` is not used: a gauge shows the present)."""
        async with self.pool.connection() as conn:
            cursor = await conn.execute(sql.COUNT_LIVE_INSTANCES)
            counts = {row["state"]: row for row in await cursor.fetchall()}
            for state in LIVE_INSTANCE_STATES:
                metrics.ENTITIES_BY_STATE.labels("instance", state).set(
                    counts[state]["n"] if state in counts else 0
                )
            metrics.OVER_DEADLINE.set(sum(row["over_deadline"] for row in counts.values()))
            cursor = await conn.execute(sql.COUNT_LIVE_JOBS)
            job_counts = {row["state"]: row["n"] for row in await cursor.fetchall()}
            for state in LIVE_JOB_STATES:
                metrics.ENTITIES_BY_STATE.labels("job", state).set(job_counts.get(state, 0))
            cursor = await conn.execute(sql.QUEUED_BY_KIND)
            queued = {row["kind"]: row for row in await cursor.fetchall()}
            self.kinds |= set(queued)
            for kind in self.kinds:
                metrics.QUEUE_DEPTH.labels(kind).set(queued[kind]["depth"] if kind in queued else 0)
                metrics.QUEUE_OLDEST_AGE.labels(kind).set(queued[kind]["oldest_s"] if kind in queued else 0)
            cursor = await conn.execute(sql.COUNT_BILLING_HOLDS)
            holds = await cursor.fetchone()
            assert holds is not None
            for state in ("held", "grace"):
                metrics.BILLING_ORGANISATIONS.labels(state).set(holds[state])


@dataclass
class SweepResult:
    orphans: list[str] = field(default_factory=list)
    removed: int = 0


class OrphanSweep:
    """Resources whose instance is unknown, deleted or failed: removed with a final backup and a
    fresh fence, or only listed (`dry_run`)."""

    def __init__(
        self, pool: AsyncConnectionPool[AsyncConn], provisioner: Provisioner, *, dry_run: bool = False
    ) -> None:
        self.pool = pool
        self.provisioner = provisioner
        self.dry_run = dry_run

    async def find(self) -> list[tuple[uuid.UUID, str, InstanceSpec]]:
        """Resources whose instance is unknown, deleted or failed (and no job is cleaning it up)."""
        resources = await self.provisioner.inventory()
        by_instance: dict[uuid.UUID, list[str]] = {}
        for resource in resources:
            if resource.instance_id is not None:
                by_instance.setdefault(resource.instance_id, []).append(f"{resource.kind}/{resource.name}")
        if not by_instance:
            return []
        async with self.pool.connection() as conn:
            cursor = await conn.execute(sql.INSTANCES_BY_ID, {"ids": list(by_instance)})
            known = {row["id"]: row for row in await cursor.fetchall()}
        orphans = []
        for instance_id, names in by_instance.items():
            row = known.get(instance_id)
            if row is None:
                orphans.append((instance_id, f"unknown instance: {', '.join(names)}", InstanceSpec()))
            elif row["state"] in lifecycle.INSTANCE.terminal and not row["has_live_job"]:
                spec = InstanceSpec.for_removal(row["spec"], int(row["spec_generation"]))
                orphans.append((instance_id, f"{row['state']} instance: {', '.join(names)}", spec))
        return orphans

    async def run_once(self, now: datetime | None = None) -> SweepResult:
        """One sweep (`now` is not used: the inventory is what exists now)."""
        result = SweepResult()
        try:
            orphans = await self.find()
        except Exception as exc:  # an unreachable provisioner only delays the sweep
            log.warning("orphan sweep skipped: inventory failed: %s", exc)
            return result
        for instance_id, why, spec in orphans:
            result.orphans.append(f"{instance_id}: {why}")
            if self.dry_run:
                log.warning("orphan (dry run, left in place): %s %s", instance_id, why)
                continue
            async with self.pool.connection() as conn:
                cursor = await conn.execute(sql.NEXT_FENCE)
                fence_row = await cursor.fetchone()
            assert fence_row is not None
            try:
                removed = await self.provisioner.deprovision(instance_id, spec, int(fence_row["fence"]))
            except Exception as exc:
                log.warning("orphan %s could not be removed: %s", instance_id, exc)
                continue
            result.removed += 1
            metrics.ORPHANS_REMOVED.inc()
            log.warning("orphan removed: %s %s (final backup: %s)", instance_id, why, removed.backup)
        return result


class UsageReports:
    """The usage reports of settled periods, enqueued for Stripe (when a Stripe key is set)."""

    def __init__(self, settings: Settings, pool: AsyncConnectionPool[AsyncConn], actor: Actor) -> None:
        self.settings = settings
        self.pool = pool
        self.actor = actor

    async def run_once(self, now: datetime | None = None) -> int:
        """Enqueue the report of every period settled by `now` (the database's clock if None);
        returns how many were enqueued."""
        billing = self.settings.billing
        if billing.stripe_api_key is None:
            return 0
        async with self.pool.connection() as conn:
            periods = await usage.enqueue_due_reports(
                conn,
                now or await usage.db_now(conn),
                timedelta(seconds=billing.meter_interval_s),
                timedelta(seconds=billing.meter_settle_s),
                self.actor,
                max_attempts=USAGE_REPORT_ATTEMPTS,
            )
        return len(periods)


class BillingPolicy:
    """The billing policy: organisations held once their grace period is over, instances
    suspended by billing for too long deleted."""

    def __init__(self, settings: Settings, pool: AsyncConnectionPool[AsyncConn], actor: Actor) -> None:
        self.settings = settings
        self.pool = pool
        self.actor = actor

    async def run_once(self, now: datetime | None = None) -> billing_policy.Enforced:
        async with self.pool.connection() as conn:
            return await billing_policy.enforce(
                conn,
                now or await usage.db_now(conn),
                self.settings.billing,
                self.actor,
                Policy.from_settings(self.settings),
            )


class MetricsRetention:
    """The customer databases' metrics kept bounded: the fine samples of every completed coarse
    interval rolled up, then each resolution pruned after its retention."""

    def __init__(self, settings: Settings, pool: AsyncConnectionPool[AsyncConn]) -> None:
        self.settings = settings.reconciler
        self.pool = pool

    async def run_once(self, now: datetime | None = None) -> int:
        """One roll-up and prune as of `now` (the database's clock if None); returns rows pruned."""
        s = self.settings
        async with self.pool.connection() as conn, conn.transaction():
            now = now or await usage.db_now(conn)
            await conn.execute(
                sql.ROLL_UP_SAMPLES,
                {
                    "now": now,
                    "fine_s": s.metrics_sample_s,
                    "coarse_s": s.metrics_rollup_s,
                    "fine_keep_s": s.metrics_sample_keep_s,
                },
            )
            pruned = 0
            for resolution, keep in (
                (s.metrics_sample_s, s.metrics_sample_keep_s),
                (s.metrics_rollup_s, s.metrics_rollup_keep_s),
            ):
                cursor = await conn.execute(
                    sql.PRUNE_SAMPLES, {"now": now, "resolution_s": resolution, "keep_s": keep}
                )
                pruned += cursor.rowcount
        return pruned


class BackupUpkeep:
    """The backups' upkeep: one instance's backups and archive read back and checked at a time (in
    the background: a run never waits for it), and the archives of deleted instances whose
    retention ran out removed."""

    def __init__(
        self, settings: Settings, pool: AsyncConnectionPool[AsyncConn], provisioner: Provisioner
    ) -> None:
        self.settings = settings.reconciler
        self.pool = pool
        self.provisioner = provisioner
        # The check of one instance's backups running in the background, if any.
        self._verifying: asyncio.Task[str | None] | None = None

    async def run_once(self, now: datetime | None = None) -> int:
        """Start a due check, remove expired archives as of `now` (the database's clock if None);
        returns how many archives were removed."""
        if not self.provisioner.supports_backups:
            return 0
        async with self.pool.connection() as conn:
            moment = now or await usage.db_now(conn)
            interval = self.settings.backup_verify_interval_s
            if interval > 0 and (self._verifying is None or self._verifying.done()):
                before = moment - timedelta(seconds=interval)
                cursor = await conn.execute(sql.DUE_VERIFICATIONS, {"before": before, "limit": 1})
                due = [row["instance_id"] for row in await cursor.fetchall()]
                if due:
                    self._verifying = asyncio.create_task(self._verify(due[0]))
            cursor = await conn.execute(sql.EXPIRED_WINDOWS, {"now": moment, "limit": 10})
            expired = [row["instance_id"] for row in await cursor.fetchall()]
        for instance_id in expired:
            await self.provisioner.expire(instance_id)
            async with self.pool.connection() as conn:
                await conn.execute(sql.MARK_EXPIRED, {"instance_id": instance_id})
            log.info("instance %s: its archive and backups removed (retention over)", instance_id)
        return len(expired)

    async def close(self) -> None:
        """Wait for the check of backups under way, if any (before the pool closes)."""
        if self._verifying is not None:
            await asyncio.gather(self._verifying, return_exceptions=True)
            self._verifying = None

    async def _verify(self, instance_id: uuid.UUID) -> str | None:
        try:
            problem = await self.provisioner.verify_backups(instance_id)
        except Exception as exc:  # recorded as a problem: the next check tries again
            problem = f"verification failed: {exc}"
        async with self.pool.connection() as conn:
            await conn.execute(sql.RECORD_VERIFICATION, {"instance_id": instance_id, "problem": problem})
        metrics.BACKUP_VERIFICATIONS.labels("broken" if problem else "sound").inc()
        if problem:
            log.error("instance %s: its backups or archive do not verify: %s", instance_id, problem)
        return problem


@dataclass
class MaintenanceSummary:
    """What one run of the leader's duties did."""

    jobs: PassResult = field(default_factory=PassResult)
    orphans: list[str] = field(default_factory=list)
    orphans_removed: int = 0
    audit: MaintenanceResult | None = None
    # Usage periods whose report to Stripe this run enqueued.
    usage_reports: int = 0
    billing: billing_policy.Enforced | None = None
    # Samples of the customer databases' metrics pruned after their retention.
    metrics_pruned: int = 0
    # Archives of deleted instances removed, their retention over.
    archives_expired: int = 0
    duration_s: float = 0.0


class Maintenance:
    """The leader's duties, each run once per `run_once(now)`: the reconciler's loop calls it on
    every pass it makes as the leader (`controlplane reconcile --once`: once, if it leads).

    Every duty runs every time and finds what is due itself (stale heartbeats and finished
    backoffs, the orphans there are, a partition month or a checkpoint interval reached, settled
    usage periods, grace periods over). Job supervision, the gauges and the sweep's database
    reads raise (the loop logs the pass as failed); the audit log's upkeep, usage reports and the
    billing policy log their failure and leave the others done: the next run tries again.
    """

    def __init__(
        self,
        settings: Settings,
        pool: AsyncConnectionPool[AsyncConn],
        provisioner: Provisioner,
        registry: JobRegistry,
        *,
        maintainer_id: str = "reconciler",
        dry_run_orphans: bool = False,
    ) -> None:
        actor = Actor("reconciler", maintainer_id)
        self.supervisor = Supervisor(pool, settings, registry, supervisor_id=maintainer_id)
        self.gauges = Gauges(pool, registry.names())
        self.orphans = OrphanSweep(pool, provisioner, dry_run=dry_run_orphans)
        # Partitions of the event tables ahead, signed checkpoints of the audit log.
        self.audit = AuditMaintenance(settings, pool, load_box(settings))
        self.usage_reports = UsageReports(settings, pool, actor)
        self.billing = BillingPolicy(settings, pool, actor)
        self.metrics = MetricsRetention(settings, pool)
        self.backups = BackupUpkeep(settings, pool, provisioner)

    async def run_once(self, now: datetime | None = None) -> MaintenanceSummary:
        """Every duty once. `now` replaces the database clock in time comparisons (tests)."""
        started = time.monotonic()
        summary = MaintenanceSummary()
        summary.jobs = await self.supervisor.run_once(now)
        await self.gauges.run_once(now)
        swept = await self.orphans.run_once(now)
        summary.orphans, summary.orphans_removed = swept.orphans, swept.removed
        # The checkpoint gauge stops moving while this fails.
        summary.audit = await _logged(
            self.audit.run_once(now), "audit step failed (partitions ahead, checkpoint)"
        )
        # Nothing is lost while these fail: periods are kept by their start, holds by the organisation.
        reports = await _logged(self.usage_reports.run_once(now), "billing step failed (usage reports)")
        summary.usage_reports = reports or 0
        summary.billing = await _logged(
            self.billing.run_once(now), "billing step failed (grace periods, long suspensions)"
        )
        summary.metrics_pruned = (
            await _logged(self.metrics.run_once(now), "metrics step failed (roll-up, retention)") or 0
        )
        summary.archives_expired = (
            await _logged(
                self.backups.run_once(now),
                "backup upkeep failed (verification, expiry of deleted instances' archives)",
            )
            or 0
        )
        summary.duration_s = time.monotonic() - started
        log.log(
            logging.INFO if summary.jobs.acted or summary.orphans else logging.DEBUG,
            "reconciler maintenance",
            extra={
                "jobs_reclaimed": len(summary.jobs.reclaimed),
                "jobs_retried": len(summary.jobs.retried),
                "jobs_abandoned": len(summary.jobs.abandoned),
                "orphans": len(summary.orphans),
                "usage_reports": summary.usage_reports,
                "duration_s": round(summary.duration_s, 4),
            },
        )
        return summary

    async def close(self) -> None:
        """Wait for the duties' work under way in the background (before the pool closes)."""
        await self.backups.close()


async def _logged(duty: Awaitable[T], failure: str) -> T | None:
    """A duty whose failure is logged (with its traceback) and leaves the other duties done."""
    try:
        return await duty
    except Exception:
        log.exception(failure)
        return None
