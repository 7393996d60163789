"""Request and response bodies of the API (pydantic), as published in the OpenAPI schema."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, field_validator

from controlplane.core import lifecycle, plans

DNS_LABEL = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
REGION = r"^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$"
DEFAULT_REGION = "local"

if TYPE_CHECKING:
    # A Literal built from the lifecycle tables is no static type: the type checker sees a str.
    InstanceState = str
    JobState = str
else:
    InstanceState = Literal[lifecycle.INSTANCE.states]
    JobState = Literal[lifecycle.JOB.states]


def _rfc3339_only(value: object) -> object:
    """Refuse what pydantic would otherwise read as a date-time (unix numbers, bare dates)."""
    if isinstance(value, str) and not re.fullmatch(r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}.*", value):
        raise ValueError("expected an RFC 3339 date-time, e.g. 2026-01-31T12:00:00Z")
    return value


# A plan's name is one schema (`PlanName`, its enum the plans offered; controlplane.api.openapi adds
# it) for what GET /v1/plans lists and what create and change take: a client passes one to the other.
PLAN_NAME_REF = {"$ref": "#/components/schemas/PlanName"}


def plan_name_schema() -> dict[str, Any]:
    return {
        "type": "string",
        "enum": list(plans.plan_names()),
        "description": "A plan's name (GET /v1/plans lists the plans).",
    }


def _plan_name(field: str, *, nullable: bool = False) -> Callable[[dict[str, Any]], None]:
    """A model's `json_schema_extra` that makes `field` a PlanName (its description kept)."""

    def extra(schema: dict[str, Any]) -> None:
        prop = schema["properties"][field]
        kept = {key: prop[key] for key in ("description", "examples") if key in prop}
        shape = {"anyOf": [PLAN_NAME_REF, {"type": "null"}]} if nullable else dict(PLAN_NAME_REF)
        schema["properties"][field] = shape | kept

    return extra


