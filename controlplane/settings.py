"""Settings: built once at the entry point from CONTROLPLANE_* variables and flags, then passed down."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


class SettingsError(ValueError):
    """A setting has a value that cannot be used."""


@dataclass(frozen=True)
class Settings:
    # Where the control plane's own database lives, as the runtime role (API, worker, reconciler,
    # SRE commands); empty means the embedded server.
    database_url: str | None = None
    # The same database as the role that owns the tables, for `migrate` (and `up`); empty: the
    # runtime URL is used for migrations too (one role for everything, no least privilege).
    migration_database_url: str | None = None
    # The role `migrate` grants the runtime privileges to; default: the user of database_url.
    runtime_role: str | None = None
    # Everything the control plane keeps on disk: embedded database, instances, backups.
    data_dir: Path = Path(".controlplane")
    api_host: str = "127.0.0.1"
    api_port: int = 8700
    # Public URL of the API, printed for users; defaults to http://api_host:api_port.
    public_url: str | None = None
    max_body_bytes: int = 65536
    # How long the API trusts a key it has verified before asking the database again.
    api_key_cache_s: float = 5.0
    worker_id: str | None = None
    worker_concurrency: int = 8
    heartbeat_interval_s: float = 2.0
    reclaim_after_intervals: int = 5
    poll_interval_s: float = 1.0
    shutdown_grace_s: float = 10.0
    job_max_attempts: int = 5
    retry_base_delay_s: float = 1.0
    retry_max_delay_s: float = 300.0
    reconcile_interval_s: float = 5.0
    reconcile_batch_size: int = 100
    reconcile_concurrency: int = 4
    deadline_pending_s: float = 300.0
    deadline_provisioning_s: float = 600.0
    deadline_updating_s: float = 600.0
    deadline_deprovisioning_s: float = 600.0
    deadline_max_retries: int = 2
    heal_backoff_base_s: float = 30.0
    heal_backoff_max_s: float = 3600.0
    provisioner: str = "local"
    local_port_min: int = 15432
    local_port_max: int = 15931
    local_listen_host: str = "127.0.0.1"
    kubernetes_namespace: str = "controlplane-instances"
    stripe_webhook_secret: str | None = None
    # Key that encrypts instance passwords at rest; generated into data_dir when unset.
    secret_key: str | None = None
    # Serve /metrics on this port in the worker and reconciler roles (the API serves its own).
    metrics_port: int | None = None
    # Kubernetes API server for the kubernetes provisioner; empty: in-cluster config or kubeconfig.
    kubernetes_host: str | None = None
    # Seconds between the signed checkpoints the reconciler records of the audit log.
    audit_checkpoint_interval_s: float = 300.0
    # Months of event-table partitions the reconciler keeps made ahead of the current one.
    audit_partition_months_ahead: int = 3
    # The kubernetes provisioner's CloudNativePG clusters: storage class of their volumes (empty:
    # the cluster's default) and PostgreSQL image (empty: the operator's default).
    kubernetes_storage_class: str | None = None
    kubernetes_image: str | None = None
    # A barman-cloud ObjectStore in the instances namespace: WAL archive, scheduled and final
    # backups, restores. Empty: no continuous backup (and no restore).
    kubernetes_backup_object_store: str | None = None
    # When the scheduled base backup runs (six-field cron, seconds first, as CloudNativePG reads it).
    kubernetes_backup_schedule: str = "0 0 3 * * *"
    # How customers reach instances: "cluster" (the -rw Service, inside the cluster) or
    # "loadbalancer" (a LoadBalancer Service per instance as well).
    kubernetes_expose: str = "cluster"
    # DNS zone for external names: an instance is <cluster name>.<domain>, in its certificate.
    kubernetes_external_domain: str | None = None
    # Comma-separated CIDRs allowed to connect from outside the cluster (with "loadbalancer").
    kubernetes_client_cidrs: str | None = None
    # Where the CloudNativePG operator runs (its pods reach the instances' status port).
    kubernetes_operator_namespace: str = "cnpg-system"
    log_level: str = "INFO"
    log_format: str = "json"
    extra: Mapping[str, str] = field(default_factory=dict)

    @property
    def reclaim_after_s(self) -> float:
        return self.heartbeat_interval_s * self.reclaim_after_intervals

    @property
    def api_url(self) -> str:
        return self.public_url or f"http://{self.api_host}:{self.api_port}"

    def deadline_s(self, state: str) -> float | None:
        """Seconds an instance may stay in a transitional state before the reconciler acts."""
        return {
            "pending": self.deadline_pending_s,
            "provisioning": self.deadline_provisioning_s,
            "updating": self.deadline_updating_s,
            "deprovisioning": self.deadline_deprovisioning_s,
        }.get(state)

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


ENV_PREFIX = "CONTROLPLANE_"


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _convert(name: str, kind: object, raw: str) -> object:
    text = raw.strip()
    try:
        if kind in ("int", int):
            return int(text)
        if kind in ("float", float):
            return float(text)
        if kind in ("Path", Path):
            return Path(text).expanduser()
        if kind in ("bool", bool):
            if text.lower() in {"1", "true", "yes", "on"}:
                return True
            if text.lower() in {"0", "false", "no", "off"}:
                return False
            raise ValueError(text)
    except ValueError:
        raise SettingsError(f"{env_name(name)}={raw!r} is not a valid {kind}") from None
    return text or None


def load(environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """Settings from the environment, with explicit overrides (CLI flags) winning."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f in fields(Settings):
        if f.name == "extra":
            continue
        raw = env.get(env_name(f.name))
        if raw is not None and raw != "":
            kind = str(f.type).replace(" | None", "")
            values[f.name] = _convert(f.name, kind, raw)
    values.update({k: v for k, v in overrides.items() if v is not None})
    settings = Settings(**values)
    validate(settings)
    return settings


