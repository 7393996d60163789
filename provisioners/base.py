"""The provisioner interface: idempotent, fenced steps that create, change, observe and remove an instance."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Collection, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from controlplane.core import plans
from controlplane.core.dbmetrics import DatabaseStats
from controlplane.core.failures import DATA_LOST, INVALID_SPEC, RESTORE_UNSUPPORTED
from controlplane.core.kinds import OPERATION_STEPS, PROVISION, STEP_LABELS
from controlplane.core.step_errors import PermanentError
from controlplane.runtime import tracing
from controlplane.runtime.fencing import FileFences
from controlplane.runtime.logs import first_line

if TYPE_CHECKING:
    from controlplane.runtime.settings import Settings

# The attempt of the job whose handler is calling the provisioner (set by the operations);
# fault injection uses it to fire on a chosen attempt only.
JOB_ATTEMPT: ContextVar[int] = ContextVar("job_attempt", default=1)

# The steps a provisioner is called for (what fault injection can target).
STEPS = tuple(STEP_LABELS)
PROVISIONING_STEPS = OPERATION_STEPS[PROVISION]


@dataclass(frozen=True)
class RestoreSource:
    """Where a new instance's data comes from: another instance's backups.

    `backup` names one backup of that instance to start from; `point_in_time` (RFC 3339) replays
    its archived WAL up to that moment (from the backup, or from the last one before it); neither
    restores everything archived (the latest state).
    """

    instance_id: uuid.UUID
    backup: str | None = None
    point_in_time: str | None = None

    @classmethod
    def from_spec(cls, value: Any) -> RestoreSource:
        """From the `restore_from` of an instance's spec; a malformed one can never be provisioned."""
        if not isinstance(value, Mapping):
            raise PermanentError(f"restore_from must be an object, not {value!r}", code=INVALID_SPEC)
        try:
            source = uuid.UUID(str(value.get("instance_id")))
        except ValueError:
            raise PermanentError(
                f"restore_from.instance_id {value.get('instance_id')!r} is no id", code=INVALID_SPEC
            ) from None
        backup = value.get("backup")
        point = value.get("point_in_time")
        if point is not None:
            try:
                moment = datetime.fromisoformat(str(point))
            except ValueError:
                raise PermanentError(
                    f"restore_from.point_in_time {point!r} is not RFC 3339", code=INVALID_SPEC
                ) from None
            if moment.tzinfo is None:
                raise PermanentError(
                    f"restore_from.point_in_time {point!r} has no time zone", code=INVALID_SPEC
                )
        return cls(source, None if backup is None else str(backup), None if point is None else str(point))

    def as_dict(self) -> dict[str, Any]:
        return {
            "instance_id": str(self.instance_id),
            "backup": self.backup,
            "point_in_time": self.point_in_time,
        }


@dataclass(frozen=True)
class InstanceSpec:
    """What the provisioner is asked to build: the instance's declared spec at one generation."""

    plan: str = "dev"
    generation: int = 1
    version: str | None = None
    # The volume of each server; by default the plan's (a spec may ask for more).
    storage_gb: int | None = None
    region: str | None = None
    # The organisation the instance belongs to (labels of what the provisioner creates).
    org_id: uuid.UUID | None = None
    restore_from: RestoreSource | None = None

    @classmethod
    def from_row(
        cls, spec: Mapping[str, Any], generation: int = 1, *, org_id: uuid.UUID | None = None
    ) -> InstanceSpec:
        """From the instance's `spec` column; an unknown plan can never be provisioned."""
        plan = str(spec.get("plan", "dev"))
        if not plans.is_plan(plan):
            raise PermanentError(
                f"unknown plan {plan!r}; plans are {', '.join(plans.plan_names())}", code=INVALID_SPEC
            )
        storage = spec.get("storage_gb", spec.get("storage"))
        restore = spec.get("restore_from")
        return cls(
            plan=plan,
            generation=generation,
            version=None if spec.get("version") is None else str(spec["version"]),
            storage_gb=max(1, int(storage)) if isinstance(storage, int | float | str) else None,
            region=None if spec.get("region") is None else str(spec["region"]),
            org_id=org_id,
            restore_from=None if restore is None else RestoreSource.from_spec(restore),
        )

    @classmethod
    def for_removal(cls, spec: Mapping[str, Any], generation: int = 1) -> InstanceSpec:
        """The spec to tear an instance down with: a bad plan must not block its removal."""
        try:
            return cls.from_row(spec, generation)
        except PermanentError:
            return cls(generation=generation)

    @property
    def shape(self) -> plans.Shape:
        return plans.get_shape(self.plan)

    @property
    def volume_gb(self) -> int:
        """The volume each server gets: what the spec asks for, at least the plan's."""
        return max(self.storage_gb or 0, self.shape.storage_gb)

    def server_settings(self) -> dict[str, str]:
        """The PostgreSQL settings the plan fixes, as configuration-file values."""
        return {key: str(value) for key, value in plans.get_plan(self.plan).items()}

    def backup_schedule(self) -> plans.BackupSchedule:
        """How often the plan's instances are backed up, and how many backups are kept."""
        return plans.backup_schedule(self.plan)


