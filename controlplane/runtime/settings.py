"""Settings: one typed model in groups, built once where a command starts (`load`), then passed down.

Every setting has a flat name (e.g. `worker_concurrency`), which gives its environment variable
(`CONTROLPLANE_WORKER_CONCURRENCY`) and its flag (`--worker-concurrency`); in code it sits in its
group (`settings.worker.concurrency`). A secret is a `SecretStr` (never printed) and may also come
from a file named by `<VARIABLE>_FILE`, as container platforms mount them. A value that cannot be
used is refused at start with one line naming the variable, the value and what is allowed
(`SettingsError`).

`Settings(...)` and `settings.replace(...)` take the groups (`worker={"concurrency": 3}`) or the
flat names (`worker_concurrency=3`), and read no environment: only `load` does.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import os
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

ENV_PREFIX = "CONTROLPLANE_"
FILE_SUFFIX = "_FILE"
MASK = "**********"


# What CONTROLPLANE_SECRET_KEY (or data_dir/secret.key) must be: a Fernet key.
FERNET_KEY_FORM = (
    "a Fernet key: 32 bytes in URL-safe base64, 44 characters (make one with `python3 -c"
    " 'import base64, os; print(base64.urlsafe_b64encode(os.urandom(32)).decode())'`)"
)


def is_fernet_key(text: str | bytes) -> bool:
    """Whether `text` is what Fernet takes as a key: 32 bytes in URL-safe base64."""
    raw = text.encode() if isinstance(text, str) else bytes(text)
    try:
        return len(base64.urlsafe_b64decode(raw.strip())) == 32 and len(raw.strip()) == 44
    except (binascii.Error, ValueError):
        return False


class SettingsError(ValueError):
    """A setting has a value that cannot be used (one line: the variable, the value, what is allowed)."""


class NotAvailable(SettingsError):
    """Valid settings point at something that cannot be used now: the data directory another `up`
    holds, a port in use, an embedded database that is not running. One line, as a SettingsError,
    but not a usage error: the same command works once the machine's state changes."""


def env_name(flat_name: str) -> str:
    return ENV_PREFIX + flat_name.upper()


def flag_name(flat_name: str) -> str:
    return "--" + flat_name.replace("_", "-")


def _setting(default: Any, flat: str, meaning: str, **constraints: Any) -> Any:
    """A field of a group: its default, its flat name (variable and flag), what it means."""
    return Field(default, alias=flat, description=meaning, **constraints)


