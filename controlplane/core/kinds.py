"""The job kinds of the instance operations (pure): their names and one typed payload per kind.

A payload is what the enqueuer asks of the job beyond the instance row; `to_json` renders the
`jobs.payload` column, `from_json` reads it back (unknown keys, e.g. of a newer version, are left
aside; a known key of the wrong type is refused).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, TypeVar

from controlplane.core.step_errors import PermanentError

# Job kinds of the instance operations (one live job per instance and kind).
PROVISION = "provision"
UPDATE = "update"
SUSPEND = "suspend"
RESUME = "resume"
HEAL = "heal"
DEPROVISION = "deprovision"
BACKUP = "backup"
RESTORE = "restore"
INSTANCE_JOB_KINDS = (PROVISION, UPDATE, SUSPEND, RESUME, HEAL, DEPROVISION, BACKUP, RESTORE)

# The provisioner steps the operations run, each with its label for customers (progress, the CLI).
STEP_LABELS: Mapping[str, str] = MappingProxyType(
    {
        "allocate_storage": "Allocate storage",
        "configure_network": "Configure the network",
        "initialize_database": "Initialize the database",
        "configure_archive": "Start continuous backup",
        "start_standbys": "Start the standbys",
        "fence_primary": "Fence the lost primary",
        "promote_standby": "Promote a standby",
        "switchover": "Switch the primary over to a standby",
        "apply_plan": "Apply the plan",
        "suspend": "Make it read-only",
        "resume": "Make it writable",
        "final_backup": "Take the final backup",
        "deprovision": "Remove the servers and storage",
        "take_backup": "Take a backup",
        "restore": "Restore the data",
    }
)
# The steps of the operations that drive a transitional state, in the order they run: what an
# instance's progress lists (a deletion that skips its final backup leaves that step out).
OPERATION_STEPS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        PROVISION: (
            "allocate_storage",
            "configure_network",
            "initialize_database",
            "configure_archive",
            "start_standbys",
        ),
        UPDATE: ("apply_plan",),
        DEPROVISION: ("final_backup", "deprovision"),
    }
)
assert all(step in STEP_LABELS for steps in OPERATION_STEPS.values() for step in steps)
# The operation that drives each transitional instance state forward (its progress; the reconciler
# re-enqueues it when the state stalls).
DRIVING_JOB: Mapping[str, str] = MappingProxyType(
    {"pending": PROVISION, "provisioning": PROVISION, "updating": UPDATE, "deprovisioning": DEPROVISION}
)

P = TypeVar("P", bound="Payload")


class PayloadError(PermanentError, ValueError):
    """A job payload whose known keys do not have the types its kind expects: it never will."""


@dataclass(frozen=True)
class Payload:
    """Base of the payloads: `reason` says why the job was enqueued (shown in the audit rows)."""

    kind: ClassVar[str] = ""
    reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The payload column: every field that is set (None means "not asked", and is left out)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {name: value for name, value in values.items() if value is not None}

    @classmethod
    def from_json(cls: type[P], value: Mapping[str, Any] | None) -> P:
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            raw = (value or {}).get(field.name)
            if raw is None:
                continue
            hint = hints[field.name]
            expected = tuple(t for t in typing.get_args(hint) or (hint,) if t is not type(None))
            if not isinstance(raw, expected) or (bool not in expected and isinstance(raw, bool)):
                names = " or ".join(t.__name__ for t in expected)
                raise PayloadError(f"{cls.kind} payload: {field.name}={raw!r} is not {names}")
            values[field.name] = raw
        return cls(**values)


@dataclass(frozen=True)
class ProvisionPayload(Payload):
    kind: ClassVar[str] = PROVISION


@dataclass(frozen=True)
class UpdatePayload(Payload):
    kind: ClassVar[str] = UPDATE
    # The spec generation the update was enqueued for (what an abandonment records as given up).
    spec_generation: int | None = None
    # A switchover an SRE asked for (the plan unchanged): the primary moves to a standby.
    switchover: bool | None = None


@dataclass(frozen=True)
class SuspendPayload(Payload):
    kind: ClassVar[str] = SUSPEND
    # Suspended because of the organisation's billing hold (None: as recorded on the instance).
    billing: bool | None = None
    # The failure code the suspension records (storage_full: held to its storage allocation).
    code: str | None = None


@dataclass(frozen=True)
class ResumePayload(Payload):
    kind: ClassVar[str] = RESUME
    # Resumed because the billing hold was released (informational: resume clears the flag).
    billing: bool | None = None


@dataclass(frozen=True)
class HealPayload(Payload):
    kind: ClassVar[str] = HEAL


@dataclass(frozen=True)
class DeprovisionPayload(Payload):
    kind: ClassVar[str] = DEPROVISION
    # None: as recorded on the instance (its deletion request).
    skip_final_backup: bool | None = None
    # Remove what a failed instance still has; the instance stays failed.
    cleanup: bool = False

    def to_json(self) -> dict[str, Any]:
        value = super().to_json()
        if not self.cleanup:
            del value["cleanup"]
        return value


@dataclass(frozen=True)
class BackupPayload(Payload):
    kind: ClassVar[str] = BACKUP
    # Why the backup is taken (provisioners.base.BACKUP_KINDS: scheduled, on_demand), kept with it.
    backup_kind: str = "scheduled"


@dataclass(frozen=True)
class RestorePayload(Payload):
    """A restore of an instance whose data is lost, as someone (or the policy) decided it."""

    kind: ClassVar[str] = RESTORE
    # The held backup to restore, as it was; None: everything archived, from the newest backup
    # held (unless `empty`).
    backup_id: str | None = None
    # Re-initialise empty: the loss of the data was accepted.
    empty: bool = False
    # Who decided (an actor); None: the reconciler, by policy (the newest backup).
    accepted_by: str | None = None


PAYLOADS: Mapping[str, type[Payload]] = MappingProxyType(
    {
        cls.kind: cls
        for cls in (
            ProvisionPayload,
            UpdatePayload,
            SuspendPayload,
            ResumePayload,
            HealPayload,
            DeprovisionPayload,
            BackupPayload,
            RestorePayload,
        )
    }
)
assert tuple(PAYLOADS) == INSTANCE_JOB_KINDS, "one payload class per instance job kind"