class DataLost(PermanentError):
    """The instance's storage is gone: re-running the steps would make an empty database.

    Raised by a step instead of re-creating storage for an instance that had some; only
    `restore` (from a backup, or empty once someone accepted the loss) brings it back.
    """

    code = DATA_LOST


@dataclass(frozen=True)
class ConnectionInfo:
    """Where and as whom a customer connects. The password never leaves in `public()`."""

    host: str
    port: int
    dbname: str
    user: str
    password: str = field(repr=False)
    # When TLS is required: the libpq sslmode to connect with (verify-full: the server's certificate
    # is checked), and the CA that signs the server's certificate (PEM; public, served by the API so
    # clients can verify the server).
    sslmode: str | None = None
    ca_certificate: str | None = None
    # Where `host` and `port` are a pooler's: how it pools (`transaction`: a server connection per
    # transaction), and the primary server's own address for what needs a whole session (LISTEN,
    # session-level locks), which moves in a failover where the pooled one does not.
    pool_mode: str | None = None
    direct: tuple[str, int] | None = None
    # An HA plan's read-only endpoint (host, port, dbname): sessions there reach a streaming standby
    # (the same user, password and TLS), which refuses every write; None where there is no standby.
    read_only: tuple[str, int, str] | None = None

    @classmethod
    def from_public(cls, shown: Mapping[str, Any], password: str) -> ConnectionInfo:
        """The details `public()` gave (as recorded on an instance), with the password."""
        fields = {key: value for key, value in shown.items() if key not in ("direct", "read_only")}
        direct = shown.get("direct")
        where = None if not isinstance(direct, Mapping) else (str(direct["host"]), int(direct["port"]))
        reads = shown.get("read_only")
        reader = (
            None
            if not isinstance(reads, Mapping)
            else (str(reads["host"]), int(reads["port"]), str(reads["dbname"]))
        )
        return cls(password=password, direct=where, read_only=reader, **fields)

    def libpq(self) -> dict[str, Any]:
        """The keywords a libpq connection takes (psycopg.connect(**info.libpq(), ...)), without TLS
        options: the caller says how it checks the server."""
        return {
            "host": self.host,
            "port": self.port,
            "user": self.user,
            "password": self.password,
            "dbname": self.dbname,
        }

    def public(self) -> dict[str, Any]:
        """The connection details that may be stored in the clear and shown (no password)."""
        shown: dict[str, Any] = {
            "host": self.host,
            "port": self.port,
            "dbname": self.dbname,
            "user": self.user,
        }
        if self.sslmode is not None:
            shown["sslmode"] = self.sslmode
        if self.ca_certificate is not None:
            shown["ca_certificate"] = self.ca_certificate
        if self.pool_mode is not None:
            shown["pool_mode"] = self.pool_mode
        if self.direct is not None:
            shown["direct"] = {"host": self.direct[0], "port": self.direct[1]}
        if self.read_only is not None:
            host, port, dbname = self.read_only
            shown["read_only"] = {"host": host, "port": port, "dbname": dbname}
        return shown