class _Group(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    @field_validator("*", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        """An empty value (`CONTROLPLANE_X=`) means the default, as an unset one does."""
        if isinstance(value, str) and not value.strip():
            return None
        return value.strip() if isinstance(value, str) else value


class DatabaseSettings(_Group):
    url: SecretStr | None = _setting(
        None,
        "database_url",
        "The control plane's own PostgreSQL (`postgresql://...`) as the **runtime role**, which the "
        "API, the worker, the reconciler and the SRE commands use. Empty: the embedded server under "
        "`data_dir/db` (as its `controlplane_app` role), which only `up` starts (the other commands "
        "use it while `up` runs, and otherwise say so).",
    )
    migration_url: SecretStr | None = _setting(
        None,
        "migration_database_url",
        "The same database as the role that **owns** the tables, for `controlplane migrate` (and "
        "`up`'s migration) only ([deployment.md](deployment.md#two-database-roles)). Empty: "
        "migrations use `CONTROLPLANE_DATABASE_URL`, so one role owns the tables and runs the "
        "services, and `migrate` warns that it could rewrite the audit log. Needs "
        "`CONTROLPLANE_DATABASE_URL`.",
    )
    runtime_role: str | None = _setting(
        None,
        "runtime_role",
        "The role `migrate` grants the runtime privileges to. Empty: the user of "
        "`CONTROLPLANE_DATABASE_URL` when `CONTROLPLANE_MIGRATION_DATABASE_URL` is set (none "
        "otherwise). Set it to a group role when the runtime users are made on the fly (one per "
        "replica, or by a secrets manager) and are members of it.",
    )
    pg_bindir: Path | None = _setting(
        None,
        "pg_bindir",
        "PostgreSQL server binaries (`initdb`, `postgres`) for the embedded server and the local "
        "provisioner; empty: `postgres` on the PATH, then `/usr/lib/postgresql/*/bin`, then the "
        "`pgserver` package.",
    )

    api_lock_timeout_s: float = _setting(
        2.0,
        "api_lock_timeout_s",
        "`lock_timeout` of the API's sessions: a request that cannot lock a row this soon (another "
        "session holds it) is answered 409 with `Retry-After` instead of waiting. 0: the database "
        "role's or server's own.",
        ge=0,
    )
    api_statement_timeout_s: float = _setting(
        15.0,
        "api_statement_timeout_s",
        "`statement_timeout` of the API's sessions (503 with `Retry-After` beyond). 0: the database "
        "role's or server's own.",
        ge=0,
    )
    background_lock_timeout_s: float = _setting(
        10.0,
        "background_lock_timeout_s",
        "`lock_timeout` of the worker's, reconciler's and supervisor's sessions (the statement fails "
        "and its job or pass is retried). 0: the database role's or server's own.",
        ge=0,
    )
    background_statement_timeout_s: float = _setting(
        120.0,
        "background_statement_timeout_s",
        "`statement_timeout` of the worker's, reconciler's and supervisor's sessions. 0: the "
        "database role's or server's own.",
        ge=0,
    )

    @field_validator("url", "migration_url")
    @classmethod
    def _postgresql(cls, value: SecretStr | None) -> SecretStr | None:
        schemes = ("postgresql://", "postgres://", "postgresql+psycopg://")
        if value is not None and not value.get_secret_value().startswith(schemes):
            raise ValueError("a postgresql:// URL")
        return value

    @property
    def url_value(self) -> str | None:
        """The URL itself (it carries a password: pass it on, never print it)."""
        return None if self.url is None else self.url.get_secret_value()

    @property
    def migration_url_value(self) -> str | None:
        """The owner's URL itself (it carries a password: pass it on, never print it)."""
        return None if self.migration_url is None else self.migration_url.get_secret_value()

    @model_validator(mode="after")
    def _both_roles(self) -> DatabaseSettings:
        if self.migration_url is not None and self.url is None:
            raise ValueError(
                f"{env_name('migration_database_url')} is set but {env_name('database_url')} is not:"
                " set both (the owner's URL and the runtime role's)"
            )
        return self


class ApiSettings(_Group):
    host: str = _setting(
        "127.0.0.1",
        "api_host",
        "Address the API listens on (and the metrics server of the worker and reconciler).",
    )
    port: int = _setting(8700, "api_port", "Port of the API.", ge=1, le=65535)
    public_url: str | None = _setting(
        None,
        "public_url",
        "URL of the API as users reach it, printed by `up`; default `http://api_host:api_port`.",
    )
    max_body_bytes: int = _setting(
        65536, "max_body_bytes", "Largest request body accepted (413 beyond).", ge=1
    )
    key_cache_s: float = _setting(
        5.0,
        "api_key_cache_s",
        "How long an API process trusts a key it verified before asking the database again (0: every "
        "request). A revocation through the API takes effect at once on the process that served it, "
        "within this time on the others.",
        ge=0,
    )
    max_keys_per_org: int = _setting(
        100,
        "api_max_keys_per_org",
        "Live API keys one organisation may hold (a new one beyond is refused with 409: revoke one first).",
        ge=1,
    )
    console_session_s: float = _setting(
        43200.0,
        "console_session_s",
        "How long a console sign-in lasts before the key is asked for again (signing out, or "
        "revoking the key, ends it sooner).",
        ge=60,
    )
    rate_limit: int = _setting(
        600,
        "api_rate_limit",
        "Requests one API key may make per window, counted by each API process (429 with Retry-After "
        "beyond; 0: no limit). Requests without a key count per client address.",
        ge=0,
    )
    rate_window_s: float = _setting(60.0, "api_rate_window_s", "The rate limits' window, in seconds.", gt=0)
    webhook_rate_limit: int = _setting(
        1200,
        "api_webhook_rate_limit",
        "Requests the Stripe webhook route takes per window on each API process, whoever sends them "
        "(0: no limit); Stripe retries what is refused with 429.",
        ge=0,
    )
    sign_in_limit: int = _setting(
        10,
        "console_sign_in_limit",
        "Console sign-in attempts per window from one client address, and with one key prefix, on each "
        "API process (beyond, the form is refused with 429 until the window resets; 0: no limit).",
        ge=0,
    )

    @property
    def url(self) -> str:
        return self.public_url or f"http://{self.host}:{self.port}"


class WorkerSettings(_Group):
    id: str | None = _setting(
        None, "worker_id", "Name of this worker in claims and audit rows; default `<host>-<pid>`."
    )
    concurrency: int = _setting(8, "worker_concurrency", "Jobs one worker runs at once.", ge=1)
    heartbeat_interval_s: float = _setting(
        2.0, "heartbeat_interval_s", "How often a worker heartbeats each job it holds.", gt=0
    )
    reclaim_after_intervals: int = _setting(
        5,
        "reclaim_after_intervals",
        "A job whose heartbeat is older than this many intervals is reclaimed.",
        ge=1,
    )
    poll_interval_s: float = _setting(
        1.0, "poll_interval_s", "How often a worker looks for jobs when no notification woke it.", gt=0
    )
    shutdown_grace_s: float = _setting(
        10.0,
        "shutdown_grace_s",
        "On SIGTERM, how long running jobs may finish before they are handed back.",
        ge=0,
    )
    job_max_attempts: int = _setting(
        5, "job_max_attempts", "Attempts before a failing job is abandoned.", ge=1
    )
    retry_base_delay_s: float = _setting(
        1.0, "retry_base_delay_s", "First retry delay; doubled per attempt, with jitter.", ge=0
    )
    retry_max_delay_s: float = _setting(300.0, "retry_max_delay_s", "Largest retry delay.", ge=0)

    @property
    def reclaim_after_s(self) -> float:
        return self.heartbeat_interval_s * self.reclaim_after_intervals

    @model_validator(mode="after")
    def _delays_in_order(self) -> WorkerSettings:
        if self.retry_max_delay_s < self.retry_base_delay_s:
            raise ValueError(
                _cross(
                    "retry_base_delay_s",
                    f"at most {env_name('retry_max_delay_s')} ({self.retry_max_delay_s})",
                    self.retry_base_delay_s,
                )
            )
        return self


class ReconcilerSettings(_Group):
    interval_s: float = _setting(
        5.0,
        "reconcile_interval_s",
        "Time between reconciler passes (and between a standby's tries for the leader lock).",
        gt=0,
    )
    batch_size: int = _setting(
        100,
        "reconcile_batch_size",
        "Instances (and jobs per scan) one pass looks at, least recently reconciled first.",
        ge=1,
    )
    concurrency: int = _setting(
        4, "reconcile_concurrency", "Provisioner calls (observe) one pass makes at once.", ge=1
    )
    shards: int = _setting(
        16,
        "reconcile_shards",
        "Shards of the instances (by a hash of the id) that the running reconcilers share out, each "
        "held by one process at a time; more shards than processes keeps the shares even.",
        ge=1,
        le=1024,
    )
    deadline_pending_s: float = _setting(
        300.0, "deadline_pending_s", "Time an instance may stay `pending` before the reconciler acts.", gt=0
    )
    deadline_provisioning_s: float = _setting(
        600.0, "deadline_provisioning_s", "Time an instance may stay `provisioning`.", gt=0
    )
    deadline_updating_s: float = _setting(
        600.0, "deadline_updating_s", "Time an instance may stay `updating` (past it: degraded).", gt=0
    )
    deadline_deprovisioning_s: float = _setting(
        600.0, "deadline_deprovisioning_s", "Time an instance may stay `deprovisioning`.", gt=0
    )
    deadline_max_retries: int = _setting(
        2,
        "deadline_max_retries",
        "Re-enqueues after a missed deadline before the instance is failed (or degraded).",
        ge=0,
    )
    heal_backoff_base_s: float = _setting(
        30.0,
        "heal_backoff_base_s",
        "Pause before healing a degraded instance again after its last heal was given up; doubles "
        "with each heal given up in a row.",
        ge=0,
    )
    heal_backoff_max_s: float = _setting(3600.0, "heal_backoff_max_s", "The longest such pause.", ge=0)
    backup_verify_interval_s: float = _setting(
        86400.0,
        "backup_verify_interval_s",
        "How often the reconciler's maintenance reads back and checks each instance's backups and "
        "archive (`pgbackrest verify`); 0: never.",
        ge=0,
    )
    audit_checkpoint_interval_s: float = _setting(
        300.0,
        "audit_checkpoint_interval_s",
        "Seconds between the signed checkpoints of the audit log the reconciler records (when events "
        "were added). Events newer than the last checkpoint are protected by their chain only; a "
        "shorter interval shortens that window.",
        gt=0,
    )
    audit_partition_months_ahead: int = _setting(
        3,
        "audit_partition_months_ahead",
        "Months of the event tables' monthly partitions the reconciler keeps made ahead of the current one.",
        ge=1,
        le=24,
    )

    metrics_sample_s: int = _setting(
        10,
        "metrics_sample_s",
        "Resolution of the samples of each database's metrics that the reconciler's observation "
        "takes (at most one per instance per interval).",
        ge=1,
        le=300,
    )
    metrics_sample_keep_s: int = _setting(
        86_400, "metrics_sample_keep_s", "How long those samples are kept.", ge=3600
    )
    metrics_rollup_s: int = _setting(
        300,
        "metrics_rollup_s",
        "Resolution of the rolled-up samples kept after that (a multiple of the sample resolution).",
        ge=60,
    )
    metrics_rollup_keep_s: int = _setting(
        30 * 86_400, "metrics_rollup_keep_s", "How long the rolled-up samples are kept.", ge=86_400
    )
    storage_autoscale: bool = _setting(
        True,
        "storage_autoscale",
        "Grow a database's storage allocation when it stays nearly full (up to its plan's maximum).",
    )
    storage_autoscale_free_pct: float = _setting(
        10.0,
        "storage_autoscale_free_pct",
        "Grow when at most this share of the allocation (percent) is free ...",
        gt=0,
        lt=100,
    )
    storage_autoscale_for_s: float = _setting(
        300.0, "storage_autoscale_for_s", "... for at least this long (seconds) ...", ge=0
    )
    storage_autoscale_cooldown_s: float = _setting(
        21_600.0,
        "storage_autoscale_cooldown_s",
        "... and not again before this long after the last growth (also how often the customer is "
        "warned at the maximum).",
        ge=0,
    )
    storage_autoscale_grow_pct: float = _setting(
        10.0,
        "storage_autoscale_grow_pct",
        "Each growth adds this share of the allocation (percent) ...",
        gt=0,
    )
    storage_autoscale_grow_min_gb: int = _setting(
        1, "storage_autoscale_grow_min_gb", "... and at least this many GB.", ge=1
    )

    def deadline_s(self, state: str) -> float | None:
        """Seconds an instance may stay in a transitional state before the reconciler acts."""
        return {
            "pending": self.deadline_pending_s,
            "provisioning": self.deadline_provisioning_s,
            "updating": self.deadline_updating_s,
            "deprovisioning": self.deadline_deprovisioning_s,
        }.get(state)

    @model_validator(mode="after")
    def _backoff_in_order(self) -> ReconcilerSettings:
        if self.heal_backoff_max_s < self.heal_backoff_base_s:
            allowed = f"at least 0 and at most {env_name('heal_backoff_max_s')} ({self.heal_backoff_max_s})"
            raise ValueError(_cross("heal_backoff_base_s", allowed, self.heal_backoff_base_s))
        return self


class ProvisionerSettings(_Group):
    kind: Literal["local", "kubernetes", "noop"] = _setting(
        "local",
        "provisioner",
        "`local` (PostgreSQL servers on this machine), `kubernetes`, or `noop` (benchmarks).",
    )
    noop_observe_latency_s: float = _setting(
        0.0,
        "noop_observe_latency_s",
        "How long the noop provisioner's observe takes (benchmarks of the reconciler).",
        ge=0,
    )
    noop_observe_stats: bool = _setting(
        False,
        "noop_observe_stats",
        "The noop provisioner's observe reports database metrics, as the local one's does, so that the"
        " reconciler samples them (benchmarks of the sampling's cost).",
    )
    local_port_min: int = _setting(
        15432, "local_port_min", "Lowest port the local provisioner gives an instance.", ge=1, le=65535
    )
    local_port_max: int = _setting(
        15931, "local_port_max", "Highest port the local provisioner gives an instance.", ge=1, le=65535
    )
    local_listen_host: str = _setting(
        "127.0.0.1", "local_listen_host", "Address instance servers listen on (loopback by default)."
    )
    local_archive_timeout_s: float = _setting(
        60.0,
        "local_archive_timeout_s",
        "`archive_timeout` of every local instance: a WAL segment is closed and archived at least this "
        "often while the database is written to, which bounds what a lost data directory can lose.",
        ge=1,
        le=3600,
    )
    kubernetes_namespace: str = _setting(
        "controlplane-instances", "kubernetes_namespace", "Namespace of the instances' resources."
    )
    kubernetes_host: str | None = _setting(
        None,
        "kubernetes_host",
        "Kubernetes API server; empty: in-cluster config, else the kubeconfig.",
    )
    kubernetes_token: SecretStr | None = _setting(
        None,
        "kubernetes_token",
        "Bearer token for `kubernetes_host` (with a host only; in-cluster and kubeconfig bring their own).",
    )
    kubernetes_storage_class: str | None = _setting(
        None,
        "kubernetes_storage_class",
        "Storage class of the instances' volumes; empty: the cluster's default (it must allow expansion "
        "for plan upgrades to grow volumes).",
    )
    kubernetes_image: str | None = _setting(
        None,
        "kubernetes_image",
        "PostgreSQL image of every instance; empty: `ghcr.io/cloudnative-pg/postgresql:<version>` when "
        "the spec names a version, else the operator's default.",
    )
    kubernetes_backup_object_store: str | None = _setting(
        None,
        "kubernetes_backup_object_store",
        "Name of a barman-cloud `ObjectStore` in the instances namespace: WAL archive, scheduled and "
        "final backups, restores. Empty: no continuous backup, no restore, and a delete needs "
        "`skip_final_backup`.",
    )
    kubernetes_backup_schedule: str = _setting(
        "0 0 3 * * *",
        "kubernetes_backup_schedule",
        "When the scheduled base backup runs (six-field cron, seconds first); the first runs at once.",
    )
    kubernetes_expose: str = _setting(
        "cluster",
        "kubernetes_expose",
        "`cluster` (the `-rw` Service, inside the Kubernetes cluster) or `loadbalancer` (a "
        "`LoadBalancer` Service per instance as well; needs the external domain).",
    )
    kubernetes_external_domain: str | None = _setting(
        None,
        "kubernetes_external_domain",
        "DNS zone of external names: an exposed instance is `pg-<id>.<domain>`, in its server "
        "certificate and on its Service for external-dns.",
    )
    kubernetes_client_cidrs: str | None = _setting(
        None,
        "kubernetes_client_cidrs",
        "Comma-separated networks allowed to reach exposed instances (the Service's source ranges and "
        "the NetworkPolicy); empty: anywhere.",
    )
    kubernetes_operator_namespace: str = _setting(
        "cnpg-system",
        "kubernetes_operator_namespace",
        "Namespace of the CloudNativePG operator, whose pods the NetworkPolicy admits to the instances' "
        "status port.",
    )
    kubernetes_monitoring_namespace: str = _setting(
        "monitoring",
        "kubernetes_monitoring_namespace",
        "Namespace of the Prometheus that scrapes the instances, whose pods the NetworkPolicy admits to "
        "the instances' metrics exporter (port 9187).",
    )
    kubernetes_pod_monitor: bool = _setting(
        False,
        "kubernetes_pod_monitor",
        "Create a Prometheus Operator `PodMonitor` per instance (its exporter's metrics, labelled with "
        "the instance and organisation ids). Needs the Prometheus Operator's CRDs in the cluster; "
        "`deploy/kubernetes` turns it on.",
    )
    faults: str | None = _setting(
        None,
        "faults",
        "Fault injection for tests: `step:action[:attempt[:when]]`, comma-separated (see "
        "`docs/provisioners.md`); empty: none.",
    )

    @field_validator("faults")
    @classmethod
    def _faults_parse(cls, value: str | None) -> str | None:
        from controlplane.core.faultspec import FaultSpecError, parse_faults

        try:
            parse_faults(value)
        except (FaultSpecError, ValueError) as exc:
            raise ValueError(f"step:action[:attempt[:when]] items ({exc})") from None
        return value

    @model_validator(mode="after")
    def _ports_in_order(self) -> ProvisionerSettings:
        if self.local_port_min > self.local_port_max:
            allowed = f"at most {env_name('local_port_max')} ({self.local_port_max})"
            raise ValueError(_cross("local_port_min", allowed, self.local_port_min))
        return self

    @model_validator(mode="after")
    def _kubernetes_exposure(self) -> ProvisionerSettings:
        """How instances are reached: these refusals name their variables themselves."""
        expose = env_name("kubernetes_expose")
        if self.kubernetes_expose not in {"cluster", "loadbalancer"}:
            raise ValueError(f"{expose}={self.kubernetes_expose!r}: expected cluster or loadbalancer")
        if self.kubernetes_expose == "loadbalancer" and not self.kubernetes_external_domain:
            raise ValueError(
                f"{expose}=loadbalancer needs {env_name('kubernetes_external_domain')}:"
                " the name clients verify the server's certificate against"
            )
        for cidr in self.client_cidrs:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ValueError(f"{env_name('kubernetes_client_cidrs')}: {cidr!r} is not a CIDR") from None
        return self

    @property
    def client_cidrs(self) -> tuple[str, ...]:
        """CONTROLPLANE_KUBERNETES_CLIENT_CIDRS as a tuple (empty when unset)."""
        return tuple(part.strip() for part in (self.kubernetes_client_cidrs or "").split(",") if part.strip())


class BillingSettings(_Group):
    stripe_webhook_secret: SecretStr | None = _setting(
        None,
        "stripe_webhook_secret",
        "Signing secret of the Stripe webhook endpoint (`whsec_...`); without it webhooks are refused.",
    )
    stripe_api_key: SecretStr | None = _setting(
        None,
        "stripe_api_key",
        "Secret key of the Stripe account usage is reported to (`sk_...`); without it no usage is reported.",
    )
    stripe_api_base: str | None = _setting(
        None,
        "stripe_api_base",
        "Base URL of the Stripe API (a proxy or a test server); empty: Stripe's own.",
        pattern=r"^https?://",
    )
    meter_interval_s: float = _setting(
        3600.0,
        "meter_interval_s",
        "Length of a usage period: each one is reported to Stripe once, as meter events.",
        ge=60,
    )
    meter_settle_s: float = _setting(
        300.0,
        "meter_settle_s",
        "How long after a period's end its report waits, for the period's last events to commit.",
        ge=0,
    )
    meter_event_billed: str = _setting(
        "database_compute_seconds",
        "meter_event_billed",
        "The Stripe meter (`event_name`) of the seconds billed for compute and storage.",
        min_length=1,
        max_length=100,
    )
    meter_event_storage_only: str = _setting(
        "database_storage_seconds",
        "meter_event_storage_only",
        "The Stripe meter (`event_name`) of the seconds billed for storage only (suspended instances).",
        min_length=1,
        max_length=100,
    )
    meter_event_storage_gb: str = _setting(
        "database_storage_gb_seconds",
        "meter_event_storage_gb",
        "The Stripe meter (`event_name`) of the allocated storage, in GB-seconds (in every billed or"
        " storage-only state, at the allocation in effect).",
        min_length=1,
        max_length=100,
    )
    grace_period_s: float = _setting(
        7 * 86400.0,
        "billing_grace_period_s",
        "How long an organisation's subscription may stay `past_due` before its instances are suspended "
        "(its notification names the date).",
        ge=0,
    )
    deprovision_after_days: float | None = _setting(
        None,
        "deprovision_after_days",
        "Delete instances suspended by billing for this many days (with their final backup); empty: never.",
        gt=0,
    )
    portal_url: str | None = _setting(
        None,
        "billing_portal_url",
        "Where customers settle a payment (for example your Stripe customer portal's login link): the"
        " console's billing notices link to it; empty: they say to pay the invoice that was sent.",
        pattern=r"^https?://",
    )


class NotificationSettings(_Group):
    allow_http: bool = _setting(
        False,
        "notify_allow_http",
        "Accept `http://` webhook endpoints (development only); otherwise https is required.",
    )
    allow_private: bool = _setting(
        False,
        "notify_allow_private",
        "Accept webhook endpoints on addresses that are not globally reachable: private, loopback, "
        "link-local, shared (checked at registration and again at each delivery).",
    )
    retry_window_s: float = _setting(
        86400.0,
        "notify_retry_window_s",
        "How long a failing delivery is retried (with backoff); then it is given up and its endpoint "
        "disabled.",
        ge=0,
    )
    timeout_s: float = _setting(
        10.0,
        "notify_timeout_s",
        "Longest one webhook delivery may take in all (resolving, connecting, sending, the answer's "
        "status); longer is a failed attempt.",
        gt=0,
    )
    concurrency: int = _setting(
        4,
        "notify_concurrency",
        "Deliveries one worker sends at once, in slots of their own beside `worker_concurrency`'s: slow "
        "receivers never hold the slots of the instances' jobs.",
        ge=1,
    )
    endpoint_concurrency: int = _setting(
        1,
        "notify_endpoint_concurrency",
        "Webhook deliveries one worker process sends to one endpoint at once; the next one for it is "
        "queued again (for one to two `notify_timeout_s`) instead of waiting in a slot.",
        ge=1,
    )
    smtp_host: str | None = _setting(
        None, "smtp_host", "SMTP server notification emails are sent through; empty: no email."
    )
    smtp_port: int = _setting(25, "smtp_port", "Port of the SMTP server.", ge=1, le=65535)
    smtp_from: str = _setting(
        "controlplane@localhost", "smtp_from", "Sender address of notification emails.", min_length=3
    )
    consumer_poll_interval_s: float = _setting(
        2.0,
        "consumer_poll_interval_s",
        "How often the event log's consumers look for events when no notification woke them.",
        gt=0,
    )
    consumer_batch_size: int = _setting(
        200, "consumer_batch_size", "Events a consumer applies per transaction.", ge=1
    )


class LoggingSettings(_Group):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = _setting(
        "INFO", "log_level", "DEBUG, INFO, WARNING, ERROR or CRITICAL."
    )
    format: Literal["json", "text"] | None = _setting(
        None,
        "log_format",
        "`json` (one object per line, with the request id) or `text`; empty: `json`, and `text` for `up`.",
    )

    @field_validator("level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.strip().upper() if isinstance(value, str) else value


class TracingSettings(_Group):
    otlp_endpoint: str | None = _setting(
        None,
        "otlp_endpoint",
        "OpenTelemetry collector receiving the traces over OTLP/HTTP (`http://collector:4318`; "
        "`/v1/traces` is added unless the URL ends with it). Empty: no tracing, at no cost. The "
        "exporter's own `OTEL_EXPORTER_OTLP_HEADERS`, `..._CERTIFICATE` and `..._TIMEOUT` apply.",
    )
    trace_sample_ratio: float = _setting(
        1.0,
        "trace_sample_ratio",
        "Share of the API's requests (and of the jobs no request started) traced, 0 to 1; a job "
        "follows the decision of the request that enqueued it.",
        ge=0,
        le=1,
    )

    @field_validator("otlp_endpoint")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("an http:// or https:// URL (OTLP over HTTP)")
        return value


def _cross(flat: str, allowed: str, value: object) -> str:
    """The sentence of a refusal that depends on another setting (the variable is named in it)."""
    return f"{env_name(flat)} must be {allowed}, not {str(value)!r}"


class Settings(BaseSettings):
    """Every setting of the control plane, in groups."""

    model_config = SettingsConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    data_dir: Path = _setting(
        Path(".controlplane"),
        "data_dir",
        "Everything kept on disk: the embedded database, instance servers (`instances/`), backups "
        "(`backups/<instance id>/` and the final dumps), the CA (`tls/`), the secret key, the admin key "
        "that `up` saved, and `up.lock` (held by the running `up`).",
    )
    secret_key: SecretStr | None = _setting(
        None,
        "secret_key",
        "Fernet key encrypting instance passwords and the audit log's signing key at rest; keys "
        "derived from it seal the console's cookies and form tokens. 32 bytes in URL-safe base64 "
        "(44 characters); anything else is refused at start. Empty: generated once into "
        "`data_dir/secret.key`.",
    )
    metrics_port: int | None = _setting(
        None,
        "metrics_port",
        "Port of `/metrics` in the worker and reconciler roles (the API serves its own).",
        ge=1,
        le=65535,
    )
    crash_points: str | None = _setting(
        None,
        "crash_points",
        "Fault injection for tests: names of places where the process kills itself, comma-separated "
        "(`controlplane/runtime/crashpoints.py`); empty: none.",
    )

    @field_validator("secret_key")
    @classmethod
    def _secret_key_is_a_fernet_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not is_fernet_key(value.get_secret_value()):
            raise ValueError(FERNET_KEY_FORM)
        return value

    @field_validator("crash_points")
    @classmethod
    def _crash_points_parse(cls, value: str | None) -> str | None:
        from controlplane.runtime import crashpoints

        try:
            crashpoints.parse(value)
        except ValueError:
            raise ValueError(f"a comma-separated list of {', '.join(sorted(crashpoints.POINTS))}") from None
        return value

    def __init__(self, **values: Any) -> None:
        """From groups (`worker={"concurrency": 3}`, `worker=WorkerSettings(...)`) or flat names
        (`worker_concurrency=3`, `provisioner="noop"`); nothing is read from the environment."""
        super().__init__(**values)

    database: DatabaseSettings = Field(default_factory=DatabaseSettings)
    api: ApiSettings = Field(default_factory=ApiSettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    reconciler: ReconcilerSettings = Field(default_factory=ReconcilerSettings)
    provisioner: ProvisionerSettings = Field(default_factory=ProvisionerSettings)
    billing: BillingSettings = Field(default_factory=BillingSettings)
    notifications: NotificationSettings = Field(default_factory=NotificationSettings)
    logging: LoggingSettings = Field(default_factory=LoggingSettings)
    tracing: TracingSettings = Field(default_factory=TracingSettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """The given values only: the environment is read by `load`, once, where a command starts."""
        return (init_settings,)

    @model_validator(mode="before")
    @classmethod
    def _grouped(cls, data: Any) -> Any:
        return grouped(data) if isinstance(data, Mapping) else data

    @field_validator("data_dir", mode="before")
    @classmethod
    def _home(cls, value: Any) -> Any:
        return Path(value.strip()).expanduser() if isinstance(value, str) else value

    def replace(self, **changes: Any) -> Settings:
        """A copy with `changes` (flat names or groups), validated as at start."""
        return _build(_merge(self.model_dump(), grouped(changes)))


# ---- the table of settings: flat name -> where it sits in the model ------------------------------

GROUPS: Mapping[str, type[_Group]] = {
    name: field.annotation
    for name, field in Settings.model_fields.items()
    if isinstance(field.annotation, type) and issubclass(field.annotation, _Group)
}


@dataclass(frozen=True)
class Entry:
    """One setting: its flat name, its group (None: top level), its field in the model."""

    flat: str
    group: str | None
    name: str
    field: FieldInfo

    @property
    def env(self) -> str:
        return env_name(self.flat)

    @property
    def flag(self) -> str:
        return flag_name(self.flat)

    @property
    def secret(self) -> bool:
        return SecretStr in (typing.get_args(self.field.annotation) or (self.field.annotation,))

    @property
    def kind(self) -> type:
        """The value's type for a flag: int, float, Path or str."""
        annotation = self.field.annotation
        kinds: tuple[type, ...] = (int, float, Path)
        return next((k for k in kinds if k in (typing.get_args(annotation) or (annotation,))), str)


def _entries() -> Iterator[Entry]:
    for name, field in Settings.model_fields.items():
        if name in GROUPS:
            for sub, subfield in GROUPS[name].model_fields.items():
                yield Entry(subfield.alias or sub, name, sub, subfield)
        else:
            yield Entry(field.alias or name, None, name, field)


SETTINGS: Mapping[str, Entry] = {entry.flat: entry for entry in _entries()}
_BY_PLACE: Mapping[tuple[str | None, str], Entry] = {(e.group, e.name): e for e in SETTINGS.values()}


def grouped(values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` with flat names moved into their groups (`worker_concurrency` -> worker.concurrency)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        entry = SETTINGS.get(key)
        if key in GROUPS and not (entry is not None and isinstance(value, str)):
            group = value.model_dump() if isinstance(value, BaseModel) else dict(value)
            out[key] = _merge(out.get(key, {}), group)
        elif entry is not None and entry.group is not None:
            out.setdefault(entry.group, {})
            if isinstance(out[entry.group], BaseModel):
                out[entry.group] = out[entry.group].model_dump()
            out[entry.group][entry.name] = value
        else:
            out[key if entry is None else entry.name] = value
    return out


def _merge(base: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in changes.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


# ---- reading the environment (once, at start) and refusing bad values in one line -------------------


class EnvironmentSource(PydanticBaseSettingsSource):
    """CONTROLPLANE_* variables of `environ` (and `<VARIABLE>_FILE` for secrets), as grouped values."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        super().__init__(Settings)
        self.environ = environ
        # Where each value came from, for the refusal: the variable's name.
        self.origins: dict[tuple[str | None, str], str] = {}

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        raise NotImplementedError("values are read all at once by __call__")

    def __call__(self) -> dict[str, Any]:
        flat: dict[str, Any] = {}
        for entry in SETTINGS.values():
            raw = self.environ.get(entry.env)
            path = self.environ.get(entry.env + FILE_SUFFIX) if entry.secret else None
            if path:
                if raw:
                    raise SettingsError(f"set {entry.env} or {entry.env}{FILE_SUFFIX}, not both")
                raw = _read_secret(entry.env + FILE_SUFFIX, path)
            if raw is not None and raw.strip():
                flat[entry.flat] = raw
        return grouped(flat)


def _read_secret(variable: str, path: str) -> str:
    try:
        return Path(path).read_text().rstrip("\r\n")
    except OSError as exc:
        raise SettingsError(f"{variable}={path!r} cannot be read: {exc.strerror or exc}") from None


def load(environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """Settings from the environment (os.environ unless given), with overrides (CLI flags) winning.

    Raises SettingsError, one line, for the first value that cannot be used.
    """
    values = EnvironmentSource(os.environ if environ is None else environ)()
    given = {key: value for key, value in overrides.items() if value is not None}
    return _build(_merge(values, grouped(given)))


def _build(values: Mapping[str, Any]) -> Settings:
    try:
        return Settings(**values)
    except ValidationError as exc:
        raise SettingsError(_refusal(exc)) from None


# What each kind of validation error says is allowed.
_ALLOWED = {
    "greater_than_equal": "at least {ge}",
    "greater_than": "greater than {gt}",
    "less_than_equal": "at most {le}",
    "less_than": "less than {lt}",
    "int_parsing": "a whole number",
    "int_type": "a whole number",
    "int_from_float": "a whole number",
    "float_parsing": "a number",
    "float_type": "a number",
    "literal_error": "one of {expected}",
    "string_pattern_mismatch": "of the form module:attribute",
    "path_type": "a path",
    "string_type": "text",
}


def _refusal(exc: ValidationError) -> str:
    """The first error as one line: the variable, what is allowed, the value (a secret masked)."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    loc = tuple(str(part) for part in first["loc"])
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    if first["type"] == "extra_forbidden":
        return f"unknown setting {'.'.join(loc)!r}{more}"
    entry = _entry_at(loc)
    message = str(first.get("ctx", {}).get("error", first["msg"]))
    if entry is None:
        # A refusal that names its variables itself (a setting checked against another one).
        return message.removeprefix("Value error, ") + more
    template = _ALLOWED.get(first["type"])
    ctx = {key: _number(value) for key, value in first.get("ctx", {}).items()}
    allowed = template.format(**ctx) if template else message.removeprefix("Value error, ")
    value = MASK if entry.secret else str(first.get("input"))
    return f"{entry.env} must be {allowed}, not {value!r}{more}"


def _number(value: object) -> object:
    """0.0 as 0: bounds read as they were written."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _entry_at(loc: tuple[str, ...]) -> Entry | None:
    if len(loc) == 1:
        # A whole group's check (one setting against another) names its variables itself.
        return None if loc[0] in GROUPS else SETTINGS.get(loc[0]) or _BY_PLACE.get((None, loc[0]))
    if len(loc) >= 2 and loc[0] in GROUPS:
        return _BY_PLACE.get((loc[0], loc[1])) or SETTINGS.get(loc[1])
    return None


# ---- the reference (docs/configuration.md is checked against it) --------------------------------------


def _default_text(entry: Entry) -> str:
    default = entry.field.get_default(call_default_factory=True)
    return "(empty)" if default is None else f"`{default}`"


def reference_table() -> str:
    """The table of docs/configuration.md: variable, flag, default and meaning of every setting."""
    lines = ["| variable | flag | default | meaning |", "|---|---|---|---|"]
    for entry in SETTINGS.values():
        secret = " A secret: also read from `" + entry.env + FILE_SUFFIX + "`." if entry.secret else ""
        lines.append(
            f"| `{entry.env}` | `{entry.flag}` | {_default_text(entry)} | {entry.field.description}{secret} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(reference_table(), end="")
