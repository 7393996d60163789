"""Typed records (pure): instances and jobs as frozen values read from rows in one place, and the
typed patches a transition writes beside the state (rendered as the JSON the transition SQL reads).
"""

from __future__ import annotations

import dataclasses
import enum
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

R = TypeVar("R", bound="_Record")


class _Record:
    @classmethod
    def from_row(cls: type[R], row: Mapping[str, Any]) -> R:
        """The record of a row: every column it names is required; joined extras are optional."""
        values = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name in row:
                values[f.name] = row[f.name]
            elif f.default is dataclasses.MISSING:
                raise KeyError(f"{cls.__name__}.from_row: the row has no column {f.name!r}")
        return cls(**values)


@dataclass(frozen=True)
class Instance(_Record):
    """One row of `instances` (the current-state projection of the instance's event log)."""

    id: uuid.UUID
    org_id: uuid.UUID
    name: str
    spec: Mapping[str, Any]
    spec_generation: int
    observed_generation: int
    failed_generation: int | None
    observed_spec: Mapping[str, Any] | None
    state: str
    state_version: int
    state_entered_at: datetime
    deadline_at: datetime | None
    deadline_retries: int
    failure_reason: str | None
    # A stable code of what is wrong (controlplane.core.failures), beside the reason's words.
    failure_code: str | None
    progress: str | None
    deletion_protection: bool
    deletion_requested_at: datetime | None
    skip_final_backup: bool
    suspended_by_billing: bool
    connection: Mapping[str, Any] | None
    secret: bytes | None = dataclasses.field(repr=False)
    heal_failures: int
    heal_given_up_at: datetime | None
    created_at: datetime
    updated_at: datetime
    # The failed instance this one retries, and when this (failed) one was archived.
    replaces: uuid.UUID | None = None
    archived_at: datetime | None = None
    # Read with the organisation (None when the row was read without it).
    billing_hold: bool | None = None
    # The instance created to retry this one (read by the customer queries; None otherwise).
    replaced_by: uuid.UUID | None = None
    # Seconds in the current state when the row was read (None when not asked for).
    time_in_state_s: float | None = None

    @property
    def deletion_requested(self) -> bool:
        return self.deletion_requested_at is not None

    @property
    def plan(self) -> str | None:
        plan = self.spec.get("plan")
        return None if plan is None else str(plan)

    @property
    def etag(self) -> str:
        """The version of all a client can change: the state (state_version, which every transition
        bumps), the spec (spec_generation, which every plan change bumps), deletion protection and
        the deletion request. A change of any of them changes it, so that a change made against an
        ETag (If-Match) can never overwrite another one it did not see."""
        flags = f"{int(self.deletion_protection)}.{int(self.deletion_requested)}"
        return f"{self.state_version}.{self.spec_generation}.{flags}"


@dataclass(frozen=True)
class ScannedInstance(_Record):
    """A live instance as the reconciler's scan reads it (sql.SCAN_LIVE_INSTANCES)."""

    id: uuid.UUID
    state: str
    state_version: int
    spec: Mapping[str, Any]
    spec_generation: int
    observed_generation: int
    failed_generation: int | None
    deadline_at: datetime | None
    deadline_retries: int
    heal_failures: int
    heal_given_up_at: datetime | None
    deletion_requested: bool
    suspended_by_billing: bool
    billing_hold: bool
    failure_code: str | None
    created_at: datetime
    # The kinds of its live jobs.
    live_jobs: tuple[str, ...]
    # When the newest backup held of it was taken (None: none held).
    newest_backup_at: datetime | None
    # The time of the scan: the injected `now`, else the database's.
    now: datetime
    org_id: uuid.UUID | None = None
    # Storage autoscaling: when it last grew the allocation, when it last warned at the maximum.
    storage_grown_at: datetime | None = None
    storage_full_warned_at: datetime | None = None
    # Its data is lost and the newest restore of it was given up (abandoned): left for a decision.
    restore_given_up: bool = False
    # Its recorded recoverable window starts somewhere: the repository holds a backup of it, even
    # before the backup's own record is written (a backup job interrupted between the two).
    window_held: bool = False
    # The primary the reconciler saw since its last state change (an operator's infrastructure).
    primary_seen: str | None = None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> ScannedInstance:
        return super().from_row({**row, "live_jobs": tuple(row["live_jobs"])})


