"""The instance operations as job handlers: each drives the instance lifecycle through the transition path."""

from __future__ import annotations

import base64
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from psycopg.rows import DictRow

from controlplane import backups, jobs
from controlplane.db import AsyncConn
from controlplane.failures import DATA_LOST
from controlplane.handlers import (
    BACKUP,
    DEPROVISION,
    HEAL,
    PROVISION,
    RESTORE,
    RESUME,
    SUSPEND,
    UPDATE,
    AbandonHook,
    Handler,
    JobContext,
    JobKind,
    JobRegistry,
    PermanentError,
    TemporaryError,
    Verdict,
)
from controlplane.secretbox import SecretBox, load_box
from controlplane.transitions import Actor, Conflict, transition
from provisioners.base import (
    JOB_ATTEMPT,
    PROVISIONING_STEPS,
    ConnectionInfo,
    InstanceSpec,
    Provisioner,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
# How often a handler re-reads and decides again when other actors keep moving the instance.
MAX_DECISIONS = 8
NOTHING_TO_DO: Verdict = {"result": "nothing to do"}
# Cleanup after a failure: the instance stays failed, its resources go.
CLEANUP = "cleanup"


class Moved(Exception):
    """The instance changed under the handler (a progress write matched nothing): decide again."""


def _deferred(inst: Mapping[str, Any]) -> Verdict:
    """Not now: the intent stays recorded on the instance and the reconciler re-enqueues later."""
    return {"result": "deferred", "state": inst["state"]}


def _not_now(inst: Mapping[str, Any]) -> Verdict:
    """Nothing to do for an instance that is gone or going, else deferred."""
    return NOTHING_TO_DO if inst["state"] in ("deleted", "failed", "deprovisioning") else _deferred(inst)


@dataclass(frozen=True)
class Target:
    """What a heal or a restore brings an instance back to: the declared spec, or the one it last
    ran when the declared generation was given up (rolled back)."""

    declared: Mapping[str, Any]
    spec: InstanceSpec
    rolled_back: bool


async def _named(step: str, work: Callable[[], Awaitable[T]]) -> T:
    """Run one provisioner call; its errors name the step."""
    try:
        return await work()
    except PermanentError as exc:
        raise PermanentError(f"{step}: {exc}") from exc
    except TemporaryError as exc:
        raise TemporaryError(f"{step}: {exc}", exc.delay_s) from exc


@dataclass
class Operations:
    """The instance operations over one provisioner."""

    provisioner: Provisioner

    # ---- plumbing ---------------------------------------------------------------------------

    async def _load(self, ctx: JobContext) -> DictRow:
        async with ctx.pool.connection() as conn:
            cursor = await conn.execute(
                "SELECT i.*, o.billing_hold FROM instances i JOIN organisations o ON o.id = i.org_id"
                " WHERE i.id = %s",
                (ctx.instance_id,),
            )
            row = await cursor.fetchone()
        if row is None:
            raise PermanentError(f"instance {ctx.instance_id} does not exist")
        return row

    async def _move(
        self,
        ctx: JobContext,
        inst: Mapping[str, Any],
        event: str,
        *,
        reason: str | None = None,
        detail: Mapping[str, Any] | None = None,
        patch: Mapping[str, Any] | None = None,
    ) -> DictRow:
        async with ctx.pool.connection() as conn:
            return await _transition(conn, inst, event, ctx.actor, reason=reason, detail=detail, patch=patch)

    async def _progress(self, ctx: JobContext, inst: Mapping[str, Any], text: str | None) -> None:
        """Show what runs now on the instance (progress is outside the guarded columns)."""
        async with ctx.pool.connection() as conn:
            cursor = await conn.execute(
                "UPDATE instances SET progress = %s, updated_at = now()"
                " WHERE id = %s AND state = %s AND state_version = %s",
                (text, inst["id"], inst["state"], inst["state_version"]),
            )
        if cursor.rowcount == 0:
            raise Moved(f"instance {inst['id']} left {inst['state']!r} v{inst['state_version']}")

    async def _step(
        self, ctx: JobContext, inst: Mapping[str, Any], step: str, work: Callable[[], Awaitable[T]]
    ) -> T:
        """Run one provisioner step with its progress shown; its errors name the step."""
        await self._progress(ctx, inst, step)
        return await _named(step, work)

    async def _drive(
        self, ctx: JobContext, decide: Callable[[JobContext, DictRow], Awaitable[Verdict]]
    ) -> Verdict:
        """Decide from where the instance is; when someone else moved it, re-read and decide again."""
        token = JOB_ATTEMPT.set(ctx.attempt)
        try:
            for _ in range(MAX_DECISIONS):
                inst = await self._load(ctx)
                try:
                    return await decide(ctx, inst)
                except (Conflict, Moved) as exc:
                    log.info("job %s: %s; deciding again", ctx.job_id, exc)
            raise TemporaryError(f"instance {ctx.instance_id} kept moving under the job")
        finally:
            JOB_ATTEMPT.reset(token)

    @staticmethod
    def _spec(inst: Mapping[str, Any]) -> InstanceSpec:
        return InstanceSpec.from_row(inst["spec"], int(inst["spec_generation"]), org_id=inst["org_id"])

    @staticmethod
    def _box(ctx: JobContext) -> SecretBox:
        box = ctx.services.get("secretbox")
        return box if isinstance(box, SecretBox) else load_box(ctx.settings)

    def _credentials_patch(
        self, ctx: JobContext, inst: Mapping[str, Any], info: ConnectionInfo
    ) -> dict[str, Any]:
        """connection (never the password) and secret, when they differ from what is recorded."""
        patch: dict[str, Any] = {}
        if inst["connection"] != info.public():
            patch["connection"] = info.public()
        if self._password(ctx, inst) != info.password:
            patch["secret"] = base64.b64encode(self._box(ctx).encrypt(info.password)).decode()
        return patch

    def _password(self, ctx: JobContext, inst: Mapping[str, Any]) -> str | None:
        if inst["secret"] is None:
            return None
        try:
            return self._box(ctx).decrypt(bytes(inst["secret"]))
        except ValueError:
            log.warning("instance %s: recorded credential cannot be decrypted; issuing a new one", inst["id"])
            return None

    @staticmethod
    def _deadline(ctx: JobContext, state: str) -> dict[str, Any]:
        seconds = ctx.settings.deadline_s(state)
        return {} if seconds is None else {"deadline_s": seconds}

    # ---- provision --------------------------------------------------------------------------

    async def provision(self, ctx: JobContext) -> Verdict:
        return await self._drive(ctx, self._provision)

    async def _provision(self, ctx: JobContext, inst: DictRow) -> Verdict:
        if inst["state"] == "pending":
            inst = await self._move(
                ctx,
                inst,
                "start_provisioning",
                patch={"progress": PROVISIONING_STEPS[0], **self._deadline(ctx, "provisioning")},
            )
        if inst["state"] != "provisioning":
            return NOTHING_TO_DO
        spec = self._spec(inst)
        iid, fence, p = inst["id"], ctx.fence, self.provisioner
        p.refuse_unsupported_restore(spec)
        await self._step(ctx, inst, "allocate_storage", lambda: p.allocate_storage(iid, spec, fence))
        await self._step(ctx, inst, "configure_network", lambda: p.configure_network(iid, spec, fence))
        info = await self._step(
            ctx, inst, "initialize_database", lambda: p.initialize_database(iid, spec, fence)
        )
        await self._move(
            ctx,
            inst,
            "provisioned",
            reason="provisioned",
            detail={"endpoint": f"{info.host}:{info.port}", "plan": spec.plan},
            patch={
                **self._credentials_patch(ctx, inst, info),
                "observed_generation": spec.generation,
                "observed_spec": inst["spec"],
            },
        )
        return {"result": "ready", "endpoint": f"{info.host}:{info.port}"}

    async def provision_abandoned(self, conn: AsyncConn, job: DictRow, actor: Actor) -> None:
        """pending/provisioning -> failed with the step and error; a cleanup job removes what exists."""
        inst = await _lock_instance(conn, job)
        if inst is None or inst["state"] not in ("pending", "provisioning"):
            return
        reason = _failure_reason(job, inst)
        await _transition_in(conn, inst, "fail", actor, reason)
        await _enqueue_cleanup(conn, inst, actor, skip_backup=True)

    # ---- update -----------------------------------------------------------------------------

    async def update(self, ctx: JobContext) -> Verdict:
        return await self._drive(ctx, self._update)

    async def _update(self, ctx: JobContext, inst: DictRow) -> Verdict:
        if inst["state"] == "ready":
            if inst["observed_generation"] >= inst["spec_generation"]:
                return NOTHING_TO_DO
            inst = await self._move(
                ctx, inst, "update", patch={"progress": "apply_plan", **self._deadline(ctx, "updating")}
            )
        if inst["state"] != "updating":
            return _not_now(inst)
        spec = self._spec(inst)
        changed = await self._step(
            ctx, inst, "apply_plan", lambda: self.provisioner.apply_plan(inst["id"], spec, ctx.fence)
        )
        await self._move(
            ctx,
            inst,
            "updated",
            reason=f"plan {spec.plan} applied",
            detail={"plan": spec.plan, "generation": spec.generation, "restarted_or_changed": changed},
            patch={"observed_generation": spec.generation, "observed_spec": inst["spec"]},
        )
        return {"result": "ready", "plan": spec.plan, "generation": spec.generation}

    async def update_abandoned(self, conn: AsyncConn, job: DictRow, actor: Actor) -> None:
        """updating -> degraded: a failed plan change must not destroy a database that holds data.

        The instance keeps its data and its old plan; the reconciler heals it if it is broken and
        recovers it to ready. The generation given up is recorded (`failed_generation`) and not
        tried again by the reconciler: asking for a plan again makes a new generation.
        """
        inst = await _lock_instance(conn, job)
        if inst is None or inst["state"] != "updating":
            return
        reason = _failure_reason(job, inst)
        generation = int(job["payload"].get("spec_generation") or inst["spec_generation"])
        await _transition(
            conn,
            inst,
            "degrade",
            actor,
            reason=reason,
            patch={"failure_reason": reason, "progress": None, "failed_generation": generation},
        )

    # ---- suspend and resume -----------------------------------------------------------------

    async def suspend(self, ctx: JobContext) -> Verdict:
        return await self._drive(ctx, self._suspend)

    async def _suspend(self, ctx: JobContext, inst: DictRow) -> Verdict:
        """Read-only first, then ready -> suspended: the record never claims more than is true."""
        by_billing = bool(ctx.payload.get("billing", inst["suspended_by_billing"]))
        spec = self._spec(inst)
        if inst["state"] == "suspended":
            changed = await self.provisioner.suspend(inst["id"], spec, ctx.fence)
            return {"result": "suspended (repaired)"} if changed else NOTHING_TO_DO
        if inst["state"] != "ready":
            return _not_now(inst)
        if by_billing and not inst["billing_hold"]:
            return {"result": "nothing to do", "why": "the billing hold was released before it ran"}
        await self._step(ctx, inst, "suspend", lambda: self.provisioner.suspend(inst["id"], spec, ctx.fence))
        await self._move(
            ctx,
            inst,
            "suspend",
            reason=str(ctx.payload.get("reason") or ("billing hold" if by_billing else "suspended")),
            patch={"suspended_by_billing": by_billing},
        )
        return {"result": "suspended"}

    async def resume(self, ctx: JobContext) -> Verdict:
        return await self._drive(ctx, self._resume)

    async def _resume(self, ctx: JobContext, inst: DictRow) -> Verdict:
        """suspended -> ready first, then writes back on: a failure from ready can land in degraded."""
        spec = self._spec(inst)
        if inst["state"] == "suspended":
            inst = await self._move(
                ctx,
                inst,
                "resume",
                reason=str(ctx.payload.get("reason") or "resumed"),
                patch={"progress": "resume", "suspended_by_billing": False},
            )
        elif inst["state"] != "ready":
            return _not_now(inst)
        changed = await self._step(
            ctx, inst, "resume", lambda: self.provisioner.resume(inst["id"], spec, ctx.fence)
        )
        await self._progress(ctx, inst, None)
        return {"result": "ready"} if changed else NOTHING_TO_DO

    async def degrade_abandoned(self, conn: AsyncConn, job: DictRow, actor: Actor) -> None:
        """A failed suspend, resume or heal: ready -> degraded with the reason (never failed)."""
        inst = await _lock_instance(conn, job)
        if inst is None:
            return
        reason = _failure_reason(job, inst)
        if inst["state"] == "ready":
            await _transition_in(conn, inst, "degrade", actor, reason)
        elif inst["state"] == "degraded":
            # A heal given up is counted: the reconciler waits longer before each next one.
            await conn.execute(
                "UPDATE instances SET failure_reason = %(reason)s, progress = NULL, updated_at = now(),"
                " heal_failures = heal_failures + CASE WHEN %(heal)s THEN 1 ELSE 0 END,"
                " heal_given_up_at = CASE WHEN %(heal)s THEN now() ELSE heal_given_up_at END"
                " WHERE id = %(id)s",
                {"reason": reason, "heal": job["kind"] == HEAL, "id": inst["id"]},
            )

    # ---- heal -------------------------------------------------------------------------------

    async def heal(self, ctx: JobContext) -> Verdict:
        return await self._drive(ctx, self._heal)

    async def _heal(self, ctx: JobContext, inst: DictRow) -> Verdict:
        """degraded -> ready after re-running every step: each adopts what is there, repairs the rest.

        Never over lost data: re-running the steps would make an empty database that says ready.
        """
        if inst["state"] != "degraded":
            return NOTHING_TO_DO
        iid, fence, p = inst["id"], ctx.fence, self.provisioner
        before = await p.observe(iid)
        if inst["failure_code"] == DATA_LOST or before.data_lost:
            raise PermanentError(
                "heal: the instance's data is lost; it comes back only with a restore (from a backup, "
                "or empty once that is accepted)"
            )
        target = self._target(inst)
        await self._step(ctx, inst, "allocate_storage", lambda: p.allocate_storage(iid, target.spec, fence))
        info = await self._bring_up(ctx, inst, target)
        rolled = f", back on plan {target.spec.plan}" if target.rolled_back else ""
        await self._move(
            ctx,
            inst,
            "recover",
            reason=f"repaired ({before.detail})" + rolled,
            detail={
                "before": before.as_dict(),
                "endpoint": f"{info.host}:{info.port}",
                "plan": target.spec.plan,
                "rolled_back": target.rolled_back,
            },
            patch=self._recovered(ctx, inst, info, target),
        )
        return {"result": "ready", "repaired": before.detail, "plan": target.spec.plan}

    def _target(self, inst: Mapping[str, Any]) -> Target:
        rolled_back = (
            inst["failed_generation"] == inst["spec_generation"] and inst["observed_spec"] is not None
        )
        if rolled_back:
            # The latest plan change was given up: back to the plan it last ran, not to the one that
            # may have broken it. The declared spec stays, for the customer to change again.
            declared = inst["observed_spec"]
            spec = InstanceSpec.from_row(declared, int(inst["observed_generation"]), org_id=inst["org_id"])
            return Target(declared, spec, True)
        return Target(inst["spec"], self._spec(inst), False)

    async def _bring_up(self, ctx: JobContext, inst: DictRow, target: Target) -> ConnectionInfo:
        """The steps after storage, as a heal and a restore both need them; the server healthy."""
        iid, fence, p, spec = inst["id"], ctx.fence, self.provisioner, target.spec
        await self._step(ctx, inst, "configure_network", lambda: p.configure_network(iid, spec, fence))
        await self._step(ctx, inst, "resume", lambda: p.resume(iid, spec, fence))
        info = await self._step(
            ctx,
            inst,
            "initialize_database",
            lambda: p.initialize_database(iid, spec, fence, password=self._password(ctx, inst)),
        )
        await self._step(ctx, inst, "apply_plan", lambda: p.apply_plan(iid, spec, fence))
        after = await p.observe(iid)
        if not after.healthy:
            raise TemporaryError(f"{ctx.job['kind']}: instance still unhealthy: {after.detail}")
        return info

    def _recovered(
        self, ctx: JobContext, inst: Mapping[str, Any], info: ConnectionInfo, target: Target
    ) -> dict[str, Any]:
        """The patch of a `recover`: credentials if changed, the spec applied, nothing wrong any more."""
        return {
            **self._credentials_patch(ctx, inst, info),
            "observed_generation": target.spec.generation,
            "observed_spec": target.declared,
            "failure_reason": None,
            "failure_code": None,
        }

    # ---- backup and restore -----------------------------------------------------------------

    async def backup(self, ctx: JobContext) -> Verdict:
        """A backup of a running instance (ready or suspended); the record then follows the provisioner's."""
        inst = await self._load(ctx)
        if not backups.can_back_up(inst["state"]):
            return {"result": "nothing to do", "why": f"instance is {inst['state']}"}
        token = JOB_ATTEMPT.set(ctx.attempt)
        try:
            taken = await _named(
                "take_backup",
                lambda: self.provisioner.take_backup(
                    inst["id"], self._spec(inst), ctx.fence, kind=str(ctx.payload.get("kind", "scheduled"))
                ),
            )
        finally:
            JOB_ATTEMPT.reset(token)
        listing = await self.provisioner.list_backups(inst["id"])
        async with ctx.pool.connection() as conn:
            await backups.record(conn, inst["id"], listing)
        return {"result": "backed up", "backup": taken.name, "held": len(listing)}

    async def restore(self, ctx: JobContext) -> Verdict:
        return await self._drive(ctx, self._restore)

    async def _restore(self, ctx: JobContext, inst: DictRow) -> Verdict:
        """degraded (data lost) -> ready with the data of a held backup, or empty once accepted."""
        if not backups.can_restore(inst):
            return {"result": "nothing to do", "why": f"instance is {inst['state']}, its data not lost"}
        async with ctx.pool.connection() as conn:
            try:
                source = await backups.backup_to_restore(conn, inst["id"], ctx.payload)
            except backups.UnknownBackup as exc:
                raise PermanentError(f"restore: {exc}") from exc
        iid, fence, p, target = inst["id"], ctx.fence, self.provisioner, self._target(inst)
        backup_id = None if source is None else str(source["backup_id"])
        await self._step(
            ctx, inst, "restore", lambda: p.restore(iid, target.spec, fence, backup_id=backup_id)
        )
        info = await self._bring_up(ctx, inst, target)
        accepted_by = ctx.payload.get("accepted_by")
        if source is None:
            reason = "re-initialised empty: the loss of its data was accepted"
        else:
            taken = source["taken_at"].isoformat(timespec="seconds")
            reason = f"restored from backup {backup_id} taken at {taken}; changes made after it are lost"
        await self._move(
            ctx,
            inst,
            "recover",
            reason=reason
            + (f" (decided by {accepted_by})" if accepted_by else " (the newest backup, by policy)"),
            detail={
                "code": DATA_LOST,
                "restored_from": backup_id,
                "taken_at": None if source is None else source["taken_at"].isoformat(),
                "empty": source is None,
                "accepted_by": accepted_by,
                "why": ctx.payload.get("reason"),
                "endpoint": f"{info.host}:{info.port}",
            },
            patch=self._recovered(ctx, inst, info, target),
        )
        return {"result": "ready", "restored_from": backup_id, "empty": source is None}

    # ---- deprovision ------------------------------------------------------------------------

    async def deprovision(self, ctx: JobContext) -> Verdict:
        return await self._drive(ctx, self._deprovision)

    async def _deprovision(self, ctx: JobContext, inst: DictRow) -> Verdict:
        state = inst["state"]
        skip_backup = bool(ctx.payload.get("skip_final_backup", inst["skip_final_backup"]))
        if state == "failed":
            return await self._cleanup(ctx, inst, skip_backup)
        if state in ("ready", "degraded", "suspended"):
            inst = await self._move(
                ctx,
                inst,
                "deprovision",
                reason=str(ctx.payload.get("reason") or "deletion requested"),
                patch={"progress": "deprovision", **self._deadline(ctx, "deprovisioning")},
            )
        elif state != "deprovisioning":
            return NOTHING_TO_DO if state == "deleted" else _deferred(inst)
        result = await self._step(
            ctx,
            inst,
            "deprovision",
            lambda: self.provisioner.deprovision(
                inst["id"], self._spec(inst), ctx.fence, skip_backup=skip_backup
            ),
        )
        await self._move(
            ctx,
            inst,
            "deprovisioned",
            reason="final backup skipped" if skip_backup else f"final backup {result.backup}",
            detail={"backup": result.backup, "skip_backup": skip_backup},
            patch={"secret": None},
        )
        return {"result": "deleted", "backup": result.backup}

    async def _cleanup(self, ctx: JobContext, inst: DictRow, skip_backup: bool) -> Verdict:
        """Remove what a failed instance still has; the instance stays failed."""
        result = await self.provisioner.deprovision(
            inst["id"],
            InstanceSpec.for_removal(inst["spec"], int(inst["spec_generation"])),
            ctx.fence,
            skip_backup=skip_backup,
        )
        return {"result": "cleaned up", "backup": result.backup, "removed": result.removed}

    async def deprovision_abandoned(self, conn: AsyncConn, job: DictRow, actor: Actor) -> None:
        """deprovisioning -> failed; what remains is left to the orphan sweep and the SREs."""
        inst = await _lock_instance(conn, job)
        if inst is None or inst["state"] != "deprovisioning":
            return
        await _transition_in(conn, inst, "fail", actor, _failure_reason(job, inst))

    # ---- registry ---------------------------------------------------------------------------

    def kinds(self) -> list[JobKind]:
        table: list[tuple[str, Handler, AbandonHook | None]] = [
            (PROVISION, self.provision, self.provision_abandoned),
            (UPDATE, self.update, self.update_abandoned),
            (SUSPEND, self.suspend, self.degrade_abandoned),
            (RESUME, self.resume, self.degrade_abandoned),
            (HEAL, self.heal, self.degrade_abandoned),
            (DEPROVISION, self.deprovision, self.deprovision_abandoned),
            (BACKUP, self.backup, None),
            (RESTORE, self.restore, self.degrade_abandoned),
        ]
        return [JobKind(name, handler, on_abandoned=hook) for name, handler, hook in table]


def operation_kinds(provisioner: Provisioner) -> list[JobKind]:
    """The instance operations over `provisioner`, for a worker's JobRegistry."""
    return Operations(provisioner).kinds()


def default_registry() -> JobRegistry:
    """A JobRegistry of the operations over the provisioner the environment configures.

    For `CONTROLPLANE_JOB_REGISTRY=controlplane.operations:default_registry`.
    """
    import provisioners
    from controlplane import settings as settings_module

    return JobRegistry(operation_kinds(provisioners.build(settings_module.load())))


# ---- helpers of the abandonment hooks (they run in the abandoning transaction) -------------------


async def _lock_instance(conn: AsyncConn, job: Mapping[str, Any]) -> DictRow | None:
    if job["instance_id"] is None:
        return None
    cursor = await conn.execute("SELECT * FROM instances WHERE id = %s FOR UPDATE", (job["instance_id"],))
    return await cursor.fetchone()


def _failure_reason(job: Mapping[str, Any], inst: Mapping[str, Any]) -> str:
    """The job's last error, with the step it happened in when the error does not say."""
    error = str(job["last_error"] or "no error recorded")
    step = inst["progress"]
    if step and not error.startswith(f"{step}:"):
        error = f"at {step}: {error}"
    return f"{job['kind']} failed after {job['attempt']} attempt(s): {error}"[:1000]


async def _transition_in(
    conn: AsyncConn, inst: Mapping[str, Any], event: str, actor: Actor, reason: str
) -> None:
    await _transition(
        conn, inst, event, actor, reason=reason, patch={"failure_reason": reason, "progress": None}
    )


async def _transition(
    conn: AsyncConn,
    inst: Mapping[str, Any],
    event: str,
    actor: Actor,
    *,
    reason: str | None = None,
    detail: Mapping[str, Any] | None = None,
    patch: Mapping[str, Any] | None = None,
) -> DictRow:
    """`event` on the instance as it was read: guarded by the state and version read."""
    return await transition(
        conn,
        "instance",
        inst["id"],
        event,
        inst["state_version"],
        expected_state=inst["state"],
        actor=actor,
        reason=reason,
        detail=detail,
        patch=patch,
    )


async def _enqueue_cleanup(
    conn: AsyncConn, inst: Mapping[str, Any], actor: Actor, *, skip_backup: bool
) -> None:
    instance_id: uuid.UUID = inst["id"]
    await jobs.enqueue(
        conn,
        jobs.NewJob(DEPROVISION, instance_id, payload={CLEANUP: True, "skip_final_backup": skip_backup}),
        actor,
    )
