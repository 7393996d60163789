"""The reconciler's pass over the live instances (observation, deadlines, heal) and its loop.

A pass observes, applies the deadlines, heals, corrects drift and honours deferred intents; the
loop runs passes, and the leader's maintenance (`reconciler.maintenance`) while it leads."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from controlplane.core import kinds, plans
from controlplane.core.dbmetrics import DatabaseStats
from controlplane.core.failures import DATA_LOST, STORAGE_FULL
from controlplane.core.kinds import RESUME, SUSPEND
from controlplane.core.records import InstancePatch, ScannedInstance
from controlplane.db import job_rows as jobs
from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.db.transitions import Actor, InvariantViolation, VersionConflict, transition
from controlplane.runtime import liveness, metrics
from controlplane.runtime.settings import Settings
from controlplane.services import backups
from provisioners.base import InstanceSpec, Provisioner, RecoveryWindow, operator_events_detail
from reconciler import autoscaling, planning
from reconciler.leader import LeaderElection, ShardLeases
from reconciler.maintenance import Maintenance

log = logging.getLogger(__name__)


@dataclass
class PassSummary:
    """What one pass saw and did."""

    scanned: int = 0
    observed: int = 0
    observe_failures: int = 0
    actions: dict[str, int] = field(default_factory=dict)
    conflicts: int = 0
    invariant_violations: int = 0
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
    inst: ScannedInstance,
    observed: planning.Observed | None,
    settings: Settings,
    *,
    backed_up: bool = False,
    fails_over_itself: bool = False,
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
        restore_given_up=inst.restore_given_up,
        window_held=inst.window_held,
        created_at=inst.created_at,
        backup_interval_s=_backup_interval_s(inst, backed_up),
        fails_over_itself=fails_over_itself,
        primary_seen=inst.primary_seen,
    )


def _payload(action: planning.Enqueue, billing_hold: bool) -> kinds.Payload:
    """What the reconciler asks of a job it enqueues: why, and for suspend and resume the billing
    side (and the code a suspension records)."""
    if action.kind == SUSPEND:
        return kinds.SuspendPayload(action.reason, billing=True if billing_hold else None, code=action.code)
    if action.kind == RESUME:
        return kinds.ResumePayload(action.reason, billing=False)
    return kinds.PAYLOADS[action.kind](action.reason)


def storage_rule(settings: Settings) -> planning.StorageRule:
    """Storage autoscaling's rule as the settings configure it."""
    rs = settings.reconciler
    return planning.StorageRule(
        enabled=rs.storage_autoscale,
        free_ratio=rs.storage_autoscale_free_pct / 100,
        for_s=rs.storage_autoscale_for_s,
        cooldown_s=rs.storage_autoscale_cooldown_s,
        grow_ratio=rs.storage_autoscale_grow_pct / 100,
        grow_min_gb=rs.storage_autoscale_grow_min_gb,
    )


def allocation(inst: ScannedInstance) -> tuple[int, int]:
    """The instance's storage allocation (GiB: its spec's, at least its plan's) and its plan's maximum."""
    spec = InstanceSpec.for_removal(inst.spec, inst.spec_generation)
    return spec.volume_gb, max(spec.volume_gb, plans.storage_max_gb(spec.plan))


def sample_rows(
    sampled: list[tuple[ScannedInstance, DatabaseStats, tuple[int, int]]],
    resolution_s: int,
    now: datetime,
    gb_bytes: int = planning.GB,
) -> dict[str, Any]:
    """RECORD_SAMPLES' parameters: a column array per metric."""
    columns = {
        "connections": [s.connections for _, s, _ in sampled],
        "max_connections": [s.max_connections for _, s, _ in sampled],
        "transactions": [s.transactions for _, s, _ in sampled],
        "rows_read": [s.rows_read for _, s, _ in sampled],
        "rows_written": [s.rows_written for _, s, _ in sampled],
        "blocks_hit": [s.blocks_hit for _, s, _ in sampled],
        "blocks_read": [s.blocks_read for _, s, _ in sampled],
        "size_bytes": [s.size_bytes for _, s, _ in sampled],
        "allocated_bytes": [gb[0] * gb_bytes for _, _, gb in sampled],
        "replication_lag_s": [s.replication_lag_s for _, s, _ in sampled],
        "archive_lag_s": [s.archive_lag_s for _, s, _ in sampled],
    }
    return {"ids": [inst.id for inst, _, _ in sampled], "resolution_s": resolution_s, "now": now, **columns}


