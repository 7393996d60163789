"""The typed reasons an instance is failed or degraded (pure data): a stable code kept in
`instances.failure_code`, a message and a hint for the customer, whether asking again can help.

The raw error (a provider's text, a path on a server) never reaches a customer: it stays in the
instance's `failure_reason` and the audit rows, which only SREs read. Customers see the reason
of the code, looked up here. Alerts and runbooks key on the codes too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from controlplane.core.kinds import DEPROVISION, HEAL, PROVISION, RESTORE, RESUME, SUSPEND, UPDATE

# Creation: where it failed, or why.
STORAGE_ALLOCATION_FAILED = "storage_allocation_failed"
NETWORK_CONFIGURATION_FAILED = "network_configuration_failed"
DATABASE_INITIALIZATION_FAILED = "database_initialization_failed"
ARCHIVE_CONFIGURATION_FAILED = "archive_configuration_failed"
INIT_TIMEOUT = "init_timeout"
RETRIES_EXHAUSTED = "retries_exhausted"
ABANDONED_BY_OPERATOR = "abandoned_by_operator"
# What a provider (or the control plane) refuses, whatever the step.
QUOTA_EXCEEDED = "quota_exceeded"
CAPACITY_EXHAUSTED = "capacity_exhausted"
INVALID_SPEC = "invalid_spec"
RESTORE_UNSUPPORTED = "restore_unsupported"
RESTORE_SOURCE_UNAVAILABLE = "restore_source_unavailable"
# Deletion.
FINAL_BACKUP_FAILED = "final_backup_failed"
DEPROVISION_FAILED = "deprovision_failed"
DEPROVISION_TIMEOUT = "deprovision_timeout"
# Degraded: a change given up, a repair under way.
PLAN_CHANGE_FAILED = "plan_change_failed"
UPDATE_TIMEOUT = "update_timeout"
SUSPEND_FAILED = "suspend_failed"
RESUME_FAILED = "resume_failed"
HEAL_FAILED = "heal_failed"
UNHEALTHY = "unhealthy"
# The continuous archive of the instance's WAL fails (a full disk, a broken repository): its newest
# writes are not protected until it works again.
ARCHIVE_FAILING = "archive_failing"
# An HA plan's primary server is lost: a failover (fence it, promote a standby; or the provisioner's
# operator promoting one by itself) is under way.
FAILOVER = "failover"
# An HA plan's standby does not stream from the primary: commits wait until one does again.
REPLICATION_DEGRADED = "replication_degraded"
STANDBYS_FAILED = "standbys_failed"
# The instance's storage is gone: it comes back only restored from a backup, or re-created empty
# once someone accepted the loss (never by a heal).
DATA_LOST = "data_lost"
# Suspended: the database outgrew its storage allocation and is held to it (read-only) until the
# allocation holds its data again.
STORAGE_FULL = "storage_full"
# A code this version does not know (written by a newer one), or none recorded (older rows).
UNKNOWN = "unknown"

_RETRY = "Retry it: a new database with the same name and plan is created. If it fails too, contact support."
_REPAIRED = "Nothing to do: it is repaired automatically. If it stays degraded, contact support."
_DELETE_AGAIN = "Remove it (delete it again): what remains of it is removed."


@dataclass(frozen=True)
class Reason:
    """What a customer is told about a code."""

    code: str
    message: str
    # failed: whether POST /v1/instances/{id}/retry can help (it is refused otherwise);
    # degraded: whether asking for the same change again can help.
    retryable: bool
    hint: str
    # Where the code appears: failed, degraded (and suspended, for lost data).
    states: tuple[str, ...]

    def as_dict(self) -> dict[str, object]:
        """The `failure` object of an instance."""
        return {"code": self.code, "message": self.message, "retryable": self.retryable, "hint": self.hint}

    def published(self) -> dict[str, object]:
        """The entry of GET /v1/lifecycle's `failure_reasons`."""
        return {**self.as_dict(), "states": list(self.states)}


def _reasons(*reasons: Reason) -> Mapping[str, Reason]:
    table = {r.code: r for r in reasons}
    assert len(table) == len(reasons), "a reason code is listed twice"
    return MappingProxyType(table)


FAILED = ("failed",)
DEGRADED = ("degraded",)