@dataclass(frozen=True)
class RecoveryWindow:
    """The moments an instance's data can be restored to, and the health of its continuous archive.

    `earliest` and `latest` (RFC 3339) bound the points a restore can reach: the end of the oldest
    backup held, and the newest moment up to which every acknowledged commit is archived. The
    archive is `archive_healthy` when its last attempt succeeded (`archive_detail` says what fails,
    in words for SREs); `lag_s` is how far `latest` trails the observation, `lag_bytes` the WAL
    written and not archived yet. A deleted instance's window stays until `retained_until`.
    """

    earliest: str | None = None
    latest: str | None = None
    archive_healthy: bool | None = None
    archive_detail: str = ""
    lag_s: float | None = None
    lag_bytes: int | None = None
    last_archived_at: str | None = None
    observed_at: str | None = None
    retained_until: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "earliest": self.earliest,
            "latest": self.latest,
            "archive_healthy": self.archive_healthy,
            "archive_detail": self.archive_detail,
            "lag_s": self.lag_s,
            "lag_bytes": self.lag_bytes,
            "last_archived_at": self.last_archived_at,
            "observed_at": self.observed_at,
            "retained_until": self.retained_until,
        }


@dataclass(frozen=True)
class RestorePoint:
    """What a restore in place puts back: everything archived (the default: the newest state the
    archive holds), one backup as it was (`backup`), or nothing at all (`empty`, once the loss was
    accepted)."""

    backup: str | None = None
    empty: bool = False


@dataclass(frozen=True)
class Restored:
    """What a restore reached: the time of the last transaction it replayed (`recovered_to`), how
    far the archive covered the instance's writes (`covered_until`) and how many seconds of writes
    before the loss it could not bring back (`lost_s`: 0 when the archive was current)."""

    recovered_to: str | None = None
    covered_until: str | None = None
    lost_s: float | None = None
    backup: str | None = None


@dataclass(frozen=True)
class OperatorEvent:
    """One event an operator recorded on an instance's resources: its reason (a CamelCase word),
    its message, its type (Normal or Warning), when it last happened (RFC 3339) and how often."""

    reason: str
    message: str
    type: str = "Normal"
    at: str | None = None
    count: int = 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "message": self.message,
            "type": self.type,
            "at": self.at,
            "count": self.count,
        }


@dataclass(frozen=True)
class Observation:
    """What the provisioner sees of an instance right now."""

    exists: bool
    running: bool = False
    healthy: bool = False
    read_only: bool | None = None
    endpoint: tuple[str, int] | None = None
    plan_applied: str | None = None
    generation: int | None = None
    detail: str = ""
    # The instance had storage and it is gone (not merely stopped): only a restore brings it back.
    data_lost: bool = False
    # Its recoverable window and archive, where the provisioner archives continuously.
    recovery: RecoveryWindow | None = None

    @property
    def archive_failing(self) -> bool:
        return self.recovery is not None and self.recovery.archive_healthy is False

    # The customer database's own metrics, read on the same connection (None: not read).
    stats: DatabaseStats | None = None
    # An HA plan's: the servers its shape has, how many of its standbys stream from the primary
    # (None: not known, e.g. the primary is lost), what is wrong with its replication, and the
    # standby a failover would promote when its primary is lost (None: no failover is possible).
    servers: int = 1
    standbys_streaming: int | None = None
    replication_detail: str = ""
    failover_to: str | None = None
    # The server that is the primary now, and since when (RFC 3339), where the provisioner names
    # them (one whose infrastructure fails over by itself: what the audit log records of it).
    primary: str | None = None
    primary_since: str | None = None

    @property
    def replication_degraded(self) -> bool:
        return self.standbys_streaming is not None and self.standbys_streaming < self.servers - 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "exists": self.exists,
            "data_lost": self.data_lost,
            "running": self.running,
            "healthy": self.healthy,
            "read_only": self.read_only,
            "endpoint": None if self.endpoint is None else f"{self.endpoint[0]}:{self.endpoint[1]}",
            "plan_applied": self.plan_applied,
            "generation": self.generation,
            "detail": self.detail,
            "servers": self.servers,
            "standbys_streaming": self.standbys_streaming,
            "replication_detail": self.replication_detail,
            "failover_to": self.failover_to,
            "primary": self.primary,
        }


@dataclass(frozen=True)
class Promotion:
    """What a failover did: the standby promoted, the primary fenced before it, the WAL position
    (LSN) the new primary took over at ("" where the provisioner is not told it), and when (RFC 3339)."""

    promoted: str
    fenced: str | None
    lsn: str
    at: str

    def as_dict(self) -> dict[str, Any]:
        return {"promoted": self.promoted, "fenced": self.fenced, "lsn": self.lsn, "at": self.at}


