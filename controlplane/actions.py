"""What a customer may do to an instance now (pure): derived from the lifecycle and the recorded intents."""

from __future__ import annotations

from controlplane import lifecycle
from controlplane.records import Instance

# The customer actions an instance can list in `allowed_actions`, and what each one does.
CUSTOMER_ACTIONS: dict[str, str] = {
    "resize": "PATCH {plan}: runs now when ready, otherwise as soon as the instance is ready",
    "set_deletion_protection": "PATCH {deletion_protection}: takes effect at once",
    "delete": "DELETE: starts now when ready, degraded or suspended, otherwise as soon as it can",
}


def can_still_update(state: str) -> bool:
    """A spec change can be applied: the instance can still take the lifecycle's `update` edge."""
    return lifecycle.INSTANCE.can_still("update", state)


def can_still_deprovision(state: str) -> bool:
    return lifecycle.INSTANCE.can_still("deprovision", state)


def can_deprovision_now(state: str) -> bool:
    return "deprovision" in lifecycle.INSTANCE.allowed_events(state)


def allowed_actions(state: str, *, deletion_protection: bool, deletion_requested: bool) -> list[str]:
    """Customer actions the instance accepts now, from the lifecycle and the recorded intents."""
    if deletion_requested:
        return []
    actions = []
    if can_still_update(state):
        actions += ["resize", "set_deletion_protection"]
    if can_still_deprovision(state) and not deletion_protection:
        actions.append("delete")
    return actions


def of(instance: Instance) -> list[str]:
    """The customer actions `instance` accepts now."""
    return allowed_actions(
        instance.state,
        deletion_protection=instance.deletion_protection,
        deletion_requested=instance.deletion_requested,
    )