class Reconciler:
    """Compares what the database declares with what the provisioner shows, and corrects it.

    `maintenance`, when given, is the leader's: the loop (`run`) runs it on every pass it makes as
    the leader. `gb_bytes` is the bytes of one allocated GB (a GiB; a test makes it small, so that
    a real write can fill an allocation).
    """

    def __init__(
        self,
        settings: Settings,
        pool: AsyncConnectionPool[AsyncConn],
        provisioner: Provisioner,
        *,
        reconciler_id: str = "reconciler",
        maintenance: Maintenance | None = None,
        gb_bytes: int = planning.GB,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.provisioner = provisioner
        self.actor = Actor("reconciler", reconciler_id)
        self.maintenance = maintenance
        self.gb_bytes = gb_bytes

    async def run_once(
        self, now: datetime | None = None, *, shards: ShardLeases | None = None
    ) -> PassSummary:
        """One bounded pass. `now` replaces the database clock in time comparisons (tests).

        With `shards`, the pass looks only at the instances of the shards held (and acts on one
        only while its shard is still held).
        """
        started = time.monotonic()
        summary = PassSummary()
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
        samples, storage = await self._sample(scanned, observations)
        backed_up = self.provisioner.supports_backups
        rule = storage_rule(self.settings)
        for inst in scanned:
            view = _view(
                inst,
                observations.get(inst.id),
                self.settings,
                backed_up=backed_up,
                fails_over_itself=self.provisioner.fails_over_itself,
            )
            view = replace(view, storage=storage.get(inst.id))
            actions = planning.plan(view, inst.now, self.settings.reconciler.deadline_max_retries, rule)
            if actions:
                await self._apply(inst, actions, summary, shards)
        if scanned:
            # The samples and the pass's mark in one commit: sampling adds a statement, not a flush.
            async with self.pool.connection() as conn, conn.transaction():
                if samples is not None:
                    await conn.execute(sql.RECORD_SAMPLES, samples, prepare=True)
                await conn.execute(sql.TOUCH_RECONCILED, {"ids": [inst.id for inst in scanned]}, prepare=True)
        summary.duration_s = time.monotonic() - started
        metrics.RECONCILE_PASS_DURATION.observe(summary.duration_s)
        metrics.RECONCILE_LAST_SUCCESS.set(time.time())
        busy = summary.actions or summary.observe_failures
        log.log(
            logging.INFO if busy else logging.DEBUG,
            "reconciler pass",
            extra={
                "scanned": summary.scanned,
                "observed": summary.observed,
                "actions": summary.actions,
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
            if seen.recovery is not None:
                windows[instance_id] = seen.recovery
            return instance_id, planning.Observed(
                exists=seen.exists,
                running=seen.running,
                healthy=seen.healthy,
                read_only=bool(seen.read_only),
                detail=seen.detail,
                data_lost=seen.data_lost,
                archive_failing=seen.archive_failing,
                archive_detail=seen.recovery.archive_detail if seen.recovery is not None else "",
                stats=seen.stats,
                failover_to=seen.failover_to,
                replication_degraded=seen.replication_degraded,
                replication_detail=seen.replication_detail,
                primary=seen.primary,
                primary_since=seen.primary_since,
            )

        windows: dict[uuid.UUID, RecoveryWindow] = {}
        results = await asyncio.gather(*(observe(i) for i in targets))
        summary.observed = sum(1 for _, seen in results if seen is not None)
        await self._record_windows(windows)
        return {instance_id: seen for instance_id, seen in results if seen is not None}

    async def _record_windows(self, windows: dict[uuid.UUID, RecoveryWindow]) -> None:
        """The recoverable windows the observations reported, recorded in one statement."""
        if not windows:
            return
        async with self.pool.connection() as conn:
            await backups.record_windows(conn, windows)
        metrics.ARCHIVE_FAILING.set(sum(1 for w in windows.values() if w.archive_healthy is False))
        metrics.ARCHIVE_LAG_SECONDS.set(max((w.lag_s or 0.0) for w in windows.values()))

    async def _sample(
        self, scanned: list[ScannedInstance], observations: dict[uuid.UUID, planning.Observed]
    ) -> tuple[dict[str, Any] | None, dict[uuid.UUID, planning.StorageView]]:
        """The observed databases' metrics as RECORD_SAMPLES' parameters (recorded with the pass's
        mark, one statement), and the storage of those nearly full with their recent samples (what
        storage autoscaling decides from), of those beyond their allocation, and of those held
        read-only for it (what holding a database to its allocation decides from)."""
        sampled = [
            (inst, seen.stats, allocation(inst))
            for inst in scanned
            if (seen := observations.get(inst.id)) is not None and seen.stats is not None
        ]
        if not sampled:
            return None, {}
        settings = self.settings.reconciler
        now = scanned[0].now
        unit = self.gb_bytes
        samples = sample_rows(sampled, settings.metrics_sample_s, now, unit)
        rule = storage_rule(self.settings)
        watched = [
            (inst, stats, gb)
            for inst, stats, gb in sampled
            if (rule.enabled and stats.size_bytes >= gb[0] * unit * (1 - rule.free_ratio))
            or stats.size_bytes > gb[0] * unit
            or inst.failure_code == STORAGE_FULL
        ]
        if not watched:
            return samples, {}
        recent: dict[uuid.UUID, list[tuple[datetime, int]]] = {}
        if rule.enabled:  # the samples before this one matter only to autoscaling
            async with self.pool.connection() as conn:
                since = now - timedelta(seconds=rule.for_s + 3 * settings.metrics_sample_s)
                cursor = await conn.execute(
                    sql.RECENT_STORAGE,
                    {
                        "ids": [inst.id for inst, _, _ in watched],
                        "resolution_s": settings.metrics_sample_s,
                        "since": since,
                    },
                )
                for row in await cursor.fetchall():
                    recent.setdefault(row["instance_id"], []).append((row["at"], int(row["size_bytes"])))
        return samples, {
            inst.id: planning.StorageView(
                allocated_gb=gb[0],
                maximum_gb=gb[1],
                used=[*(s for s in recent.get(inst.id, []) if s[0] < now), (now, stats.size_bytes)],
                grown_at=inst.storage_grown_at,
                warned_at=inst.storage_full_warned_at,
                gb_bytes=unit,
            )
            for inst, stats, gb in watched
        }

    async def _apply(
        self,
        inst: ScannedInstance,
        actions: list[planning.PlannedAction],
        summary: PassSummary,
        shards: ShardLeases | None,
    ) -> None:
        """Carry out one instance's actions in one transaction; a lost race leaves it to the next pass.

        With shards, only while this process still holds the instance's shard (else its new
        holder acts, and this process must not: each instance is acted on by one process)."""
        sre = await self._operator_events(inst, actions)
        try:
            async with self.pool.connection() as conn, conn.transaction():
                if shards is not None and not await shards.holds_shard_of(conn, inst.id):
                    summary.count("shard_moved")
                    log.info("instance %s: its shard moved to another reconciler; left to it", inst.id)
                    return
                for action in actions:
                    await self._apply_one(conn, inst, action, summary, sre)
        except VersionConflict as exc:
            summary.conflicts += 1
            log.info("reconciler lost a race on instance %s: %s", inst.id, exc)
        except InvariantViolation:
            # Logged at CRITICAL and counted by the transition path. The row is left as found
            # for an SRE; the other instances of the batch still get their pass.
            summary.invariant_violations += 1

    async def _operator_events(
        self, inst: ScannedInstance, actions: list[planning.PlannedAction]
    ) -> dict[str, Any] | None:
        """Where the operator fails over by itself, what it recorded of a failover being recorded,
        read before the transaction."""
        if not any(isinstance(a, planning.Transition) and a.operator_events for a in actions):
            return None
        return await operator_events_detail(self.provisioner, inst.id)

    async def _apply_one(
        self,
        conn: AsyncConn,
        inst: ScannedInstance,
        action: planning.PlannedAction,
        summary: PassSummary,
        sre: dict[str, Any] | None = None,
    ) -> None:
        if isinstance(action, planning.Transition):
            failing = action.event in ("fail", "degrade")
            detail: dict[str, Any] = {"code": action.code} if failing and action.code else {}
            detail.update(action.detail or {})
            if action.operator_events and sre is not None:
                detail["sre"] = sre
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
                detail=detail or None,
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
        elif isinstance(action, planning.GrowStorage | planning.WarnStorageFull):
            if await autoscaling.apply(conn, inst, action, self.actor, self.settings):
                grown = isinstance(action, planning.GrowStorage)
                summary.count("storage_grown" if grown else "storage_full_warned")
                log.info("instance %s: %s", inst.id, action.reason)
        elif isinstance(action, planning.NotePrimary):
            await conn.execute(
                sql.SET_PRIMARY_SEEN,
                {"id": inst.id, "state_version": inst.state_version, "primary": action.primary},
            )
        elif isinstance(action, planning.Enqueue):
            payload = _payload(action, inst.billing_hold)
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
            inst.newest_backup_at or ("one its archive holds" if inst.window_held else "none held"),
            extra={"instance_id": str(inst.id), "failure_code": DATA_LOST},
        )

    async def run(
        self,
        stop: asyncio.Event,
        election: LeaderElection | None = None,
        shards: ShardLeases | None = None,
    ) -> None:
        """Pass after pass: the leader runs its maintenance, then every process the instances of
        its shards (all of them without `shards`, on the leader only). A pass that found a full
        batch is followed by the next at once; otherwise the next comes after the interval."""
        interval = self.settings.reconciler.interval_s
        while not stop.is_set():
            liveness.LOOP.turned()  # what /healthz of the reconciler's metrics port reports
            leading = election is None or await election.ensure()
            metrics.RECONCILER_LEADER.set(1 if leading else 0)
            held = None if shards is None else await shards.ensure()
            full = False
            if leading or held:
                try:
                    if leading and self.maintenance is not None:
                        await self.maintenance.run_once()
                    summary = await self.run_once(shards=shards)
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
        if self.maintenance is not None:
            await self.maintenance.close()