def validate(settings: Settings) -> None:
    if settings.local_port_min > settings.local_port_max:
        raise SettingsError("CONTROLPLANE_LOCAL_PORT_MIN is above CONTROLPLANE_LOCAL_PORT_MAX")
    if settings.worker_concurrency < 1:
        raise SettingsError("CONTROLPLANE_WORKER_CONCURRENCY must be at least 1")
    if settings.heal_backoff_base_s < 0 or settings.heal_backoff_max_s < settings.heal_backoff_base_s:
        raise SettingsError(
            "CONTROLPLANE_HEAL_BACKOFF_BASE_S must be at least 0 and at most CONTROLPLANE_HEAL_BACKOFF_MAX_S"
        )
    if settings.heartbeat_interval_s <= 0:
        raise SettingsError("CONTROLPLANE_HEARTBEAT_INTERVAL_S must be positive")
    if settings.migration_database_url and not settings.database_url:
        raise SettingsError(
            "CONTROLPLANE_MIGRATION_DATABASE_URL is set but CONTROLPLANE_DATABASE_URL is not: "
            "set both (the owner's URL and the runtime role's)"
        )
    if not 1 <= settings.audit_partition_months_ahead <= 24:
        raise SettingsError("CONTROLPLANE_AUDIT_PARTITION_MONTHS_AHEAD must be between 1 and 24")
    if settings.audit_checkpoint_interval_s <= 0:
        raise SettingsError("CONTROLPLANE_AUDIT_CHECKPOINT_INTERVAL_S must be positive")
    if settings.kubernetes_expose not in {"cluster", "loadbalancer"}:
        raise SettingsError(
            f"CONTROLPLANE_KUBERNETES_EXPOSE={settings.kubernetes_expose!r}: expected cluster or loadbalancer"
        )
    if settings.kubernetes_expose == "loadbalancer" and not settings.kubernetes_external_domain:
        raise SettingsError(
            "CONTROLPLANE_KUBERNETES_EXPOSE=loadbalancer needs CONTROLPLANE_KUBERNETES_EXTERNAL_DOMAIN:"
            " the name clients verify the server's certificate against"
        )
    for cidr in client_cidrs(settings):
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            raise SettingsError(f"CONTROLPLANE_KUBERNETES_CLIENT_CIDRS: {cidr!r} is not a CIDR") from None
    if settings.provisioner not in {"local", "kubernetes", "noop"}:
        raise SettingsError(
            f"CONTROLPLANE_PROVISIONER={settings.provisioner!r}: expected local, kubernetes or noop"
        )


def client_cidrs(settings: Settings) -> list[str]:
    """CONTROLPLANE_KUBERNETES_CLIENT_CIDRS as a list (empty when unset)."""
    return [part.strip() for part in (settings.kubernetes_client_cidrs or "").split(",") if part.strip()]