@dataclass(frozen=True)
class Resource:
    """One managed resource and the instance id it carries (None when it carries none)."""

    kind: str
    name: str
    instance_id: uuid.UUID | None


# Kinds of backup: taken by the plan's schedule, or asked for (by a customer or an SRE), or the
# last one, taken when the instance is deleted.
BACKUP_KINDS = ("scheduled", "on_demand", "final")


@dataclass(frozen=True)
class BackupInfo:
    """One completed backup of an instance: its name (what a restore names) and when it ended."""

    # The provisioner's name for it, unique per instance and stable.
    name: str
    instance_id: uuid.UUID
    # When it completed (RFC 3339): the point its data is from.
    completed_at: str | None = None
    detail: str = ""
    kind: str = "on_demand"
    size_bytes: int | None = None
    # Where the provisioner keeps it (a path, an object name): shown to SREs, never to customers.
    location: str = ""
    # full, diff or incr (what it holds: everything, or what changed since the full or the last one).
    type: str | None = None

    @property
    def taken_at(self) -> datetime | None:
        return None if self.completed_at is None else datetime.fromisoformat(self.completed_at)


@dataclass(frozen=True)
class DeprovisionResult:
    """What deprovision left behind: the final backup, unless skipped or nothing was there."""

    backup: str | None = None
    removed: bool = True


# The calls on the infrastructure: inside a traced request or job, each one is a span of its own.
TRACED_CALLS = (
    "allocate_storage",
    "configure_network",
    "initialize_database",
    "apply_plan",
    "suspend",
    "resume",
    "final_backup",
    "deprovision",
    "observe",
    "inventory",
    "take_backup",
    "list_backups",
    "restore",
    "ca_certificate",
    "start_standbys",
    "fence_primary",
    "promote_standby",
    "switchover",
)


def _call_attributes(provisioner: Provisioner, *args: Any, **_: Any) -> dict[str, str]:
    found = {"controlplane.provisioner": provisioner.name}
    if args and isinstance(args[0], uuid.UUID):
        found["controlplane.instance.id"] = str(args[0])
    return found


