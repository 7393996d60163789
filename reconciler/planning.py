"""Reconciler planning (pure): what to do about one instance, given its row, its jobs and what is observed."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from controlplane.core import failures, lifecycle
from controlplane.core.dbmetrics import GIB, DatabaseStats
from controlplane.core.failures import (
    ARCHIVE_FAILING,
    DATA_LOST,
    FAILOVER,
    REPLICATION_DEGRADED,
    STORAGE_FULL,
    UNHEALTHY,
    failover_by_operator,
)
from controlplane.core.kinds import BACKUP, DEPROVISION, DRIVING_JOB, HEAL, RESTORE, RESUME, SUSPEND, UPDATE

assert set(DRIVING_JOB) == lifecycle.INSTANCE.transitional, "a driving job for every transitional state"
# Settled instances are observed: their health and drift are the provisioner's to show.
OBSERVED_STATES = frozenset(lifecycle.SETTLED)
# Jobs that restart or promote the server of an instance while it is still `ready` (suspend
# restarts it read-only before the move to `suspended`; resume starts or promotes it): while one
# lives, an unhealthy observation is the job at work, and the job (or its abandonment, which
# degrades) decides. Degrading under it would defer it, and the heal would undo it.
WORKING_ON_READY = frozenset({SUSPEND, RESUME})
DEPROVISIONABLE = frozenset(lifecycle.DEPROVISIONABLE)
# States in which an instance is backed up by its plan's schedule: its server runs and takes writes
# (a suspended one changes nothing: its newest backup and archive hold it).
BACKED_UP_STATES = frozenset(lifecycle.INSTANCE.states_allowing("suspend"))


@dataclass(frozen=True)
class Observed:
    """What the provisioner shows of one instance."""

    exists: bool
    running: bool
    healthy: bool
    read_only: bool
    detail: str = ""
    # The instance had storage and it is gone: nothing but a restore may bring it back.
    data_lost: bool = False
    # Its continuous archive fails (what fails: `archive_detail`): its newest writes are unprotected.
    archive_failing: bool = False
    archive_detail: str = ""
    # Its database's own metrics, read by the same look (None: not read).
    stats: DatabaseStats | None = None
    # An HA plan's: its primary is lost and this standby can take over (a failover heals it).
    failover_to: str | None = None
    # An HA plan's: a standby does not stream from the primary (commits wait for one), and what.
    replication_degraded: bool = False
    replication_detail: str = ""
    # The server that is the primary now, and since when (RFC 3339), where the provisioner names them.
    primary: str | None = None
    primary_since: str | None = None


@dataclass(frozen=True)
class InstanceView:
    """What the database declares about one instance, as the reconciler reads it."""

    state: str
    spec_generation: int
    observed_generation: int
    deadline_at: datetime | None
    deadline_retries: int
    deletion_requested: bool
    billing_hold: bool
    suspended_by_billing: bool
    live_jobs: Collection[str]
    observed: Observed | None = None
    # The spec generation whose update was given up: not tried again until the spec changes.
    failed_generation: int | None = None
    # After heals were given up, no new heal before this time (the reconciler's heal backoff).
    heal_not_before: datetime | None = None
    # The stable code of what is wrong (e.g. data_lost), if anything.
    failure_code: str | None = None
    # The newest backup held, and when the instance was created (the schedule's start).
    newest_backup_at: datetime | None = None
    # Its data is lost and the newest restore of it was given up: no new one without a decision.
    restore_given_up: bool = False
    # Its recorded recoverable window has a start: the repository holds a backup of it, recorded
    # as a backup or not yet (a restore records the repository's listing before it starts).
    window_held: bool = False
    created_at: datetime | None = None
    # Seconds between scheduled backups; None: this instance is not backed up by a schedule.
    backup_interval_s: float | None = None
    # Its storage: the allocation, the plan's maximum and the recent used space (None: not known).
    storage: StorageView | None = None
    # The provisioner's infrastructure fails over by itself (an operator): a failover it reports is
    # recorded, never carried out by a heal.
    fails_over_itself: bool = False
    # Where it fails over by itself: the primary seen since the last state change (None: none yet).
    primary_seen: str | None = None


@dataclass(frozen=True)
class StorageRule:
    """When storage autoscaling grows an allocation (the RDS rule by default): at most `free_ratio`
    of it free for `for_s` seconds, not within `cooldown_s` of the last growth; by `grow_ratio` of
    it, at least `grow_min_gb`, never beyond the plan's maximum."""

    enabled: bool = True
    free_ratio: float = 0.10
    for_s: float = 300.0
    cooldown_s: float = 6 * 3600.0
    grow_ratio: float = 0.10
    grow_min_gb: int = 1


