"""The instance operations as job handlers: each drives the instance lifecycle through the transition path."""

from __future__ import annotations

import asyncio
import base64
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import PurePath
from typing import Any, TypeVar

from controlplane.core import actions, kinds, lifecycle
from controlplane.core.failures import DATA_LOST, FAILOVER, STORAGE_FULL, failover_by_operator
from controlplane.core.kinds import (
    BACKUP,
    DEPROVISION,
    HEAL,
    INSTANCE_JOB_KINDS,
    PROVISION,
    RESTORE,
    RESUME,
    SUSPEND,
    UPDATE,
)
from controlplane.core.records import Instance, InstancePatch
from controlplane.core.refusals import NotFound
from controlplane.core.step_errors import PermanentError, StaleFence, TemporaryError
from controlplane.db import sql
from controlplane.db.instance_rows import transition_instance
from controlplane.db.transitions import VersionConflict
from controlplane.handlers import abandonment, delivery, usage_reports
from controlplane.queue import steps
from controlplane.queue.registry import AbandonHook, Handler, JobContext, JobKind, JobRegistry, Verdict
from controlplane.runtime import tracing
from controlplane.runtime.secretbox import SecretBox, load_box
from controlplane.services import backups
from provisioners.base import (
    JOB_ATTEMPT,
    PROVISIONING_STEPS,
    ConnectionInfo,
    InstanceSpec,
    Provisioner,
    Restored,
    RestorePoint,
    operator_events_detail,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
# How often a handler re-reads and decides again when other actors keep moving the instance.
MAX_DECISIONS = 8
NOTHING_TO_DO: Verdict = {"result": "nothing to do"}


class DecideAgain(Exception):
    """The instance changed under the handler (a progress write matched nothing): decide again."""


def _deferred(inst: Instance) -> Verdict:
    """Not now: the intent stays recorded on the instance and the reconciler re-enqueues later."""
    return {"result": "deferred", "state": inst.state}


def _not_now(inst: Instance) -> Verdict:
    """Nothing to do for an instance that is gone or going, else deferred."""
    return NOTHING_TO_DO if inst.state in lifecycle.GONE_OR_GOING else _deferred(inst)


@dataclass(frozen=True)
class Target:
    """What a heal or a restore brings an instance back to: the declared spec, or the one it last
    ran when the declared generation was given up (rolled back)."""

    declared: Mapping[str, Any]
    spec: InstanceSpec
    rolled_back: bool


async def _named(step: str, work: Callable[[], Awaitable[T]]) -> T:
    """Run one provisioner call; its errors name the step (and keep their code)."""
    try:
        return await work()
    except PermanentError as exc:
        raise PermanentError(f"{step}: {exc}", code=exc.code) from exc
    except TemporaryError as exc:
        raise TemporaryError(f"{step}: {exc}", exc.delay_s, code=exc.code) from exc


@dataclass
class Operations:
    """The instance operations over one provisioner (their abandonment hooks need none:
    `controlplane.handlers.abandonment`)."""

    provisioner: Provisioner

    # ---- plumbing ---------------------------------------------------------------------------

    async def _load(self, ctx: JobContext) -> Instance:
        async with ctx.pool.connection() as conn:
            cursor = await conn.execute(sql.INSTANCE_WITH_HOLD, {"id": ctx.instance_id})
            row = await cursor.fetchone()
        if row is None:
            raise PermanentError(f"instance {ctx.instance_id} does not exist")
        return Instance.from_row(row)

    async def _move(
        self,
        ctx: JobContext,
        inst: Instance,
        event: str,
        *,
        reason: str | None = None,
        detail: Mapping[str, Any] | None = None,
        patch: InstancePatch | None = None,
    ) -> Instance:
        # The job is named in every move it makes: the audit log finds what its enqueuer caused.
        detail = {**(detail or {}), "job_id": str(ctx.job["id"])}
        async with ctx.pool.connection() as conn:
            return await transition_instance(
                conn, inst, event, ctx.actor, reason=reason, detail=detail, patch=patch
            )

    async def _progress(self, ctx: JobContext, inst: Instance, text: str | None) -> None:
        """Show what runs now on the instance (progress is outside the guarded columns)."""
        async with ctx.pool.connection() as conn:
            cursor = await conn.execute(
                sql.SET_PROGRESS,
                {"progress": text, "id": inst.id, "state": inst.state, "state_version": inst.state_version},
            )
        if cursor.rowcount == 0:
            raise DecideAgain(f"instance {inst.id} left {inst.state!r} v{inst.state_version}")

    async def _step(self, ctx: JobContext, inst: Instance, step: str, work: Callable[[], Awaitable[T]]) -> T:
        """Run one provisioner step, recorded as it starts and as it finishes or fails (and shown on
        the instance while it runs), in a span of its own; its errors name the step."""
        attributes = {"controlplane.step": step, "controlplane.instance.id": str(inst.id)}
        with tracing.child_span(f"step {step}", attributes):
            return await self._recorded_step(ctx, inst, step, work)

    async def _recorded_step(
        self, ctx: JobContext, inst: Instance, step: str, work: Callable[[], Awaitable[T]]
    ) -> T:
        async with ctx.pool.connection() as conn:
            try:
                await steps.started(conn, ctx, inst, step)
            except steps.InstanceMoved as exc:
                raise DecideAgain(str(exc)) from None
        try:
            result = await _named(step, work)
        except (asyncio.CancelledError, StaleFence):
            raise  # the job is no longer this worker's: nothing of it is recorded any more
        except Exception as exc:
            await self._record_failure(ctx, inst, step, exc)
            raise
        async with ctx.pool.connection() as conn:
            if not await steps.ended(conn, ctx, inst.id, step):
                raise steps.NotHeld(ctx.job_id, ctx.fence)
        return result

    @staticmethod
    async def _record_failure(ctx: JobContext, inst: Instance, step: str, error: Exception) -> None:
        """The step's failure on record; if even that fails, the step's own error still goes on."""
        try:
            async with ctx.pool.connection() as conn:
                await steps.ended(conn, ctx, inst.id, step, error)
        except Exception as exc:  # the job's error is what the worker must report
            log.warning("job %s: the failure of step %s was not recorded: %s", ctx.job_id, step, exc)

    async def _drive(
        self, ctx: JobContext, decide: Callable[[JobContext, Instance], Awaitable[Verdict]]
    ) -> Verdict:
        """Decide from where the instance is; when someone else moved it, re-read and decide again."""
        token = JOB_ATTEMPT.set(ctx.attempt)
        try:
            for _ in range(MAX_DECISIONS):
                inst = await self._load(ctx)
                try:
                    return await decide(ctx, inst)
                except (VersionConflict, DecideAgain) as exc:
                    log.info("job %s: %s; deciding again", ctx.job_id, exc)
            raise TemporaryError(f"instance {ctx.instance_id} kept moving under the job")
        finally:
            JOB_ATTEMPT.reset(token)

    @staticmethod
    def _spec(inst: Instance) -> InstanceSpec:
        return InstanceSpec.from_row(inst.spec, int(inst.spec_generation), org_id=inst.org_id)

    @staticmethod
    def _box(ctx: JobContext) -> SecretBox:
        box = ctx.services.get("secretbox")
        return box if isinstance(box, SecretBox) else load_box(ctx.settings)

    def _credentials_patch(
        self, ctx: JobContext, inst: Instance, info: ConnectionInfo, patch: InstancePatch
    ) -> InstancePatch:
        """`patch` with connection (never the password) and secret, when they differ from what is recorded."""
        if inst.connection != info.public():
            patch = replace(patch, connection=info.public())
        if self._password(ctx, inst) != info.password:
            patch = replace(patch, secret=base64.b64encode(self._box(ctx).encrypt(info.password)).decode())
        return patch

    def _password(self, ctx: JobContext, inst: Instance) -> str | None:
        if inst.secret is None:
            return None
        try:
            return self._box(ctx).decrypt(bytes(inst.secret))
        except ValueError:
            log.warning("instance %s: recorded credential cannot be decrypted; issuing a new one", inst.id)
            return None

    # ---- provision --------------------------------------------------------------------------

    async def provision(self, ctx: JobContext) -> Verdict:
        return await self._drive(ctx, self._provision)

    async def _provision(self, ctx: JobContext, inst: Instance) -> Verdict:
        if inst.state == "pending":
            inst = await self._move(
                ctx,
                inst,
                "start_provisioning",
                patch=InstancePatch(
                    PROVISIONING_STEPS[0], ctx.settings.reconciler.deadline_s("provisioning")
                ),
            )
        if inst.state != "provisioning":
            return NOTHING_TO_DO
        spec = self._spec(inst)
        iid, fence, p = inst.id, ctx.fence, self.provisioner
        p.refuse_unsupported_restore(spec)
        await self._step(ctx, inst, "allocate_storage", lambda: p.allocate_storage(iid, spec, fence))
        await self._step(ctx, inst, "configure_network", lambda: p.configure_network(iid, spec, fence))
        info = await self._step(
            ctx, inst, "initialize_database", lambda: p.initialize_database(iid, spec, fence)
        )
        await self._step(ctx, inst, "configure_archive", lambda: p.configure_archive(iid, spec, fence))
        if spec.shape.instances > 1:  # an HA plan's standbys (a one-server plan has none to start)
            await self._step(ctx, inst, "start_standbys", lambda: p.start_standbys(iid, spec, fence))
        await self._move(
            ctx,
            inst,
            "provisioned",
            reason="provisioned",
            detail={"endpoint": f"{info.host}:{info.port}", "plan": spec.plan},
            patch=self._credentials_patch(
                ctx, inst, info, InstancePatch(observed_generation=spec.generation, observed_spec=inst.spec)
            ),
        )
        return {"result": "ready", "endpoint": f"{info.host}:{info.port}"}

    # ---- update -----------------------------------------------------------------------------

    async def update(self, ctx: JobContext) -> Verdict:
        return await self._drive(ctx, self._update)

    async def _update(self, ctx: JobContext, inst: Instance) -> Verdict:
        payload = ctx.typed_payload(kinds.UpdatePayload)
        if payload.switchover:
            return await self._switchover(ctx, inst, payload)
        if inst.state == "ready":
            if inst.observed_generation >= inst.spec_generation:
                return NOTHING_TO_DO
            inst = await self._move(
                ctx,
                inst,
                "update",
                reason=ctx.typed_payload(kinds.UpdatePayload).reason,
                detail={"storage_gb": self._spec(inst).volume_gb},
                patch=InstancePatch("apply_plan", ctx.settings.reconciler.deadline_s("updating")),
            )
        if inst.state != "updating":
            return _not_now(inst)
        spec = self._spec(inst)
        changed = await self._step(
            ctx, inst, "apply_plan", lambda: self.provisioner.apply_plan(inst.id, spec, ctx.fence)
        )
        patch = InstancePatch(observed_generation=spec.generation, observed_spec=inst.spec)
        recorded = inst.connection or {}
        ha = spec.shape.instances > 1
        unpooled = self.provisioner.pools_ha_endpoint and ha and not recorded.get("pool_mode")
        no_reads = self.provisioner.serves_read_only and ha and not recorded.get("read_only")
        if unpooled or no_reads:
            # Onto an HA plan: its customers get the pooled address that follows the primary, and
            # the read-only one of its standbys (once).
            password = self._password(ctx, inst)
            info = await self._step(
                ctx,
                inst,
                "initialize_database",
                lambda: self.provisioner.initialize_database(inst.id, spec, ctx.fence, password=password),
            )
            patch = self._credentials_patch(ctx, inst, info, patch)
        elif not ha and recorded.get("read_only"):
            # Off an HA plan: no standby left to read from.
            patch = replace(patch, connection={k: v for k, v in recorded.items() if k != "read_only"})
        await self._move(
            ctx,
            inst,
            "updated",
            reason=f"plan {spec.plan} applied, {spec.volume_gb} GB allocated",
            detail={
                "plan": spec.plan,
                "storage_gb": spec.volume_gb,
                "generation": spec.generation,
                "restarted_or_changed": changed,
            },
            patch=patch,
        )
        return {"result": "ready", "plan": spec.plan, "generation": spec.generation}

    async def _switchover(self, ctx: JobContext, inst: Instance, payload: kinds.UpdatePayload) -> Verdict:
        """ready -> updating -> ready around a switchover an SRE asked for (the plan unchanged)."""
        if inst.state == "ready":
            inst = await self._move(
                ctx,
                inst,
                "update",
                reason=payload.reason or "switchover",
                patch=InstancePatch("switchover", ctx.settings.reconciler.deadline_s("updating")),
            )
        if inst.state != "updating":
            return _not_now(inst)
        spec = self._spec(inst)
        promotion = await self._step(
            ctx, inst, "switchover", lambda: self.provisioner.switchover(inst.id, spec, ctx.fence)
        )
        if promotion is None:
            reason, detail = "switchover: no standby to switch over to; nothing changed", {}
        else:
            new, old = promotion.promoted, promotion.fenced
            at = f" (WAL {promotion.lsn})" if promotion.lsn else ""
            reason = f"switchover: {new} is the primary{at}, {old} its standby"
            detail = {"switchover": promotion.as_dict()}
        await self._move(
            ctx,
            inst,
            "updated",
            reason=reason,
            detail=detail,
            patch=InstancePatch(observed_generation=spec.generation, observed_spec=inst.spec),
        )
        return {"result": "ready", "switchover": None if promotion is None else promotion.as_dict()}

    # ---- suspend and resume -----------------------------------------------------------------

    async def suspend(self, ctx: JobContext) -> Verdict:
        return await self._drive(ctx, self._suspend)

    async def _suspend(self, ctx: JobContext, inst: Instance) -> Verdict:
        """Read-only first, then ready -> suspended: the record never claims more than is true."""
        payload = ctx.typed_payload(kinds.SuspendPayload)
        by_billing = inst.suspended_by_billing if payload.billing is None else payload.billing
        spec = self._spec(inst)
        if inst.state == "suspended":
            changed = await self.provisioner.suspend(inst.id, spec, ctx.fence)
            return {"result": "suspended (repaired)"} if changed else NOTHING_TO_DO
        if inst.state != "ready":
            return _not_now(inst)
        if by_billing and not inst.billing_hold:
            return {"result": "nothing to do", "why": "the billing hold was released before it ran"}
        await self._step(ctx, inst, "suspend", lambda: self.provisioner.suspend(inst.id, spec, ctx.fence))
        reason = payload.reason or ("billing hold" if by_billing else "suspended")
        patch = InstancePatch(suspended_by_billing=by_billing)
        coded = payload.code == STORAGE_FULL and not by_billing
        if coded:
            # Held to its storage allocation: the code says why to the customer, until resumed.
            patch = replace(patch, failure_code=STORAGE_FULL, failure_reason=reason)
        await self._move(
            ctx, inst, "suspend", reason=reason, detail={"code": STORAGE_FULL} if coded else None, patch=patch
        )
        return {"result": "suspended"}

    async def resume(self, ctx: JobContext) -> Verdict:
        return await self._drive(ctx, self._resume)

    async def _resume(self, ctx: JobContext, inst: Instance) -> Verdict:
        """suspended -> ready first, then writes back on: a failure from ready can land in degraded."""
        spec = self._spec(inst)
        if inst.state == "suspended":
            patch = InstancePatch("resume", suspended_by_billing=False)
            if inst.failure_code == STORAGE_FULL:  # what held it is over (lost data stays recorded)
                patch = replace(patch, failure_code=None, failure_reason=None)
            inst = await self._move(
                ctx,
                inst,
                "resume",
                reason=ctx.typed_payload(kinds.ResumePayload).reason or "resumed",
                patch=patch,
            )
        elif inst.state != "ready":
            return _not_now(inst)
        changed = await self._step(
            ctx, inst, "resume", lambda: self.provisioner.resume(inst.id, spec, ctx.fence)
        )
        await self._progress(ctx, inst, None)
        return {"result": "ready"} if changed else NOTHING_TO_DO

    # ---- heal -------------------------------------------------------------------------------

    async def heal(self, ctx: JobContext) -> Verdict:
        return await self._drive(ctx, self._heal)

    async def _heal(self, ctx: JobContext, inst: Instance) -> Verdict:
        """degraded -> ready after re-running every step: each adopts what is there, repairs the rest.

        Never over lost data: re-running the steps would make an empty database that says ready.
        """
        if inst.state != "degraded":
            return NOTHING_TO_DO
        iid, fence, p = inst.id, ctx.fence, self.provisioner
        before = await p.observe(iid)
        if inst.failure_code == DATA_LOST or before.data_lost:
            raise PermanentError(
                "heal: the instance's data is lost; it comes back only with a restore (from a backup, "
                "or empty once that is accepted)"
            )
        target = self._target(inst)
        failover = None
        if before.failover_to is not None and not p.fails_over_itself:
            # The primary is lost and a standby can take over: fenced first, then the promotion
            # (where the provisioner's operator fails over by itself, the heal waits for it instead).
            failover = await self._fail_over(ctx, inst, target.spec)
        await self._step(ctx, inst, "allocate_storage", lambda: p.allocate_storage(iid, target.spec, fence))
        info = await self._bring_up(ctx, inst, target)
        sre: dict[str, Any] = {"before": before.as_dict()}
        if failover is None and inst.failure_code == FAILOVER and p.fails_over_itself:
            # The operator failed over by itself and the heal waited for the rest: recorded as one.
            after = await p.observe(iid)
            failover = failover_by_operator(after.primary, after.primary_since)
            sre.update(await operator_events_detail(p, iid))
        rolled = f", back on plan {target.spec.plan}" if target.rolled_back else ""
        detail: dict[str, Any] = {
            "endpoint": f"{info.host}:{info.port}",
            "plan": target.spec.plan,
            "rolled_back": target.rolled_back,
            # What the provisioner saw before (its words may name servers and paths), and what
            # an operator that failed over by itself recorded of it.
            "sre": sre,
        }
        reason = "repaired" + rolled
        if failover is not None and failover.get("by") == "operator":
            detail["failover"] = failover
            reason = f"failover: {failover['promoted']} promoted by the operator{rolled}"
        elif failover is not None:
            detail["failover"] = failover
            reason = (
                f"failover: {failover['promoted']} promoted at WAL {failover['lsn']} after "
                f"{failover['fenced']} was fenced; writes refused for about "
                f"{failover['writes_refused_s']:.1f} s since the loss was detected{rolled}"
            )
        await self._move(
            ctx,
            inst,
            "recover",
            reason=reason,
            detail=detail,
            patch=self._recovered(ctx, inst, info, target),
        )
        verdict = {"result": "ready", "repaired": before.detail, "plan": target.spec.plan}
        return verdict if failover is None else {**verdict, "failover": failover}

    async def _fail_over(self, ctx: JobContext, inst: Instance, spec: InstanceSpec) -> dict[str, Any]:
        """Fence the lost primary, then promote the most advanced standby (each a recorded, fenced
        step); what it did, and for how long writes were refused since the loss was detected."""
        iid, fence, p = inst.id, ctx.fence, self.provisioner
        await self._step(ctx, inst, "fence_primary", lambda: p.fence_primary(iid, spec, fence))
        promotion = await self._step(
            ctx, inst, "promote_standby", lambda: p.promote_standby(iid, spec, fence)
        )
        promoted_at = datetime.fromisoformat(promotion.at)
        refused = max(0.0, (promoted_at - inst.state_entered_at).total_seconds())
        return {
            **promotion.as_dict(),
            "detected_at": inst.state_entered_at.isoformat(),
            "writes_refused_s": refused,
        }

    def _target(self, inst: Instance) -> Target:
        if inst.observed_spec is not None and inst.failed_generation == inst.spec_generation:
            # The latest plan change was given up: back to the plan it last ran, not to the one that
            # may have broken it. The declared spec stays, for the customer to change again.
            declared = inst.observed_spec
            spec = InstanceSpec.from_row(declared, int(inst.observed_generation), org_id=inst.org_id)
            return Target(declared, spec, True)
        return Target(inst.spec, self._spec(inst), False)

    async def _bring_up(self, ctx: JobContext, inst: Instance, target: Target) -> ConnectionInfo:
        """The steps after storage, as a heal and a restore both need them; the server healthy."""
        iid, fence, p, spec = inst.id, ctx.fence, self.provisioner, target.spec
        await self._step(ctx, inst, "configure_network", lambda: p.configure_network(iid, spec, fence))
        await self._step(ctx, inst, "resume", lambda: p.resume(iid, spec, fence))
        if spec.shape.instances > 1:
            # The standbys before any write: with commits synchronous, a write waits for one of them.
            await self._step(ctx, inst, "start_standbys", lambda: p.start_standbys(iid, spec, fence))
        info = await self._step(
            ctx,
            inst,
            "initialize_database",
            lambda: p.initialize_database(iid, spec, fence, password=self._password(ctx, inst)),
        )
        await self._step(ctx, inst, "apply_plan", lambda: p.apply_plan(iid, spec, fence))
        await self._step(ctx, inst, "configure_archive", lambda: p.configure_archive(iid, spec, fence))
        after = await p.observe(iid)
        if not after.healthy:
            raise TemporaryError(f"{ctx.job['kind']}: instance still unhealthy: {after.detail}")
        return info

    def _recovered(
        self, ctx: JobContext, inst: Instance, info: ConnectionInfo, target: Target
    ) -> InstancePatch:
        """The patch of a `recover`: credentials if changed, the spec applied, nothing wrong any more."""
        return self._credentials_patch(
            ctx,
            inst,
            info,
            InstancePatch(
                observed_generation=target.spec.generation,
                observed_spec=target.declared,
                failure_reason=None,
                failure_code=None,
            ),
        )

    # ---- backup and restore -----------------------------------------------------------------

    async def backup(self, ctx: JobContext) -> Verdict:
        """A backup of a running instance (ready or suspended); the record then follows the provisioner's."""
        inst = await self._load(ctx)
        if not actions.can_back_up(inst.state):
            return {"result": "nothing to do", "why": f"instance is {inst.state}"}
        payload = ctx.typed_payload(kinds.BackupPayload)
        token = JOB_ATTEMPT.set(ctx.attempt)
        try:
            taken = await _named(
                "take_backup",
                lambda: self.provisioner.take_backup(
                    inst.id, self._spec(inst), ctx.fence, kind=payload.backup_kind
                ),
            )
        finally:
            JOB_ATTEMPT.reset(token)
        held = await self._record_backups(ctx, inst.id)
        return {"result": "backed up", "backup": taken.name, "held": held}

    async def _record_backups(self, ctx: JobContext, instance_id: uuid.UUID) -> int:
        """The record made what the provisioner holds now: the backups and the recoverable window."""
        listing = await self.provisioner.list_backups(instance_id)
        window = await self.provisioner.recovery_window(instance_id)
        async with ctx.pool.connection() as conn:
            await backups.record(conn, instance_id, listing)
            if window is not None:
                await backups.record_windows(conn, {instance_id: window})
        return len(listing)

    async def restore(self, ctx: JobContext) -> Verdict:
        return await self._drive(ctx, self._restore)

    async def _restore(self, ctx: JobContext, inst: Instance) -> Verdict:
        """degraded (data lost) -> ready with the data of a held backup, or empty once accepted."""
        if not actions.can_restore(inst.state, inst.failure_code, deletion_requested=inst.deletion_requested):
            why = "its deletion was requested" if inst.deletion_requested else "its data not lost"
            return {"result": "nothing to do", "why": f"instance is {inst.state}, {why}"}
        payload = ctx.typed_payload(kinds.RestorePayload)
        if not payload.empty and self.provisioner.supports_backups:
            # What the repository holds, recorded first: a backup whose job was interrupted before
            # its record (the control plane's database away) is restorable all the same.
            await self._record_backups(ctx, inst.id)
        async with ctx.pool.connection() as conn:
            try:
                source = await backups.backup_to_restore(conn, inst.id, payload)
            except NotFound as exc:
                raise PermanentError(f"restore: {exc}") from exc
        iid, fence, p, target = inst.id, ctx.fence, self.provisioner, self._target(inst)
        point = RestorePoint(backup=payload.backup_id, empty=source is None)
        restored = await self._step(
            ctx, inst, "restore", lambda: p.restore(iid, target.spec, fence, point=point)
        )
        info = await self._bring_up(ctx, inst, target)
        accepted_by = payload.accepted_by
        if source is None:
            reason = "re-initialised empty: the loss of its data was accepted"
        elif point.backup is not None:
            taken = source.taken_at.isoformat(timespec="seconds")
            reason = f"restored from backup {point.backup} taken at {taken}; changes made after it are lost"
        else:
            reason = _to_end_of_archive(restored)
        await self._move(
            ctx,
            inst,
            "recover",
            reason=reason + (f" (decided by {accepted_by})" if accepted_by else " (by policy)"),
            detail={
                "code": DATA_LOST,
                "restored_from": point.backup or ("archive" if source is not None else None),
                "taken_at": None if point.backup is None or source is None else source.taken_at.isoformat(),
                "recovered_to": restored.recovered_to,
                "covered_until": restored.covered_until,
                "seconds_lost": restored.lost_s,
                "empty": source is None,
                "accepted_by": accepted_by,
                "why": payload.reason,
                "endpoint": f"{info.host}:{info.port}",
            },
            patch=self._recovered(ctx, inst, info, target),
        )
        return {"result": "ready", "restored_from": point.backup, "empty": source is None}

    # ---- deprovision ------------------------------------------------------------------------

    async def deprovision(self, ctx: JobContext) -> Verdict:
        return await self._drive(ctx, self._deprovision)

    async def _deprovision(self, ctx: JobContext, inst: Instance) -> Verdict:
        state = inst.state
        payload = ctx.typed_payload(kinds.DeprovisionPayload)
        asked = payload.skip_final_backup
        skip_backup = bool(inst.skip_final_backup if asked is None else asked)
        if state == "failed":
            return await self._cleanup(ctx, inst, skip_backup)
        if state in lifecycle.DEPROVISIONABLE:
            inst = await self._move(
                ctx,
                inst,
                "deprovision",
                reason=payload.reason or "deletion requested",
                patch=InstancePatch("deprovision", ctx.settings.reconciler.deadline_s("deprovisioning")),
            )
        elif state != "deprovisioning":
            return NOTHING_TO_DO if state == "deleted" else _deferred(inst)
        spec, p = self._spec(inst), self.provisioner
        name = None
        if not skip_backup:
            name = await self._step(
                ctx, inst, "final_backup", lambda: p.final_backup(inst.id, spec, ctx.fence)
            )
        result = await self._step(
            ctx,
            inst,
            "deprovision",
            lambda: p.deprovision(inst.id, spec, ctx.fence, skip_backup=skip_backup),
        )
        # The backup's name is shown to the customer, where the provisioner keeps it only to SREs.
        shown = name or (PurePath(result.backup).name if result.backup else None)
        await self._record_backups(ctx, inst.id)
        await self._move(
            ctx,
            inst,
            "deprovisioned",
            reason="final backup skipped" if skip_backup else f"final backup {shown}",
            detail={"backup": shown, "skip_backup": skip_backup, "sre": {"location": result.backup}},
            patch=InstancePatch(secret=None),
        )
        return {"result": "deleted", "backup": result.backup}

    async def _cleanup(self, ctx: JobContext, inst: Instance, skip_backup: bool) -> Verdict:
        """Remove what a failed instance still has; the instance stays failed."""
        result = await self.provisioner.deprovision(
            inst.id,
            InstanceSpec.for_removal(inst.spec, int(inst.spec_generation)),
            ctx.fence,
            skip_backup=skip_backup,
        )
        return {"result": "cleaned up", "backup": result.backup, "removed": result.removed}


def _to_end_of_archive(restored: Restored) -> str:
    """The `recover` reason of a restore to the end of the instance's archive."""
    reason = "restored to the end of its continuous archive"
    if restored.recovered_to is not None:
        reason += f": its last transaction recovered is of {restored.recovered_to}"
    if restored.lost_s is not None:
        lost = round(restored.lost_s)
        reason += f"; {lost} s of writes before the loss could not be recovered"
    return reason


def kind_table(operations: Operations | None) -> list[JobKind]:
    """The instance job kinds: handlers over `operations` (none without), abandonment hooks."""
    hooks: dict[str, AbandonHook | None] = {
        PROVISION: abandonment.provision_abandoned,
        UPDATE: abandonment.update_abandoned,
        SUSPEND: abandonment.degrade_abandoned,
        RESUME: abandonment.degrade_abandoned,
        HEAL: abandonment.degrade_abandoned,
        DEPROVISION: abandonment.deprovision_abandoned,
        BACKUP: None,
        RESTORE: abandonment.degrade_abandoned,
    }
    handlers: dict[str, Handler] = {}
    if operations is not None:
        handlers = {
            PROVISION: operations.provision,
            UPDATE: operations.update,
            SUSPEND: operations.suspend,
            RESUME: operations.resume,
            HEAL: operations.heal,
            DEPROVISION: operations.deprovision,
            BACKUP: operations.backup,
            RESTORE: operations.restore,
        }
    return [JobKind(name, handlers.get(name), on_abandoned=hooks[name]) for name in INSTANCE_JOB_KINDS]


def registry(provisioner: Provisioner | None = None) -> JobRegistry:
    """The job registry of a process: the instance operations over `provisioner`, or, without one
    (the API, an operator's command), their abandonment hooks only: such a process runs no job."""
    runs = provisioner is not None
    instance_kinds = kind_table(Operations(provisioner) if provisioner is not None else None)
    return JobRegistry([*instance_kinds, *delivery.kinds(runs), *usage_reports.kinds(runs)])
