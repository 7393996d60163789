"""The reconciler pass: job supervision, deadlines, health and drift, intents, orphans, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

import psycopg
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from controlplane.audit.checkpoints import AuditMaintenance, MaintenanceResult
from controlplane.core import kinds, lifecycle, plans
from controlplane.core.failures import DATA_LOST
from controlplane.core.kinds import RESUME, SUSPEND
from controlplane.core.records import InstancePatch, ScannedInstance
from controlplane.db import job_rows as jobs
from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.db.transitions import Actor, Conflict, InvariantViolation, transition
from controlplane.queue.registry import JobRegistry
from controlplane.queue.supervisor import PassResult, Supervisor
from controlplane.runtime import liveness, metrics
from controlplane.runtime.secretbox import load_box
from controlplane.runtime.settings import Settings
from controlplane.services import billing_policy, usage
from controlplane.services.policy import Policy
from provisioners.base import InstanceSpec, Provisioner
from reconciler import planning
from reconciler.leader import LeaderElection, ShardLeases

log = logging.getLogger(__name__)

LIVE_INSTANCE_STATES = lifecycle.INSTANCE.live_states()
LIVE_JOB_STATES = lifecycle.JOB.live_states()


@dataclass
class PassSummary:
    """What one pass saw and did."""

    jobs: PassResult = field(default_factory=PassResult)
    scanned: int = 0
    observed: int = 0
    observe_failures: int = 0
    actions: dict[str, int] = field(default_factory=dict)
    conflicts: int = 0
    invariant_violations: int = 0
    orphans: list[str] = field(default_factory=list)
    orphans_removed: int = 0
    audit: MaintenanceResult | None = None
    # Usage periods whose report to Stripe this pass enqueued.
    usage_reports: int = 0
    duration_s: float = 0.0

    def count(self, action: str) -> None:
        self.actions[action] = self.actions.get(action, 0) + 1
        metrics.RECONCILE_ACTIONS.labels(action).inc()


def _backup_interval_s(inst: ScannedInstance, backed_up: bool) -> float | None:
    plan = str((inst.spec or {}).get("plan"))
    if not backed_up or not plans.is_plan(plan):
        return None
    return plans.backup_schedule(plan).interval_s


def _view(
    inst: ScannedInstance, observed: planning.Observed | None, settings: Settings, *, backed_up: bool = False
) -> planning.InstanceView:
    heal_not_before = None
    if inst.heal_given_up_at is not None:
        pause = planning.heal_backoff_s(
            inst.heal_failures,
            settings.reconciler.heal_backoff_base_s,
            settings.reconciler.heal_backoff_max_s,
        )
        heal_not_before = inst.heal_given_up_at + timedelta(seconds=pause)
    return planning.InstanceView(
        state=inst.state,
        spec_generation=inst.spec_generation,
        observed_generation=inst.observed_generation,
        deadline_at=inst.deadline_at,
        deadline_retries=inst.deadline_retries,
        deletion_requested=inst.deletion_requested,
        billing_hold=inst.billing_hold,
        suspended_by_billing=inst.suspended_by_billing,
        live_jobs=inst.live_jobs,
        observed=observed,
        failed_generation=inst.failed_generation,
        heal_not_before=heal_not_before,
        failure_code=inst.failure_code,
        newest_backup_at=inst.newest_backup_at,
        created_at=inst.created_at,
        backup_interval_s=_backup_interval_s(inst, backed_up),
    )


def _payload(kind: str, reason: str, billing_hold: bool) -> kinds.Payload:
    """What the reconciler asks of a job it enqueues: why, and for suspend and resume the billing side."""
    if kind == SUSPEND:
        return kinds.SuspendPayload(reason, billing=True if billing_hold else None)
    if kind == RESUME:
        return kinds.ResumePayload(reason, billing=False)
    return kinds.PAYLOADS[kind](reason)


class Reconciler:
    """Compares what the database declares with what the provisioner shows, and corrects it."""

    def __init__(
        self,
        settings: Settings,
        pool: AsyncConnectionPool[AsyncConn],
        provisioner: Provisioner,
        registry: JobRegistry,
        *,
        reconciler_id: str = "reconciler",
        sweep_orphans: bool = True,
        dry_run_orphans: bool = False,
        audit: bool = True,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.provisioner = provisioner
        self.actor = Actor("reconciler", reconciler_id)
        self.supervisor = Supervisor(pool, settings, registry, supervisor_id=reconciler_id)
        self.sweep_orphans = sweep_orphans
        self.dry_run_orphans = dry_run_orphans
        # Partitions of the event tables ahead, signed checkpoints of the audit log.
        self.audit = AuditMaintenance(settings, pool, load_box(settings)) if audit else None

    async def run_once(
        self, now: datetime | None = None, *, shards: ShardLeases | None = None, duties: bool = True
    ) -> PassSummary:
        """One bounded pass. `now` replaces the database clock in time comparisons (tests).

        With `shards`, the pass looks only at the instances of the shards held (and acts on one
        only while its shard is still held); `duties` (the leader's: job supervision, orphans, the
        audit log's upkeep, billing, the gauges) are done by one process of all.
        """
        started = time.monotonic()
        summary = PassSummary()
        if duties:
            summary.jobs = await self.supervisor.run_once(now)
        scanned: list[ScannedInstance] = []
        held = None if shards is None else sorted(shards.held)
        if held is None or held:
            async with self.pool.connection() as conn:
                cursor = await conn.execute(
                    sql.SCAN_LIVE_INSTANCES,
                    {
                        "now": now,
                        "limit": self.settings.reconciler.batch_size,
                        "shards": held,
                        "shard_count": shards.count if shards is not None else 1,
                    },
                    prepare=True,
                )
                scanned = [ScannedInstance.from_row(row) for row in await cursor.fetchall()]
        summary.scanned = len(scanned)
        observations = await self._observe_all(scanned, summary)
        backed_up = self.provisioner.supports_backups
        for inst in scanned:
            view = _view(inst, observations.get(inst.id), self.settings, backed_up=backed_up)
            actions = planning.plan(view, inst.now, self.settings.reconciler.deadline_max_retries)
            if actions:
                await self._apply(inst, actions, summary, shards)
        async with self.pool.connection() as conn:
            if scanned:
                await conn.execute(sql.TOUCH_RECONCILED, {"ids": [inst.id for inst in scanned]}, prepare=True)
            if duties:
                await self._record_gauges(conn)
        if self.sweep_orphans and duties:
            await self._sweep(summary)
        if self.audit is not None and duties:
            try:
                summary.audit = await self.audit.run_once(now)
            except Exception:  # the next pass tries again; the checkpoint gauge stops moving
                log.exception("audit step failed (partitions ahead, checkpoint)")
        if duties:
            try:
                summary.usage_reports = await self._billing_step(now)
            except Exception:  # the next pass tries again; nothing is lost (periods are kept by start)
                log.exception("billing step failed (usage reports, grace periods, long suspensions)")
        summary.duration_s = time.monotonic() - started
        metrics.RECONCILE_PASS_DURATION.observe(summary.duration_s)
        metrics.RECONCILE_LAST_SUCCESS.set(time.time())
        busy = summary.actions or summary.jobs.acted or summary.orphans or summary.observe_failures
        log.log(
            logging.INFO if busy else logging.DEBUG,
            "reconciler pass",
            extra={
                "scanned": summary.scanned,
                "observed": summary.observed,
                "actions": summary.actions,
                "jobs_reclaimed": len(summary.jobs.reclaimed),
                "jobs_retried": len(summary.jobs.retried),
                "jobs_abandoned": len(summary.jobs.abandoned),
                "orphans": len(summary.orphans),
                "duration_s": round(summary.duration_s, 4),
            },
        )
        return summary

    async def _observe_all(
        self, scanned: list[ScannedInstance], summary: PassSummary
    ) -> dict[uuid.UUID, planning.Observed]:
        """Observe the settled instances (ready, degraded, suspended), a bounded number at a time."""
        limit = asyncio.Semaphore(max(1, self.settings.reconciler.concurrency))
        targets = [inst.id for inst in scanned if inst.state in planning.OBSERVED_STATES]

        async def observe(instance_id: uuid.UUID) -> tuple[uuid.UUID, planning.Observed | None]:
            async with limit:
                try:
                    seen = await self.provisioner.observe(instance_id)
                except Exception as exc:  # a provisioner failure must not stop the pass
                    log.warning("observe of %s failed: %s", instance_id, exc)
                    summary.observe_failures += 1
                    return instance_id, None
            return instance_id, planning.Observed(
                exists=seen.exists,
                running=seen.running,
                healthy=seen.healthy,
                read_only=bool(seen.read_only),
                detail=seen.detail,
                data_lost=seen.data_lost,
            )

        results = await asyncio.gather(*(observe(i) for i in targets))
        summary.observed = sum(1 for _, seen in results if seen is not None)
        return {instance_id: seen for instance_id, seen in results if seen is not None}

    async def _apply(
        self,
        inst: ScannedInstance,
        actions: list[planning.Action],
        summary: PassSummary,
        shards: ShardLeases | None,
    ) -> None:
        """Carry out one instance's actions in one transaction; a lost race leaves it to the next pass.

        With shards, only while this process still holds the instance's shard (else its new
        holder acts, and this process must not: each instance is acted on by one process)."""
        try:
            async with self.pool.connection() as conn, conn.transaction():
                if shards is not None and not await shards.holds_shard_of(conn, inst.id):
                    summary.count("shard_moved")
                    log.info("instance %s: its shard moved to another reconciler; left to it", inst.id)
                    return
                for action in actions:
                    await self._apply_one(conn, inst, action, summary)
        except Conflict as exc:
            summary.conflicts += 1
            log.info("reconciler lost a race on instance %s: %s", inst.id, exc)
        except InvariantViolation:
            # Logged at CRITICAL and counted by the transition path. The row is left as found
            # for an SRE; the other instances of the batch still get their pass.
            summary.invariant_violations += 1

    async def _apply_one(
        self, conn: AsyncConn, inst: ScannedInstance, action: planning.Action, summary: PassSummary
    ) -> None:
        if isinstance(action, planning.Transition):
            failing = action.event in ("fail", "degrade")
            patch = InstancePatch(
                failure_reason=action.reason if failing else None,
                failure_code=action.code if failing else None,
            )
            if inst.state == "updating" and failing:
                # An update past its deadline and its retries is given up, as an abandoned one is.
                patch = replace(patch, failed_generation=inst.spec_generation)
            await transition(
                conn,
                "instance",
                inst.id,
                action.event,
                inst.state_version,
                expected_state=inst.state,
                actor=self.actor,
                reason=action.reason,
                detail={"code": action.code} if failing and action.code else None,
                patch=patch,
            )
            summary.count(action.event)
            log.info("instance %s: %s (%s)", inst.id, action.event, action.reason)
            if action.code == DATA_LOST:
                self._data_lost(inst, action.reason)
        elif isinstance(action, planning.RecordFailure):
            await conn.execute(
                sql.SET_FAILURE_IN_PLACE,
                {
                    "id": inst.id,
                    "state_version": inst.state_version,
                    "code": action.code,
                    "reason": action.reason,
                },
            )
            summary.count(f"record_{action.code}")
            if action.code == DATA_LOST:
                self._data_lost(inst, action.reason)
        elif isinstance(action, planning.Enqueue):
            payload = _payload(action.kind, action.reason, inst.billing_hold)
            result = await jobs.enqueue(conn, jobs.NewJob(action.kind, inst.id, payload=payload), self.actor)
            if result.created:
                summary.count(f"enqueue_{action.kind}")
                log.info("instance %s: enqueued %s (%s)", inst.id, action.kind, action.reason)
        else:
            deadline_s = self.settings.reconciler.deadline_s(inst.state) or 0.0
            await conn.execute(
                sql.EXTEND_DEADLINE,
                {"id": inst.id, "state_version": inst.state_version, "deadline_s": deadline_s},
            )
            summary.count("deadline_retry")

    def _data_lost(self, inst: ScannedInstance, reason: str) -> None:
        metrics.DATA_LOSS.inc()
        log.error(
            "instance %s (%s): %s; it comes back only with a restore: from the newest backup held"
            " (%s), or as someone decides",
            inst.id,
            inst.state,
            reason,
            inst.newest_backup_at or "none held",
            extra={"instance_id": str(inst.id), "failure_code": DATA_LOST},
        )

    async def _billing_step(self, now: datetime | None) -> int:
        """Enqueue the usage reports of settled periods; apply the grace period and long suspensions."""
        billing = self.settings.billing
        enqueued = 0
        async with self.pool.connection() as conn:
            moment = now or await usage.db_now(conn)
            if billing.stripe_api_key is not None:
                periods = await usage.enqueue_due_reports(
                    conn,
                    moment,
                    timedelta(seconds=billing.meter_interval_s),
                    timedelta(seconds=billing.meter_settle_s),
                    self.actor,
                    max_attempts=50,
                )
                enqueued = len(periods)
            await billing_policy.enforce(
                conn, moment, billing, self.actor, Policy.from_settings(self.settings)
            )
        return enqueued

    async def _record_gauges(self, conn: AsyncConn) -> None:
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

    async def find_orphans(self) -> list[tuple[uuid.UUID, str, InstanceSpec]]:
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

    async def _sweep(self, summary: PassSummary) -> None:
        try:
            orphans = await self.find_orphans()
        except Exception as exc:  # an unreachable provisioner only delays the sweep
            log.warning("orphan sweep skipped: inventory failed: %s", exc)
            return
        for instance_id, why, spec in orphans:
            summary.orphans.append(f"{instance_id}: {why}")
            if self.dry_run_orphans:
                log.warning("orphan (dry run, left in place): %s %s", instance_id, why)
                continue
            async with self.pool.connection() as conn:
                cursor = await conn.execute(sql.NEXT_FENCE)
                fence_row = await cursor.fetchone()
            assert fence_row is not None
            try:
                result = await self.provisioner.deprovision(instance_id, spec, int(fence_row["fence"]))
            except Exception as exc:
                log.warning("orphan %s could not be removed: %s", instance_id, exc)
                continue
            summary.orphans_removed += 1
            metrics.ORPHANS_REMOVED.inc()
            log.warning("orphan removed: %s %s (final backup: %s)", instance_id, why, result.backup)

    async def run(
        self,
        stop: asyncio.Event,
        election: LeaderElection | None = None,
        shards: ShardLeases | None = None,
    ) -> None:
        """Pass after pass: the leader does the duties, every process the instances of its shards
        (all of them without `shards`, on the leader only). A pass that found a full batch is
        followed by the next at once; otherwise the next comes after the interval."""
        interval = self.settings.reconciler.interval_s
        while not stop.is_set():
            liveness.LOOP.turned()  # what /healthz of the reconciler's metrics port reports
            leading = election is None or await election.ensure()
            metrics.RECONCILER_LEADER.set(1 if leading else 0)
            held = None if shards is None else await shards.ensure()
            full = False
            if leading or held:
                try:
                    if shards is None:
                        summary = await self.run_once()
                    else:
                        summary = await self.run_once(shards=shards, duties=leading)
                    full = summary.scanned >= self.settings.reconciler.batch_size
                    liveness.LOOP.reached(True)
                except (psycopg.OperationalError, PoolTimeout) as exc:
                    liveness.LOOP.reached(False)
                    log.warning("reconciler pass failed: %s", exc)
                except Exception:
                    # One broken pass must not stop reconciliation; the next pass tries again.
                    log.exception("reconciler pass failed")
            if not (leading or held):
                liveness.LOOP.reached(True)  # a standby: nothing of its own to pass over
            if full:
                await asyncio.sleep(0)  # more instances are due: the next pass now
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await stop.wait()