def _all(*extras: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def extra(schema: dict[str, Any]) -> None:
        for each in extras:
            each(schema)

    return extra


# A date-time query parameter: RFC 3339 text only.
Timestamp = Annotated[datetime, BeforeValidator(_rfc3339_only)]


def _optional_in_clients(schema: dict[str, Any]) -> None:
    """A request field that may be left out declares no `default`: client generators (openapi-typescript
    among them) make a field with a default required, as answers always carry it; the field's
    description says what it defaults to."""
    for prop in schema.get("properties", {}).values():
        prop.pop("default", None)


class Strict(BaseModel):
    """Request bodies refuse unknown fields; the fields they may leave out are optional in clients."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_optional_in_clients)


def _known_plan(value: str | None) -> str | None:
    if value is not None and not plans.is_plan(value):
        raise ValueError(f"unknown plan {value!r}; plans are {', '.join(plans.plan_names())}")
    return value


def _is_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True


class RestoreFrom(Strict):
    instance_id: uuid.UUID = Field(description="an instance of this organisation, live or deleted")
    backup: str | None = Field(
        None,
        min_length=1,
        max_length=253,
        pattern=r"^[A-Za-z0-9]([-A-Za-z0-9._]*[A-Za-z0-9])?$",
        description="one of that instance's backups (its final backup is named in the audit log);"
        " with point_in_time, the base the replay starts from",
    )
    point_in_time: Timestamp | None = Field(
        None, description="RFC 3339, with a time zone: replay that instance's archive up to this moment"
    )

    @field_validator("point_in_time")
    @classmethod
    def _with_time_zone(cls, value: datetime | None) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("point_in_time needs a time zone (RFC 3339)")
        return value


class InstanceCreate(Strict):
    name: str = Field(
        min_length=1,
        max_length=63,
        description="DNS label, unique among live instances",
        examples=["orders"],
        json_schema_extra={"pattern": DNS_LABEL},
    )
    model_config = ConfigDict(
        extra="forbid", json_schema_extra=_all(_optional_in_clients, _plan_name("plan"))
    )

    plan: str = Field(description="one of the plans listed by GET /v1/plans", examples=["dev"])
    region: str = Field(DEFAULT_REGION, max_length=32, pattern=REGION)
    deletion_protection: StrictBool = False
    restore_from: RestoreFrom | None = Field(
        None, description="fill the new instance from another's backup or point in time (kubernetes)"
    )

    _plan = field_validator("plan")(_known_plan)

    @field_validator("name")
    @classmethod
    def _dns_label(cls, value: str) -> str:
        if not re.fullmatch(DNS_LABEL, value):
            raise ValueError(
                "use lower-case letters, digits and hyphens, starting and ending with a letter or digit"
            )
        if _is_uuid(value):
            raise ValueError("a name cannot have the form of an id (instances are named or found by either)")
        return value


class InstanceUpdate(Strict):
    model_config = ConfigDict(
        extra="forbid", json_schema_extra=_all(_optional_in_clients, _plan_name("plan", nullable=True))
    )

    plan: str | None = Field(None, examples=["small"])
    deletion_protection: StrictBool | None = None

    _plan = field_validator("plan")(_known_plan)


class DirectConnection(BaseModel):
    """The primary server's own address, beside a pooled endpoint: for what needs one server
    connection for a whole session (LISTEN, session-level advisory locks, named prepared
    statements). It moves when a standby takes over; the pooled address does not."""

    host: str
    port: int
    uri: str = Field(description="the same credentials and TLS as the pooled `uri`, to this address")


class ReadOnlyConnection(BaseModel):
    """An HA plan's read-only endpoint: sessions there reach a streaming standby (reads that may
    trail the primary's commits by a moment; every write refused by the server, whatever the
    session sets). It stays the same across failovers and switchovers."""

    host: str
    port: int
    dbname: str = Field(description="the database name to connect with (not the primary's `dbname`)")
    uri: str = Field(description="the same credentials and TLS as the pooled `uri`, to this endpoint")


class Connection(BaseModel):
    host: str
    port: int
    dbname: str
    user: str
    password: str | None = Field(description="shown by GET /v1/instances/{id} only")
    sslmode: str | None = Field(
        None,
        description="the libpq sslmode to connect with, when TLS is required (verify-full: check the"
        " server's certificate against ca_certificate, or the CA of GET /v1/ca.pem)",
    )
    ca_certificate: str | None = Field(
        None, description="PEM of the CA that signs the server's certificate (sslrootcert)"
    )
    sslrootcert: str | None = Field(
        None,
        description="the file name `uri` gives as sslrootcert (`controlplane-ca.pem`, relative to where"
        " the client runs) when the server's certificate is verified: save ca_certificate under it",
    )
    uri: str = Field(
        description="a libpq connection URI: TLS with the server's certificate verified against the CA"
        " file `sslrootcert` names (save ca_certificate there first)"
    )
    pool_mode: Literal["transaction", "session"] | None = Field(
        None,
        description="how the endpoint pools server connections, when it is a pooler's (an HA plan's"
        " stable address, which follows the primary): `transaction`: a server connection per"
        " transaction; null: the server itself",
    )
    direct: DirectConnection | None = Field(
        None, description="the primary server's own address, beside a pooled endpoint (see pool_mode)"
    )
    read_only: ReadOnlyConnection | None = Field(
        None,
        description="an HA plan's read-only endpoint, which leads to a streaming standby: reads only"
        " (writes are refused), possibly a moment behind the primary; null: the plan has no standby",
    )


class StateInfo(BaseModel):
    """The lifecycle's metadata of a state (GET /v1/lifecycle publishes the table)."""

    label: str
    description: str
    severity: Literal["healthy", "transient", "fault", "suspended", "terminal"]
    billing: Literal["billed", "storage_only", "not_billed"] = Field(
        description="what time in the state is billed for (an instance's: for its failure code)"
    )
    billing_by_failure: dict[str, Literal["billed", "storage_only", "not_billed"]] = Field(
        description="another billing class while the failure code of the move into the state is one of"
        " these (a degradation for lost data: storage only)"
    )