@dataclass(frozen=True)
class StorageView:
    """An instance's storage as the reconciler sees it."""

    allocated_gb: int
    maximum_gb: int
    # (when, bytes used) of the recent samples, oldest first; the current observation last.
    used: Sequence[tuple[datetime, int]]
    grown_at: datetime | None = None
    warned_at: datetime | None = None
    # The bytes of one allocated GB (GiB; a test makes it small, so that a real write fills one).
    gb_bytes: int = GIB

    @property
    def allocated_bytes(self) -> int:
        return self.allocated_gb * self.gb_bytes


@dataclass(frozen=True)
class Transition:
    event: str
    reason: str
    # A stable code for what went wrong (with `fail` or `degrade`).
    code: str | None = None
    # More for the event's detail (a failover's: who was lost, who took over).
    detail: Mapping[str, Any] | None = None
    # A failover the operator carries out by itself: its own events on it go to the SRE detail.
    operator_events: bool = False


@dataclass(frozen=True)
class RecordFailure:
    """What is wrong, recorded in place: the state has no edge to say it (degraded, suspended)."""

    code: str
    reason: str


@dataclass(frozen=True)
class NotePrimary:
    """The primary seen now, remembered until the next state change (not itself a state change)."""

    primary: str
    reason: str


@dataclass(frozen=True)
class Enqueue:
    kind: str
    reason: str
    # The failure code a suspension records (storage_full), if any.
    code: str | None = None


@dataclass(frozen=True)
class ExtendDeadline:
    """Re-enqueue after a missed deadline: count the retry and give the state a new deadline."""

    reason: str


@dataclass(frozen=True)
class GrowStorage:
    """A larger allocation (a new spec generation, applied by an update job), and why."""

    to_gb: int
    reason: str


@dataclass(frozen=True)
class WarnStorageFull:
    """Tell the customer: nearly full at the plan's maximum, nothing will grow it."""

    reason: str


PlannedAction = (
    Transition | Enqueue | ExtendDeadline | RecordFailure | GrowStorage | WarnStorageFull | NotePrimary
)


def timeout_reason(state: str, deadline_retries: int) -> str:
    return f"timeout: {state} exceeded its deadline after {deadline_retries} re-enqueue(s)"


def plan_deadline(view: InstanceView, now: datetime, max_retries: int) -> list[PlannedAction]:
    """Past its deadline with no live job: re-enqueue (bounded), then fail (degrade for updating)."""
    job = DRIVING_JOB.get(view.state)
    if job is None or view.deadline_at is None or now < view.deadline_at:
        return []
    if view.live_jobs:
        # A live job heartbeats and is supervised: never fail an instance for time alone.
        return []
    if view.deadline_retries < max_retries:
        return [ExtendDeadline(f"{view.state} past its deadline"), Enqueue(job, "deadline re-enqueue")]
    event = "degrade" if view.state == "updating" else "fail"
    reason = timeout_reason(view.state, view.deadline_retries)
    return [Transition(event, reason, code=failures.deadline_missed(view.state))]