REASONS: Mapping[str, Reason] = _reasons(
    Reason(
        STORAGE_ALLOCATION_FAILED,
        "The storage for this database could not be allocated.",
        True,
        _RETRY,
        FAILED,
    ),
    Reason(
        NETWORK_CONFIGURATION_FAILED,
        "The network endpoint of this database could not be set up.",
        True,
        _RETRY,
        FAILED,
    ),
    Reason(
        DATABASE_INITIALIZATION_FAILED,
        "The database server of this database could not be initialized.",
        True,
        _RETRY,
        FAILED,
    ),
    Reason(
        ARCHIVE_CONFIGURATION_FAILED,
        "The continuous backup of this database could not be started.",
        True,
        _RETRY,
        FAILED,
    ),
    Reason(
        INIT_TIMEOUT,
        "Creating this database took longer than allowed, so it was stopped.",
        True,
        _RETRY,
        FAILED,
    ),
    Reason(
        RETRIES_EXHAUSTED,
        "Creating this database failed again and again, so it was given up.",
        True,
        _RETRY,
        FAILED,
    ),
    Reason(
        ABANDONED_BY_OPERATOR,
        "The creation of this database was stopped by the service's operators.",
        True,
        "Retry it; if it is stopped again, contact support for the reason.",
        FAILED,
    ),
    Reason(
        QUOTA_EXCEEDED,
        "The service's quota for databases like this one is used up.",
        False,
        "A retry would fail the same way: delete databases you no longer need, or ask support for a higher"
        " quota, then create it again.",
        FAILED,
    ),
    Reason(
        CAPACITY_EXHAUSTED,
        "The service had no free capacity for this database.",
        True,
        "Retry in a few minutes: capacity is freed as other databases are deleted.",
        FAILED,
    ),
    Reason(
        INVALID_SPEC,
        "This database's settings cannot be provisioned (for example a plan that is no longer offered).",
        False,
        "A retry would fail the same way: create a new database with a plan listed by GET /v1/plans.",
        FAILED,
    ),
    Reason(
        RESTORE_UNSUPPORTED,
        "This service cannot create a database from a backup.",
        False,
        "A retry would fail the same way: create the database without restore_from.",
        FAILED,
    ),
    Reason(
        RESTORE_SOURCE_UNAVAILABLE,
        "The backup this database was to be created from is not available.",
        False,
        "A retry would fail the same way: create a new database from another backup or point in time.",
        FAILED,
    ),
    Reason(
        FINAL_BACKUP_FAILED,
        "The final backup before the deletion could not be taken, so the database was not removed.",
        False,
        "Remove it (delete it again): the final backup is tried again; or remove it without one"
        " (skip_final_backup).",
        FAILED,
    ),
    Reason(DEPROVISION_FAILED, "Deleting this database failed.", False, _DELETE_AGAIN, FAILED),
    Reason(
        DEPROVISION_TIMEOUT, "Deleting this database took longer than allowed.", False, _DELETE_AGAIN, FAILED
    ),
    Reason(
        PLAN_CHANGE_FAILED,
        "The plan change could not be applied; the database runs on its previous plan.",
        True,
        "Ask for the plan again, or choose another one. If it fails again, contact support.",
        DEGRADED,
    ),
    Reason(
        UPDATE_TIMEOUT,
        "The plan change took longer than allowed and was given up; the database runs on its previous plan.",
        True,
        "Ask for the plan again, or choose another one. If it times out again, contact support.",
        DEGRADED,
    ),
    Reason(SUSPEND_FAILED, "The database could not be made read-only.", False, _REPAIRED, DEGRADED),
    Reason(RESUME_FAILED, "The database could not be made writable again.", False, _REPAIRED, DEGRADED),
    Reason(
        HEAL_FAILED,
        "The automatic repair of this database failed; it is tried again later.",
        False,
        _REPAIRED,
        DEGRADED,
    ),
    Reason(
        UNHEALTHY, "The database server stopped serving; it is being repaired.", False, _REPAIRED, DEGRADED
    ),
    Reason(
        ARCHIVE_FAILING,
        "The continuous backup of this database is failing: its newest changes are not protected yet."
        " The database itself keeps serving.",
        False,
        _REPAIRED,
        DEGRADED,
    ),
    Reason(
        FAILOVER,
        "The primary server of this database was lost; a standby is taking over at the same address."
        " Writes pause meanwhile; every acknowledged write is kept.",
        False,
        _REPAIRED,
        DEGRADED,
    ),
    Reason(
        REPLICATION_DEGRADED,
        "A standby server of this database is not replicating: commits wait until one confirms them"
        " (no acknowledged write is kept on one server only). It is being repaired.",
        False,
        _REPAIRED,
        DEGRADED,
    ),
    Reason(
        STANDBYS_FAILED,
        "The standby servers of this database could not be started.",
        True,
        _RETRY,
        FAILED,
    ),
    Reason(
        DATA_LOST,
        "The storage of this database was lost. It is restored to the last moment its continuous backup"
        " holds; without a backup, it waits for your decision.",
        False,
        "Restore it from one of its backups (POST /v1/instances/{id}/restore), or accept an empty database"
        ' ({"empty": true}).',
        ("degraded", "suspended"),
    ),
    Reason(
        STORAGE_FULL,
        "This database outgrew its storage allocation, so it was made read-only: it serves reads, not"
        " writes, and its data is kept.",
        False,
        "Move it to a larger plan (PATCH plan): it becomes writable again as soon as its allocation holds its"
        " data. Where storage autoscaling is on, its allocation grows by itself, up to its plan's maximum.",
        ("suspended",),
    ),
    Reason(
        UNKNOWN,
        "Something went wrong with this database.",
        True,
        "Retry it (when it is failed), or contact support with its id.",
        ("failed", "degraded"),
    ),
)