class Failure(BaseModel):
    """What is wrong, as the customer is told: a stable code, a message, whether asking again helps."""

    code: str = Field(description="a stable code (GET /v1/lifecycle: failure_reasons)")
    message: str
    retryable: bool = Field(
        description="failed: whether POST /v1/instances/{id}/retry can help (it is refused otherwise);"
        " degraded: whether asking for the same change again can help"
    )
    hint: str = Field(description="what to do about it")


class Step(BaseModel):
    name: str
    label: str
    state: Literal["pending", "running", "done", "failed"]
    attempts: int = Field(description="how many times the step was started in this state")
    started_at: datetime | None
    finished_at: datetime | None
    duration_s: float | None = Field(description="of its latest attempt (up to now while running)")
    expected_s: float | None = Field(description="how long it usually takes (null without history)")
    failure: Failure | None = Field(description="the reason of its latest failed attempt")


class Progress(BaseModel):
    """Where an instance in a transitional state is: its operation's steps, and when it should be done."""

    operation: str = Field(description="the job kind driving the state: provision, update, deprovision")
    job_id: uuid.UUID | None
    attempt: int | None
    started_at: datetime = Field(description="when the instance entered its state")
    current_step: str | None = Field(description="running now, or failed last while the job waits to retry")
    steps: list[Step]
    expected_by: datetime | None = Field(
        description="when the state should be left: the usual step durations, never after the deadline"
    )
    deadline_at: datetime | None
    overdue: bool = Field(description="expected_by has passed: taking longer than expected")


class Instance(BaseModel):
    id: uuid.UUID
    name: str
    plan: str
    observed_plan: str | None = Field(
        description="the plan the instance runs (last applied); differs from `plan` while a change"
        " is pending or after it was given up"
    )
    region: str
    instances: int | None = Field(description="PostgreSQL servers of the plan (a primary and standbys)")
    storage_gb: int | None = Field(description="the volume of each server, GiB")
    restore_from: RestoreFrom | None = Field(None, description="where its data came from, if restored")
    state: InstanceState
    state_info: StateInfo
    state_version: int
    progress: Progress | None = Field(description="set exactly while the state is transitional")
    allowed_actions: list[str]
    settled: bool = Field(
        description="nothing asked of the instance is still to be done: no transitional state, no"
        " deletion waiting to run, its spec generation applied or given up. What a client waits for"
        " after a create, PATCH or DELETE (their 202 says false until then)"
    )
    spec_generation: int = Field(
        description="counts the accepted spec changes (plans): a PATCH's answer gives the generation"
        " its change is; wait for observed_generation to reach it"
    )
    observed_generation: int = Field(
        description="the last spec generation the instance was brought to (applied)"
    )
    failed_generation: int | None = Field(
        description="the spec generation whose update was given up;"
        " not retried unless the plan is asked for again"
    )
    state_entered_at: datetime
    time_in_state_s: float
    deadline_at: datetime | None
    failure: Failure | None = Field(description="what is wrong (failed, degraded; lost data while suspended)")
    failure_reason: str | None = Field(description="failure.message")
    failure_code: str | None = Field(description="failure.code")
    replaces: uuid.UUID | None = Field(description="the failed instance this one was created to retry")
    replaced_by: uuid.UUID | None = Field(description="the instance created to retry this failed one")
    archived_at: datetime | None = Field(
        description="when this failed instance was deleted: it is left out of lists unless include=archived"
    )
    deletion_protection: bool
    billing_hold: bool
    deletion_requested: bool
    connection: Connection | None
    created_at: datetime
    updated_at: datetime


class InstancePage(BaseModel):
    items: list[Instance]
    next_cursor: str | None


class Actor(BaseModel):
    kind: str
    id: str