def plan_observed(view: InstanceView, now: datetime) -> list[PlannedAction]:
    """Health and drift of a ready, degraded or suspended instance from the provisioner's view."""
    seen = view.observed
    if seen is None or view.state not in OBSERVED_STATES:
        return []
    broken = not seen.exists or not seen.running or not seen.healthy
    why = seen.detail or (
        "missing" if not seen.exists else "not running" if not seen.running else "unhealthy"
    )
    if seen.data_lost:
        return plan_data_lost(view, why)
    if view.state == "degraded" and view.failure_code == DATA_LOST and broken:
        return []  # what remains of lost data is not healed: a restore (or a decision) brings it back
    if view.state == "ready" and broken:
        if WORKING_ON_READY.intersection(view.live_jobs):
            return []
        if seen.failover_to is not None and view.fails_over_itself:
            # The operator fails over by itself: recorded, and left to it (no heal to fence or promote).
            lost = seen.primary or "the primary"
            why = f"primary {lost} lost ({why}); the operator promotes {seen.failover_to}"
            detail = {"primary": seen.primary, "failover_to": seen.failover_to}
            return [Transition("degrade", f"failover: {why}", FAILOVER, detail, operator_events=True)]
        if seen.failover_to is not None:
            # Failover is a heal: the heal fences the lost primary, then promotes the standby.
            why = f"primary lost ({why}); {seen.failover_to} can take over"
            return [
                Transition("degrade", f"failover: {why}", code=FAILOVER),
                Enqueue(HEAL, f"failover: {why}"),
            ]
        return [Transition("degrade", f"observed {why}", code=UNHEALTHY), Enqueue(HEAL, f"heal: {why}")]
    if seen.replication_degraded and not broken:
        broken, why = True, f"replication degraded: {seen.replication_detail or 'a standby is not streaming'}"
        if view.state == "ready" and not WORKING_ON_READY.intersection(view.live_jobs):
            # Commits wait for a standby: never silently ready.
            return [Transition("degrade", why, code=REPLICATION_DEGRADED), Enqueue(HEAL, f"heal: {why}")]
    if seen.archive_failing and not broken:
        broken, why = True, f"archive failing: {seen.archive_detail or 'archive-push fails'}"
        if view.state == "ready" and not WORKING_ON_READY.intersection(view.live_jobs):
            # Never silently ready: the database serves, its newest writes are not protected.
            return [Transition("degrade", why, code=ARCHIVE_FAILING), Enqueue(HEAL, f"heal: {why}")]
    if view.state == "degraded":
        failing_over = view.fails_over_itself and view.failure_code == FAILOVER
        if broken and failing_over and seen.failover_to is not None:
            return []  # the operator is still failing over: its work, not a heal's
        if broken:
            backing_off = view.heal_not_before is not None and now < view.heal_not_before
            return [] if HEAL in view.live_jobs or backing_off else [Enqueue(HEAL, f"heal: {why}")]
        if not view.live_jobs:
            if failing_over:
                return [operator_failover(seen)]
            return [Transition("recover", "observed healthy again")]
        return []
    if view.state == "suspended" and SUSPEND not in view.live_jobs:
        if not broken and not seen.read_only:
            return [Enqueue(SUSPEND, "suspended but writable: enforce read-only")]
        if seen.exists and not seen.running:
            # No edge leaves `suspended` for `degraded`: suspending again restarts it read-only.
            return [Enqueue(SUSPEND, "suspended but not running: restart read-only")]
    if view.state == "ready" and seen.read_only and not view.billing_hold and not view.live_jobs:
        return [Enqueue(RESUME, "ready but read-only without a hold: resume")]
    if view.state == "ready" and not broken and not view.live_jobs:
        return primary_seen(view, seen)
    return []