class Provisioner(abc.ABC):
    """Idempotent steps: each checks what exists before it acts, so a re-run adopts, never duplicates.

    Every step takes the fence of the job that calls it and raises StaleFence when a higher fence
    was already seen for that instance: a worker that lost its job cannot touch the instance.
    Errors are translated at this edge into TemporaryError or PermanentError.

    Every call of TRACED_CALLS a subclass defines is traced (`__init_subclass__`), unless the
    subclass only wraps another provisioner (`wraps_another`), whose calls are traced already.
    """

    name: str = "abstract"
    wraps_another: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.wraps_another:
            return
        for call in TRACED_CALLS:
            method = cls.__dict__.get(call)
            if method is not None:
                setattr(cls, call, tracing.traced_call(f"provisioner {call}", method, _call_attributes))

    # Whether allocate_storage can fill a new instance from another's backups (spec.restore_from).
    supports_restore: bool = False
    # Whether `take_backup`, `list_backups` and `restore` work, on the control plane's schedule
    # (see "backups and restore" below).
    supports_backups: bool = False
    # Whether `observe` and `recovery_window` report each instance's recoverable window (it archives
    # continuously): a restore's point in time is then checked against it when it is asked for.
    reports_windows: bool = False
    # Whether an HA plan's address is a pooler's that `initialize_database` sets up (`pool_mode` in
    # its connection details): an update onto an HA plan then runs it to give the pooled address.
    pools_ha_endpoint: bool = False
    # Whether an HA plan's connection details carry a read-only endpoint (`read_only`: its
    # standbys): an update onto an HA plan then runs `initialize_database` to give it (and one off
    # an HA plan drops it from the recorded details).
    serves_read_only: bool = False
    # Whether the infrastructure fails an HA plan's lost primary over by itself (an operator):
    # `observe` then reports the failover under way (`failover_to`) and the primary (`primary`),
    # the reconciler records it (degraded with `failover`, then ready naming the new primary) and
    # never runs `fence_primary` and `promote_standby`, which such a provisioner refuses.
    fails_over_itself: bool = False

    @classmethod
    def from_settings(cls, settings: Settings) -> Provisioner:
        """The provisioner as the settings configure it (built where a process starts)."""
        return cls()

    @abc.abstractmethod
    async def allocate_storage(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> None:
        """Create (or adopt) the instance's storage."""

    @abc.abstractmethod
    async def configure_network(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> None:
        """Give the instance its endpoint (port, service) and access rules."""

    @abc.abstractmethod
    async def initialize_database(
        self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, *, password: str | None = None
    ) -> ConnectionInfo:
        """Run the server, create the owner role and database; return the credentials.

        `password` keeps existing credentials (heal); otherwise one already generated for this
        instance is adopted, or a new one is generated with `secrets`.
        """

    async def configure_archive(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> None:
        """Start (or check) the continuous archive of the running instance's WAL: where the
        provisioner archives, its repository made and a segment seen arriving there. By default
        nothing: the provisioner archives by other means (an operator), or not at all."""
        return None

    async def start_standbys(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> bool:
        """The standbys the plan's shape asks for, seeded and streaming from the primary, and then
        commits synchronous with one of them; True when something changed. By default nothing:
        the provisioner runs standbys by other means (an operator), or none."""
        return False

    async def fence_primary(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> str | None:
        """A failover's first step: the lost primary can never take another write (stopped, and
        never started as a primary again); refused while it answers as a writable primary.
        Returns its name."""
        raise PermanentError(f"the {self.name} provisioner does not fail over by the control plane")

    async def promote_standby(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> Promotion:
        """A failover's second step, once the primary is fenced: the most advanced standby
        promoted, the instance's endpoint pointed at it. Idempotent (a promotion done is returned)."""
        raise PermanentError(f"the {self.name} provisioner does not fail over by the control plane")

    async def switchover(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> Promotion | None:
        """A planned change of primary to the most advanced standby, writes paused meanwhile
        (seconds), nothing lost; the old primary becomes a standby. None when the instance has no
        standby to switch to."""
        raise PermanentError(f"the {self.name} provisioner does not switch over by the control plane")

    async def operator_events(self, instance_id: uuid.UUID) -> tuple[OperatorEvent, ...]:
        """Where the infrastructure fails over by itself: what its operator recorded of the moves of
        the instance's primary (and its warnings), the newest few, oldest first; read when the
        audit log records such a failover (takes no fence). None recorded here."""
        return ()

    async def recovery_window(self, instance_id: uuid.UUID) -> RecoveryWindow | None:
        """The instance's recoverable window as last known, also once it is gone or deleted (takes
        no fence); None where the provisioner keeps no archive of it."""
        return None

    async def verify_backups(self, instance_id: uuid.UUID) -> str | None:
        """Read back and check every backup and archived segment of the instance; None when sound,
        else what is wrong. By default nothing is checked."""
        return None

    async def expire(self, instance_id: uuid.UUID) -> bool:
        """Remove what is kept of a deleted instance once its retention ran out (its archive and
        backups); True when something was removed."""
        return False

    @abc.abstractmethod
    async def apply_plan(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> bool:
        """Make the running settings those of `spec.plan`; True when something changed."""

    @abc.abstractmethod
    async def suspend(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> bool:
        """Hard read-only on, existing sessions ended; True when something changed."""

    @abc.abstractmethod
    async def resume(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> bool:
        """Read-only off; True when something changed."""

    async def final_backup(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> str | None:
        """Take the backup a deletion keeps, before anything is removed (its own step, so that its
        progress shows); returns its name (safe to show a customer), or None when there is no
        data to back up. Idempotent: a final backup already taken is adopted; `deprovision`
        afterwards adopts it too. By default the provisioner takes it inside `deprovision`.
        """
        return None

    @abc.abstractmethod
    async def deprovision(
        self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, *, skip_backup: bool = False
    ) -> DeprovisionResult:
        """Final backup (unless skipped; adopted when `final_backup` took it), then remove
        everything the instance had."""

    @abc.abstractmethod
    async def observe(self, instance_id: uuid.UUID) -> Observation:
        """Read-only look at the instance (takes no fence: it changes nothing)."""

    @abc.abstractmethod
    async def inventory(self) -> list[Resource]:
        """Every resource this provisioner manages, with the instance id it carries."""

    def refuse_unsupported_restore(self, spec: InstanceSpec) -> None:
        """A restore this provisioner cannot do must fail, never quietly create an empty database."""
        if spec.restore_from is not None and not self.supports_restore:
            raise PermanentError(
                f"restoring from a backup is not supported by the {self.name} provisioner",
                code=RESTORE_UNSUPPORTED,
            )

    async def close(self) -> None:  # noqa: B027 (optional hook)
        """Release clients and connections."""

    async def start_all(self, instance_ids: Collection[uuid.UUID]) -> list[uuid.UUID]:
        """Bring up the servers of these instances where this host runs them (after a restart).

        Returns the ids whose servers were started. Hosts that run nothing themselves do nothing.
        """
        return []

    async def stop_all(self) -> list[uuid.UUID]:
        """Stop every server this host runs for its instances (on shutdown); returns their ids."""
        return []

    # ---- backups and restore ----------------------------------------------------------------
    #
    # A provisioner whose backups the control plane schedules and records says so in
    # `supports_backups`: the reconciler then enqueues a `backup` job per the plan's schedule
    # (`spec.backup_schedule()`), the worker records what `list_backups` returns after each one,
    # and an instance whose data is lost is restored in place with `restore`. (A provisioner may
    # take on-demand backups without that, its own schedule running elsewhere: the kubernetes one,
    # whose operator schedules them.) The defaults below are those of a provisioner that takes none.

    async def take_backup(
        self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, *, kind: str = "on_demand"
    ) -> BackupInfo:
        """Back the running instance up now and wait until it is complete (consistent and
        restorable on its own); `kind` is `scheduled` or `on_demand`.

        Afterwards the oldest backups beyond `spec.backup_schedule().keep` may be removed
        (retention, where the provisioner keeps them). Fenced like every step.
        """
        raise PermanentError(f"on-demand backups are not supported by the {self.name} provisioner")

    async def list_backups(self, instance_id: uuid.UUID) -> list[BackupInfo]:
        """The instance's backups this provisioner holds now, oldest first (takes no fence)."""
        return []

    async def restore(
        self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, *, point: RestorePoint
    ) -> Restored:
        """Put the instance's storage back in place: to the end of its archive (the default), from
        one backup `list_backups` names, or empty (`point.empty`: only when someone accepted that
        the data is lost). Existing storage is never destroyed (it is set aside). The operations
        then run `configure_network`, `initialize_database`, `apply_plan` and `configure_archive`
        as a heal does.
        """
        raise PermanentError(f"the {self.name} provisioner cannot restore")

    async def ca_certificate(self) -> str | None:
        """The PEM certificate of the CA that signs the instances' server certificates (what a
        client verifies a server with, `sslmode=verify-full`); None when it issues none."""
        return None


def fence_key(instance_id: uuid.UUID) -> str:
    return f"instance-{instance_id}"


@contextlib.asynccontextmanager
async def fenced(fences: FileFences, instance_id: uuid.UUID, fence: int) -> AsyncIterator[int]:
    """Admit `fence` for the instance and hold its lock while the step acts (StaleFence if lower).

    The lock is taken in a thread; if the caller is cancelled while waiting, the lock is released
    as soon as the thread gets it, so a cancelled step never leaves the instance locked.
    """
    holder = fences.hold(fence_key(instance_id), fence)
    entering = asyncio.ensure_future(asyncio.to_thread(holder.__enter__))
    try:
        highest = await asyncio.shield(entering)
    except asyncio.CancelledError:
        entering.add_done_callback(
            lambda done: holder.__exit__(None, None, None) if not done.exception() else None
        )
        raise
    try:
        yield highest
    finally:
        holder.__exit__(None, None, None)


def fences_for(data_dir: Path) -> FileFences:
    """Where a provisioner on this host keeps the highest fence seen per instance."""
    return FileFences(Path(data_dir) / "fences")


async def operator_events_detail(provisioner: Provisioner, instance_id: uuid.UUID) -> dict[str, Any]:
    """The SRE detail of a failover the operator carried out by itself: the events it recorded on
    it; where they cannot be read, why (the failover is recorded all the same)."""
    try:
        events = await provisioner.operator_events(instance_id)
    except Exception as exc:  # the audit log still records the failover, and says what is missing
        logging.getLogger(__name__).warning(
            "instance %s: the operator's events were not read: %s", instance_id, first_line(exc)
        )
        return {"operator_events_error": first_line(exc)}
    return {"operator_events": [event.as_dict() for event in events]}