@dataclass(frozen=True)
class Job(_Record):
    """One row of `jobs`."""

    id: uuid.UUID
    kind: str
    instance_id: uuid.UUID | None
    payload: Mapping[str, Any]
    state: str
    state_version: int
    state_entered_at: datetime
    attempt: int
    max_attempts: int
    run_at: datetime
    priority: int
    claimed_by: str | None
    claimed_at: datetime | None
    heartbeat_at: datetime | None
    fence: int | None
    last_error: str | None
    error_kind: str | None
    verdict: Mapping[str, Any] | None
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True)
class StepRecord(_Record):
    """One row of `job_steps`: a named step of an instance job that started, finished or failed."""

    id: int
    job_id: uuid.UUID
    instance_id: uuid.UUID
    # The job's kind (the operation) and the step.
    kind: str
    step: str
    # started, finished or failed.
    event: str
    attempt: int
    fence: int
    worker: str
    # On a finish or a failure: when that attempt of the step started.
    started_at: datetime | None
    # On a failure: the failure code (customers are told its reason) and the raw error (SREs only).
    code: str | None
    error: str | None
    at: datetime


@dataclass(frozen=True)
class Backup(_Record):
    """One row of `backups`: a backup the control plane holds of an instance."""

    instance_id: uuid.UUID
    backup_id: str
    # provisioners.base.BACKUP_KINDS: scheduled, on_demand or final.
    kind: str
    taken_at: datetime
    size_bytes: int | None
    # Where the provisioner keeps it: for SREs, never shown to customers.
    location: str
    recorded_at: datetime
    removed_at: datetime | None
    # full, diff or incr (None: the provisioner does not say).
    type: str | None = None


@dataclass(frozen=True)
class RecoveryWindow(_Record):
    """One row of `recovery_windows`: the moments an instance can be restored to and its archive's
    health, as its provisioner last reported them."""

    instance_id: uuid.UUID
    earliest_at: datetime | None
    latest_at: datetime | None
    archive_healthy: bool | None
    # What fails (SREs' words).
    archive_detail: str
    archive_failing_since: datetime | None
    lag_s: float | None
    lag_bytes: int | None
    last_archived_at: datetime | None
    observed_at: datetime | None
    retained_until: datetime | None
    verified_at: datetime | None
    verify_problem: str | None
    expired_at: datetime | None

    def covers(self, moment: datetime) -> bool:
        """Whether a restore can reach `moment`."""
        return (
            self.earliest_at is not None
            and self.latest_at is not None
            and self.earliest_at <= moment <= self.latest_at
        )


class _Keep(enum.Enum):
    """A patch field left as it is (absent from the JSON), as opposed to set to None (SQL NULL)."""

    KEEP = "keep"


KEEP = _Keep.KEEP


def _render(patch: object, always: tuple[str, ...]) -> dict[str, Any]:
    """The JSON of a patch: every field not KEEP; the `always` fields only when not None."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(patch):  # type: ignore[arg-type]
        value = getattr(patch, f.name)
        if value is KEEP or (f.name in always and value is None):
            continue
        out[f.name] = dict(value) if isinstance(value, Mapping) else value
    return out


@dataclass(frozen=True)
class InstancePatch:
    """The columns a transition of an instance sets besides its state (sql.INSTANCE_TABLE reads the keys).

    `progress` and the deadline are those of the new state: unset, there is none. The other fields
    keep their column when KEEP and set it (None: NULL) otherwise.
    """

    progress: str | None = None
    deadline_s: float | None = None
    deadline_retries: int | None = None
    failure_reason: str | _Keep | None = KEEP
    failure_code: str | _Keep | None = KEEP
    observed_generation: int | _Keep = KEEP
    failed_generation: int | _Keep | None = KEEP
    observed_spec: Mapping[str, Any] | _Keep | None = KEEP
    connection: Mapping[str, Any] | _Keep | None = KEEP
    # The encrypted password, base64 (the SQL decodes it into the bytea column).
    secret: str | _Keep | None = KEEP
    suspended_by_billing: bool | _Keep = KEEP

    def to_json(self) -> dict[str, Any]:
        return _render(self, ("progress", "deadline_s", "deadline_retries"))


@dataclass(frozen=True)
class JobPatch:
    """The columns a transition of a job sets besides its state (sql.JOB_TABLE reads the keys).

    `delay_s` moves run_at to now + delay (unset: run_at is kept); the other fields keep their
    column when KEEP.
    """

    delay_s: float | None = None
    attempt: int | _Keep = KEEP
    last_error: str | _Keep | None = KEEP
    error_kind: str | _Keep | None = KEEP
    verdict: Mapping[str, Any] | _Keep | None = KEEP

    def to_json(self) -> dict[str, Any]:
        return _render(self, ("delay_s",))
