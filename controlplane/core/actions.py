"""What a customer may do to an instance now (pure): derived from the lifecycle and the recorded intents."""

from __future__ import annotations

from controlplane.core import failures, lifecycle
from controlplane.core.failures import DATA_LOST
from controlplane.core.records import Instance

# The customer actions an instance can list in `allowed_actions`, and what each one does.
CUSTOMER_ACTIONS: dict[str, str] = {
    "resize": "PATCH {plan}: runs now when ready, otherwise as soon as the instance is ready",
    "set_deletion_protection": "PATCH {deletion_protection}: takes effect at once",
    "delete": "DELETE: starts now when ready, degraded or suspended, otherwise as soon as it can;"
    " a failed one is archived and what it left is removed",
    "retry": "POST /retry: a new instance from a failed one's spec and name, when its reason says a retry"
    " can help",
    "backup": "POST /backups: a backup now, beside the plan's schedule (ready or suspended)",
    "restore": "POST /restore {backup_id | empty}: bring back an instance whose data is lost",
}


def can_still_update(state: str) -> bool:
    """A spec change can be applied: the instance can still take the lifecycle's `update` edge."""
    return lifecycle.INSTANCE.can_still("update", state)


def can_still_deprovision(state: str) -> bool:
    return lifecycle.INSTANCE.can_still("deprovision", state)


def can_deprovision_now(state: str) -> bool:
    return "deprovision" in lifecycle.INSTANCE.allowed_events(state)


def can_back_up(state: str) -> bool:
    """A backup can be taken: the instance's server runs (read-only while suspended)."""
    return state in lifecycle.BACKED_UP


def can_restore(state: str, failure_code: str | None, *, deletion_requested: bool) -> bool:
    """A restore is for an instance whose data is lost (and that is waiting for it), unless its
    deletion has been requested: nothing is brought back to be deleted."""
    return state in lifecycle.RESTORABLE and failure_code == DATA_LOST and not deletion_requested


def can_retry(state: str, failure_code: str | None) -> bool:
    """A retry (a new instance from this one's spec) is for a failed instance whose reason allows it."""
    return state == "failed" and failures.reason(failure_code).retryable


def allowed_actions(
    state: str,
    *,
    deletion_protection: bool,
    deletion_requested: bool,
    failure_code: str | None = None,
    archived: bool = False,
    replaced: bool = False,
) -> list[str]:
    """Customer actions the instance accepts now, from the lifecycle and the recorded intents."""
    if archived:
        return []
    if state == "failed":
        # Terminal: retried into a new instance (once), or deleted (archived, its leftovers removed).
        return ["retry", "delete"] if can_retry(state, failure_code) and not replaced else ["delete"]
    if deletion_requested:
        return []
    actions = []
    if can_still_update(state):
        actions += ["resize", "set_deletion_protection"]
    if can_still_deprovision(state) and not deletion_protection:
        actions.append("delete")
    if can_back_up(state):
        actions.append("backup")
    if can_restore(state, failure_code, deletion_requested=deletion_requested):
        actions.append("restore")
    return actions


def of(instance: Instance) -> list[str]:
    """The customer actions `instance` accepts now."""
    return allowed_actions(
        instance.state,
        deletion_protection=instance.deletion_protection,
        deletion_requested=instance.deletion_requested,
        failure_code=instance.failure_code,
        archived=instance.archived_at is not None,
        replaced=instance.replaced_by is not None,
    )


def settled(inst: Instance) -> bool:
    """Nothing asked of the instance is still to be done (what a client waits for after a create,
    PATCH or DELETE): it is in no transitional state, no deletion waits to run, and its spec
    generation is applied (`observed_generation`) or was given up (`failed_generation`)."""
    if inst.state in lifecycle.INSTANCE.terminal:
        return True
    if inst.state in lifecycle.INSTANCE.transitional or inst.deletion_requested:
        return False
    return inst.observed_generation >= inst.spec_generation or inst.failed_generation == inst.spec_generation