def primary_seen(view: InstanceView, seen: Observed) -> list[PlannedAction]:
    """Where the infrastructure fails over by itself, a failover may start and end between two
    observations: a primary other than the one seen since the last state change (each transition
    forgets it, so a switchover, a restore or a recorded failover is never counted) is recorded as
    the failover it was, degraded with the code failover; the next pass records it done (ready)."""
    if not view.fails_over_itself or seen.primary is None or seen.primary == view.primary_seen:
        return []
    if view.primary_seen is None:
        return [NotePrimary(seen.primary, f"primary {seen.primary} seen")]
    why = (
        f"primary {view.primary_seen} replaced by {seen.primary} between two observations; "
        "the operator failed over"
    )
    detail = {"primary": view.primary_seen, "failover_to": seen.primary}
    return [Transition("degrade", f"failover: {why}", FAILOVER, detail, operator_events=True)]


def operator_failover(seen: Observed) -> Transition:
    """degraded -> ready once the operator's failover is done: the event names the new primary (the
    lost one is named by the degrade before it; the operator reports no WAL position)."""
    failover = failover_by_operator(seen.primary, seen.primary_since)
    reason = f"failover: {seen.primary or 'a standby'} promoted by the operator; observed healthy again"
    return Transition("recover", reason, detail={"failover": failover}, operator_events=True)


def plan_data_lost(view: InstanceView, why: str) -> list[PlannedAction]:
    """Lost data is never healed into an empty database: degraded with the code, and restored from
    its backups and archive when any is held and no restore of it was given up (a loss recorded while
    it was suspended is restored once it is degraded), or left for a decision."""
    recorded = view.failure_code == DATA_LOST
    reason = f"data lost: {why}"
    if view.state == "suspended":
        # No edge leaves suspended for degraded: recorded, and degraded once it is resumed.
        return [] if recorded else [RecordFailure(DATA_LOST, reason)]
    restore: list[PlannedAction] = []
    held = view.newest_backup_at is not None or view.window_held
    if held and not view.restore_given_up and RESTORE not in view.live_jobs:
        restore = [Enqueue(RESTORE, "data lost: restore from its backups and archive")]
    if view.state == "degraded" and recorded:
        return restore  # else a restore runs, or someone decides
    if view.state == "ready":
        return [Transition("degrade", reason, code=DATA_LOST), *restore]
    return [RecordFailure(DATA_LOST, reason), *restore]


def plan_backup(view: InstanceView, now: datetime) -> list[PlannedAction]:
    """The first backup at once, then one whenever the newest is a plan interval old."""
    if view.backup_interval_s is None or view.state not in BACKED_UP_STATES or view.live_jobs:
        return []
    if view.newest_backup_at is None:
        # The first, at once: a point-in-time restore (or a lost data directory) starts from one.
        return [Enqueue(BACKUP, "first backup")]
    if now < view.newest_backup_at + timedelta(seconds=view.backup_interval_s):
        return []
    return [Enqueue(BACKUP, "scheduled backup")]


def plan_intents(view: InstanceView) -> list[PlannedAction]:
    """Deferred intents: deletion, billing hold and release, spec changes."""
    busy = bool(view.live_jobs)
    if view.deletion_requested:
        if view.state in DEPROVISIONABLE and DEPROVISION not in view.live_jobs:
            return [Enqueue(DEPROVISION, "deletion requested")]
        return []
    if view.state == "ready" and not busy:
        if view.billing_hold:
            return [Enqueue(SUSPEND, "billing hold")]
        if view.spec_generation > view.observed_generation and view.spec_generation != view.failed_generation:
            return [Enqueue(UPDATE, f"spec generation {view.spec_generation} not applied")]
    if view.state == "suspended" and view.suspended_by_billing and not view.billing_hold and not busy:
        return [Enqueue(RESUME, "billing hold released")]
    return []


GB = GIB  # allocations are in binary gigabytes, as the volumes' `Gi`


def full_since(storage: StorageView, free_ratio: float) -> datetime | None:
    """The start of the unbroken run of samples, up to the newest, with at most `free_ratio` of the
    allocation free (None: the newest has more free)."""
    limit = storage.allocated_bytes * (1 - free_ratio)
    since = None
    for at, used in reversed(storage.used):
        if used < limit:
            break
        since = at
    return since