class InstanceEvent(BaseModel):
    id: int
    at: datetime
    from_state: str | None
    to_state: str
    event: str
    label: str | None = Field(description="the move's label in a timeline (the lifecycle's edge metadata)")
    actor: Actor
    reason: str | None
    detail: dict[str, Any]
    seq: int = Field(description="the event's place in the instance's hash chain: 0, 1, 2 ...")
    hash: str = Field(description="SHA-256 of the event and the hash before it, hex (docs/architecture.md)")


class InstanceEventPage(BaseModel):
    items: list[InstanceEvent]
    next_cursor: str | None


class AdminStep(BaseModel):
    id: int
    job_id: uuid.UUID
    kind: str
    step: str
    event: Literal["started", "finished", "failed"]
    attempt: int
    fence: int
    worker: str
    at: datetime
    started_at: datetime | None
    code: str | None
    error: str | None = Field(description="the raw error of a failure")


class AdminInstance(Instance):
    failure_reason_raw: str | None = Field(description="the raw error (provider text, paths): SREs only")
    steps: list[AdminStep] = Field(description="every step record of every job of the instance, oldest first")


class AdminEvent(InstanceEvent):
    instance_id: uuid.UUID
    instance_name: str = Field(description="the instance's name")
    org_id: uuid.UUID
    org_name: str = Field(description="the name of the instance's organisation")
    state_version: int
    request_id: str | None


class AdminEventPage(BaseModel):
    items: list[AdminEvent]
    next_cursor: str | None


class OrgCreate(Strict):
    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9 ._-]*$")
    stripe_customer_id: str | None = Field(None, min_length=1, max_length=255, pattern=r"^[A-Za-z0-9_]+$")


class OrgUpdate(Strict):
    stripe_customer_id: str = Field(
        min_length=1, max_length=255, pattern=r"^[A-Za-z0-9_]+$", description="the Stripe customer (cus_...)"
    )


class Org(BaseModel):
    id: uuid.UUID
    name: str
    stripe_customer_id: str | None
    billing_hold: bool
    billing_status: str | None
    created_at: datetime


class KeyCreate(Strict):
    name: str = Field("", max_length=100)


class ApiKey(BaseModel):
    id: uuid.UUID
    prefix: str
    name: str
    created_at: datetime
    revoked_at: datetime | None


class NewApiKey(BaseModel):
    id: uuid.UUID
    prefix: str
    key: str = Field(description="the key itself: shown once, never again")


class OrgCreated(BaseModel):
    org: Org
    key: NewApiKey


class KeyList(BaseModel):
    items: list[ApiKey]
    next_cursor: str | None


class OrgList(BaseModel):
    items: list[Org]


class JobEvent(BaseModel):
    id: int
    job_id: uuid.UUID
    at: datetime
    from_state: str | None
    to_state: str
    event: str
    actor: Actor
    reason: str | None
    detail: dict[str, Any]
    request_id: str | None
    state_version: int


class JobEventList(BaseModel):
    items: list[JobEvent]


class StuckInstance(BaseModel):
    id: uuid.UUID
    org_id: uuid.UUID
    name: str
    state: str
    state_entered_at: datetime
    deadline_at: datetime | None
    deadline_retries: int = Field(description="how often the reconciler retried the state's deadline")
    progress: str | None = Field(description="the step the instance's job last reported")
    overdue_s: float = Field(description="seconds past the deadline")


class SilentJob(BaseModel):
    id: uuid.UUID
    kind: str
    state: str
    claimed_by: str | None
    attempt: int
    silent_for_s: float = Field(description="seconds since the job's holder last heartbeated")


class Stuck(BaseModel):
    instances_past_deadline: list[StuckInstance]
    jobs_without_heartbeat: list[SilentJob]
    stale_after_s: float = Field(description="a heartbeat older than this is silent (the reclaim interval)")


class JobAction(Strict):
    reason: str = Field(min_length=1, max_length=1000)