# The code of a job given up at each step (the operation decides where none is named).
_BY_STEP: Mapping[str, str] = MappingProxyType(
    {
        "allocate_storage": STORAGE_ALLOCATION_FAILED,
        "configure_network": NETWORK_CONFIGURATION_FAILED,
        "initialize_database": DATABASE_INITIALIZATION_FAILED,
        "configure_archive": ARCHIVE_CONFIGURATION_FAILED,
        "start_standbys": STANDBYS_FAILED,
        "final_backup": FINAL_BACKUP_FAILED,
        "deprovision": DEPROVISION_FAILED,
    }
)
# The code of an operation given up, whatever its step (the data stays lost through a restore).
_BY_OPERATION: Mapping[str, str] = MappingProxyType(
    {
        UPDATE: PLAN_CHANGE_FAILED,
        SUSPEND: SUSPEND_FAILED,
        RESUME: RESUME_FAILED,
        HEAL: HEAL_FAILED,
        RESTORE: DATA_LOST,
        DEPROVISION: DEPROVISION_FAILED,
    }
)
# The code of a transitional state whose deadline (and re-enqueues) ran out.
_BY_DEADLINE: Mapping[str, str] = MappingProxyType(
    {
        "pending": INIT_TIMEOUT,
        "provisioning": INIT_TIMEOUT,
        "updating": UPDATE_TIMEOUT,
        "deprovisioning": DEPROVISION_TIMEOUT,
    }
)


def reason(code: str | None) -> Reason:
    """The reason of `code`; an unknown or missing code reads as UNKNOWN (never an error)."""
    return REASONS.get(code or UNKNOWN) or REASONS[UNKNOWN]


def given_up(operation: str, *, step: str | None, error_code: str | None, by_operator: bool) -> str:
    """The code of an instance operation that was given up (its job abandoned).

    The error's own code comes first (a quota, a spec that can never be provisioned); then the
    step the last attempt was in; then what the operation is.
    """
    if error_code in REASONS and error_code != UNKNOWN:
        return str(error_code)
    if operation == RESTORE:
        return DATA_LOST
    if operation in (PROVISION, DEPROVISION) and step in _BY_STEP:
        return _BY_STEP[str(step)]
    if operation == PROVISION:
        return ABANDONED_BY_OPERATOR if by_operator else RETRIES_EXHAUSTED
    return _BY_OPERATION.get(operation, UNKNOWN)


def deadline_missed(state: str) -> str:
    """The code of a transitional state left failed (or degraded) by its deadline."""
    return _BY_DEADLINE.get(state, UNKNOWN)


def failover_by_operator(primary: str | None, since: str | None) -> dict[str, object]:
    """What the audit log records of a failover an operator carried out by itself, in the shape of a
    heal's (`instance.failover` tells it): the primary it promoted and when; the fenced server, the
    WAL position and the writes refused are not reported by it (None)."""
    return {
        "promoted": primary,
        "fenced": None,
        "lsn": None,
        "at": since,
        "writes_refused_s": None,
        "by": "operator",
    }