def held_for_storage(view: InstanceView) -> bool:
    """Whether the instance is suspended because it outgrew its storage allocation."""
    return view.state == "suspended" and view.failure_code == STORAGE_FULL


def _share(storage: StorageView) -> str:
    return f"{storage.used[-1][1] / storage.allocated_bytes:.0%} of {storage.allocated_gb} GB used"


def plan_allocation(view: InstanceView) -> list[PlannedAction]:
    """A database is held to its storage allocation: beyond it, a ready instance is suspended
    (read-only) with the code storage_full; such an instance is resumed once its allocation holds
    the used space again (a growth, a larger plan). Not while a job is under way, nor over a
    billing hold (which suspends it anyway)."""
    storage = view.storage
    if storage is None or view.deletion_requested or view.live_jobs:
        return []
    used = storage.used[-1][1]
    if view.state == "ready" and used > storage.allocated_bytes and not view.billing_hold:
        why = f"storage full: {_share(storage)}; read-only until the allocation holds the data"
        return [Enqueue(SUSPEND, why, code=STORAGE_FULL)]
    if held_for_storage(view) and used < storage.allocated_bytes:
        return [Enqueue(RESUME, f"storage allocation holds the data again: {_share(storage)}")]
    return []


def plan_storage(view: InstanceView, now: datetime, rule: StorageRule) -> list[PlannedAction]:
    """Storage autoscaling: nearly full for long enough and out of the cooldown, a ready instance
    with nothing under way grows (never beyond its plan's maximum), and so does one held read-only
    for outgrowing its allocation; at the maximum, its customer is told (once per cooldown)."""
    storage = view.storage
    growable = view.state == "ready" or held_for_storage(view)
    if not rule.enabled or storage is None or not growable or view.deletion_requested:
        return []
    since = full_since(storage, rule.free_ratio)
    if since is None or now - since < timedelta(seconds=rule.for_s):
        return []
    share = _share(storage)
    held = f"for {(now - since).total_seconds() / 60:.0f} min (at most {rule.free_ratio:.0%} free)"
    cooldown = timedelta(seconds=rule.cooldown_s)
    if storage.allocated_gb >= storage.maximum_gb:
        if storage.warned_at is not None and now < storage.warned_at + cooldown:
            return []
        return [
            WarnStorageFull(
                f"storage nearly full: {share} {held}, and {storage.maximum_gb} GB is the plan's "
                "maximum: free space, or move to a larger plan"
            )
        ]
    if (storage.grown_at is not None and now < storage.grown_at + cooldown) or view.live_jobs:
        return []
    grown = max(
        storage.allocated_gb + rule.grow_min_gb, math.ceil(storage.allocated_gb * (1 + rule.grow_ratio))
    )
    to_gb = min(storage.maximum_gb, grown)
    reason = f"storage autoscaling: {share} {held}; allocation {storage.allocated_gb} GB -> {to_gb} GB"
    return [GrowStorage(to_gb, f"{reason} (plan maximum {storage.maximum_gb} GB)")]


def heal_backoff_s(failures: int, base_s: float, max_s: float) -> float:
    """The pause before the next heal after `failures` heals in a row were given up."""
    if failures <= 0:
        return 0.0
    return float(min(max_s, base_s * 2 ** min(failures - 1, 32)))


def plan(
    view: InstanceView, now: datetime, max_retries: int, storage_rule: StorageRule | None = None
) -> list[PlannedAction]:
    """Everything to do about one instance this pass, most urgent first; at most one kind of move."""
    return (
        plan_deadline(view, now, max_retries)
        or plan_observed(view, now)
        or plan_intents(view)
        or plan_allocation(view)
        or plan_storage(view, now, storage_rule or StorageRule())
        or plan_backup(view, now)
    )