class Job(BaseModel):
    id: uuid.UUID
    kind: str
    instance_id: uuid.UUID | None
    state: JobState
    state_version: int
    attempt: int
    max_attempts: int
    priority: int
    run_at: datetime
    claimed_by: str | None
    fence: int | None
    heartbeat_at: datetime | None
    error_kind: str | None
    last_error: str | None
    verdict: dict[str, Any] | None
    created_at: datetime
    state_entered_at: datetime


class JobList(BaseModel):
    items: list[Job]


class DwellStat(BaseModel):
    state: str
    count: int = Field(description="stays in this state (closed and still going on)")
    current: int = Field(description="stays still going on")
    p50_s: float
    p95_s: float
    max_s: float


class DwellStats(BaseModel):
    entity: Literal["instance", "job"]
    states: list[DwellStat]


class BackupSchedule(BaseModel):
    interval_s: float = Field(description="a backup every this many seconds")
    keep: int = Field(
        description="how many full backups are kept (the newest), with the differential ones between them and"
        " the WAL archived since the oldest: any moment since then can be restored"
    )
    full_every: int = Field(description="a full backup every this many backups; the others are differential")


class Plan(BaseModel):
    model_config = ConfigDict(json_schema_extra=_plan_name("name"))

    name: str
    settings: dict[str, Any]
    instances: int = Field(description="PostgreSQL servers: one primary, the rest standbys it fails over to")
    storage_gb: int
    cpu: str
    memory: str
    backups: BackupSchedule


class Backup(BaseModel):
    id: str = Field(description="the backup's name, unique per instance: what a restore names")
    kind: Literal["scheduled", "on_demand", "final"]
    type: Literal["full", "diff", "incr"] | None = Field(
        None, description="full: everything; diff: what changed since the full one; incr: since the last one"
    )
    taken_at: datetime
    size_bytes: int | None


class AdminBackup(Backup):
    location: str = Field(description="where the provisioner keeps it")
    recorded_at: datetime


class BackupPage(BaseModel):
    items: list[Backup]
    next_cursor: str | None


class AdminBackupPage(BaseModel):
    items: list[AdminBackup]
    next_cursor: str | None


class ArchiveHealth(BaseModel):
    healthy: bool | None = Field(
        description="whether the last attempt to archive WAL succeeded (null: not known)"
    )
    failing_since: datetime | None = Field(description="when it started failing, while it fails")
    lag_s: float | None = Field(
        description="how far the latest restorable moment trails the last observation"
    )
    lag_bytes: int | None = Field(description="WAL written and not archived yet, as last observed")
    last_archived_at: datetime | None = Field(description="when a WAL segment last reached the archive")


class AdminArchiveHealth(ArchiveHealth):
    detail: str = Field(description="what fails, in the provider's words")


class RecoverableWindow(BaseModel):
    """The moments an instance can be restored to (into a new instance, `restore_from`)."""

    instance_id: uuid.UUID
    earliest: datetime | None = Field(
        description="the end of the oldest backup held; null: nothing restorable"
    )
    latest: datetime | None = Field(
        description="every transaction committed before this moment is archived; null: not known yet"
    )
    archive: ArchiveHealth | None = Field(description="the continuous archive of the instance's WAL")
    observed_at: datetime | None = Field(description="when the provider last reported the window")
    retained_until: datetime | None = Field(
        description="a deleted instance's: when its archive and backups go"
    )
    verified_at: datetime | None = Field(
        description="when its backups and archive were last read back and checked"
    )
    verified: bool | None = Field(description="whether that check found everything sound")
    backups: Sequence[Backup] = Field(description="the backups held, newest first")


class AdminRecoverableWindow(RecoverableWindow):
    archive: AdminArchiveHealth | None = Field(description="the continuous archive, with what fails")
    verify_problem: str | None = Field(description="what the last check of the backups found wrong")
    backups: Sequence[AdminBackup]


class BackupRequested(BaseModel):
    instance_id: uuid.UUID
    job_id: uuid.UUID
    created: bool = Field(description="false when a backup of the instance was already under way")


class RestoreFromBackup(Strict):
    """Bring back an instance whose data is lost from one of its backups (the newest by default)."""

    backup_id: str | None = Field(
        None,
        min_length=1,
        max_length=100,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$",
        description="a backup listed by GET /v1/instances/{id}/backups; omitted: the newest one",
    )
    reason: str | None = Field(None, max_length=500, description="why, for the audit log")


class RestoreEmpty(Strict):
    """Re-create an instance whose data is lost empty: the loss is accepted (no backup is used)."""

    empty: Literal[True]
    reason: str | None = Field(None, max_length=500, description="why, for the audit log")


RestoreRequest = RestoreFromBackup | RestoreEmpty


class PlanList(BaseModel):
    items: list[Plan]


class Transition(BaseModel):
    from_: str = Field(alias="from")
    event: str
    to: str
    label: str | None = Field(None, description="instance moves: the label of the move in a timeline")
    alerts: bool | None = Field(None, description="instance moves: whether the move alerts")


class PublishedState(StateInfo):
    transitional: bool
    deadline_s: float | None = Field(
        description="the deadline this installation enforces (transitional states)"
    )


class LifecycleTable(BaseModel):
    states: list[str]
    initial: str
    terminal: list[str]
    transitions: list[Transition]
    state_info: dict[str, PublishedState] | None = Field(
        None, description="per state (the instance lifecycle)"
    )


class PublishedReason(Failure):
    states: list[str] = Field(description="where the code appears")


class StepName(BaseModel):
    name: str
    label: str


class Lifecycles(BaseModel):
    instance: LifecycleTable
    job: LifecycleTable
    customer_actions: dict[str, str]
    severities: dict[str, str]
    billing_classes: dict[str, str]
    failure_reasons: list[PublishedReason]
    steps: dict[str, list[StepName]] = Field(description="the steps each operation's progress lists")


class WebhookAck(BaseModel):
    received: bool
    outcome: str


class Health(BaseModel):
    status: str
    detail: str | None = None


class MetricsPoint(BaseModel):
    """One step of a database's metrics: gauges over the step, rates since the step before."""

    at: datetime = Field(description="the start of the step")
    connections: float | None = Field(description="client connections, on average over the step")
    connections_max: int | None = Field(description="client connections, at their highest in the step")
    max_connections: int | None = Field(description="connections the plan allows")
    transactions_per_s: float | None = Field(description="commits and rollbacks per second")
    rows_read_per_s: float | None = Field(description="rows returned by scans per second")
    rows_written_per_s: float | None = Field(description="rows inserted, updated and deleted per second")
    cache_hit_ratio: float | None = Field(description="share of block reads served from memory (0 to 1)")
    size_bytes: int | None = Field(description="the database's size")
    allocated_bytes: int | None = Field(description="the storage allocated to it")
    replication_lag_s: float | None = Field(description="how far the standbys are behind (not reported yet)")
    archive_lag_s: float | None = Field(description="age of the newest archived WAL (not reported yet)")


class MetricsSeries(BaseModel):
    """A database's metrics over a range, at most 720 points."""

    model_config = ConfigDict(populate_by_name=True)

    instance_id: uuid.UUID
    from_: datetime = Field(alias="from", description="the start of the range (inclusive)")
    to: datetime = Field(description="the end of the range (exclusive)")
    step_s: int = Field(description="seconds between points (widened to keep the points bounded)")
    resolution_s: int = Field(description="resolution of the samples the points come from (10 s or 5 min)")
    plan: str
    max_connections: int | None = Field(description="connections the plan allows")
    storage_max_bytes: int | None = Field(description="the most storage autoscaling grows the allocation to")
    points: list[MetricsPoint] = Field(
        description="one per step with samples, oldest first (steps without are left out)"
    )
