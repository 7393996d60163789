"""Server roles: migrate, serve (API), worker, reconcile, and `up` (all of them on the embedded default)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import provisioners
from controlplane.cli import process_roles
from controlplane.cli.common import CommandError, add_settings_flags, settings_from
from controlplane.db import connection as db
from controlplane.handlers import operations
from controlplane.queue.registry import load_registry
from controlplane.runtime import aio, datadir, logs
from controlplane.runtime.settings import Settings
from provisioners.base import Provisioner

DATABASE = ("database_url", "data_dir", "pg_bindir")
MIGRATION = ("migration_database_url", "runtime_role")
LOGGING = ("log_level", "log_format")
API = (
    "api_host",
    "api_port",
    "public_url",
    "max_body_bytes",
    "api_key_cache_s",
    "api_lock_timeout_s",
    "api_statement_timeout_s",
    "api_max_keys_per_org",
    "console_session_s",
    "api_rate_limit",
    "api_rate_window_s",
    "api_webhook_rate_limit",
    "stripe_webhook_secret",
    "secret_key",
    "job_registry",
    "crash_points",
)
PROVISIONER = (
    "provisioner",
    "noop_observe_latency_s",
    "local_port_min",
    "local_port_max",
    "local_listen_host",
    "kubernetes_namespace",
    "kubernetes_host",
    "kubernetes_token",
    "kubernetes_storage_class",
    "kubernetes_image",
    "kubernetes_backup_object_store",
    "kubernetes_backup_schedule",
    "kubernetes_expose",
    "kubernetes_external_domain",
    "kubernetes_client_cidrs",
    "kubernetes_operator_namespace",
    "faults",
    "secret_key",
)
METRICS = ("metrics_port", "api_host")
# Usage reports to Stripe and the billing policy (the reconciler enqueues, the worker sends).
BILLING = (
    "stripe_api_key",
    "stripe_api_base",
    "meter_interval_s",
    "meter_settle_s",
    "meter_event_billed",
    "meter_event_storage_only",
    "billing_grace_period_s",
    "deprovision_after_days",
)
# The event log's consumers and the notifications they deliver (worker); the endpoint checks (API).
NOTIFY = (
    "notify_allow_http",
    "notify_allow_private",
    "notify_retry_window_s",
    "notify_timeout_s",
    "smtp_host",
    "smtp_port",
    "smtp_from",
    "consumer_poll_interval_s",
    "consumer_batch_size",
)
WORKER = (
    "worker_id",
    "worker_concurrency",
    "heartbeat_interval_s",
    "reclaim_after_intervals",
    "poll_interval_s",
    "shutdown_grace_s",
    "job_max_attempts",
    "retry_base_delay_s",
    "retry_max_delay_s",
    "background_lock_timeout_s",
    "background_statement_timeout_s",
    "crash_points",
)
RECONCILER = (
    "reconcile_interval_s",
    "reconcile_batch_size",
    "reconcile_concurrency",
    "reconcile_shards",
    "deadline_pending_s",
    "deadline_provisioning_s",
    "deadline_updating_s",
    "deadline_deprovisioning_s",
    "deadline_max_retries",
    "heal_backoff_base_s",
    "heal_backoff_max_s",
    "heartbeat_interval_s",
    "reclaim_after_intervals",
    "retry_base_delay_s",
    "retry_max_delay_s",
    "background_lock_timeout_s",
    "background_statement_timeout_s",
    "audit_checkpoint_interval_s",
    "audit_partition_months_ahead",
)


def _flags(*groups: tuple[str, ...]) -> list[str]:
    return list(dict.fromkeys(name for group in groups for name in group))


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "migrate", help="bring the database schema to the latest revision (as the owner role)"
    )
    add_settings_flags(parser, _flags(DATABASE, MIGRATION))
    parser.set_defaults(handler=cmd_migrate)

    parser = commands.add_parser("serve", help="run the REST API")
    add_settings_flags(parser, _flags(DATABASE, API, PROVISIONER, BILLING, NOTIFY, LOGGING))
    parser.set_defaults(handler=cmd_serve)

    parser = commands.add_parser("worker", help="run a job worker")
    add_settings_flags(parser, _flags(DATABASE, WORKER, PROVISIONER, BILLING, NOTIFY, LOGGING, METRICS))
    parser.set_defaults(handler=cmd_worker)

    parser = commands.add_parser("reconcile", help="run the reconciler (leader-elected)")
    add_settings_flags(parser, _flags(DATABASE, RECONCILER, PROVISIONER, BILLING, NOTIFY, LOGGING, METRICS))
    parser.add_argument("--once", action="store_true", help="run one pass (if leader) and exit")
    parser.add_argument(
        "--dry-run-orphans", action="store_true", help="list orphaned resources instead of removing them"
    )
    parser.set_defaults(handler=cmd_reconcile)

    parser = commands.add_parser(
        "up", help="run everything in one process: embedded PostgreSQL, API, worker, reconciler"
    )
    add_settings_flags(
        parser, _flags(DATABASE, MIGRATION, API, PROVISIONER, WORKER, RECONCILER, BILLING, NOTIFY, LOGGING)
    )
    parser.add_argument(
        "--leave-instances-running",
        action="store_true",
        help="on exit, leave the instances' PostgreSQL servers running (adopted on the next start)",
    )
    parser.set_defaults(handler=cmd_up)


def _configured(args: argparse.Namespace, default_format: str = "json") -> Settings:
    settings = settings_from(args)
    logs.configure(settings.logging.level, settings.logging.format or default_format)
    for line in fault_warnings(settings):
        print(f"controlplane: warning: {line}", file=sys.stderr, flush=True)
    return settings


def fault_warnings(settings: Settings) -> list[str]:
    """One line per kind of fault injection switched on: a role started with faults says so first."""
    lines = []
    if settings.provisioner.faults:
        lines.append(
            f"fault injection is on: provisioning steps fail on purpose ({settings.provisioner.faults});"
            " for tests only (CONTROLPLANE_FAULTS, --faults)"
        )
    if settings.crash_points:
        lines.append(
            f"crash points are on: this process kills itself at {settings.crash_points};"
            " for tests only (CONTROLPLANE_CRASH_POINTS, --crash-points)"
        )
    return lines


def cmd_migrate(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    try:
        if settings.database.url_value or datadir.holder(settings.data_dir) is not None:
            target = db.migration_target(settings)  # the configured URLs, or the running `up`'s
            db.migrate(target.url, runtime_role=target.runtime_role)
        else:
            from controlplane.runtime.embedded import open_embedded

            # No `up` runs here: the embedded server is started for the migration only, under the lock.
            with datadir.held(settings.data_dir):
                embedded = open_embedded(settings.data_dir / "db", bindir=settings.database.pg_bindir)
                try:
                    target = db.migration_target(settings, embedded)
                    db.migrate(target.url, runtime_role=target.runtime_role)
                finally:
                    embedded.stop()
    except db.RoleError as exc:
        raise CommandError(str(exc)) from None
    print(f"database migrated to revision {db.head_revision()}")
    if target.runtime_role:
        print(f"runtime role {target.runtime_role}: SELECT and INSERT only on the audit log")
    else:
        print(
            "warning: one role for migrations and the services (CONTROLPLANE_MIGRATION_DATABASE_URL "
            "unset): it owns the tables and could rewrite the audit log (docs/deployment.md)",
            file=sys.stderr,
        )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    settings = _configured(args)
    url = db.resolve_database_url(settings)
    # The API runs no job, so it needs no provisioner: only the kinds' abandonment hooks (of the
    # instance operations, or of the kinds CONTROLPLANE_JOB_REGISTRY names). The one whose CA it
    # publishes (GET /v1/ca.pem) is built when first asked for, and closed with the application.
    spec = settings.worker.job_registry
    registry = load_registry(spec) if spec else operations.registry()

    async def run() -> None:
        stop = asyncio.Event()
        process_roles.stop_on_signals(stop)
        await process_roles.run_api(settings, url, registry, stop)

    aio.run(run())
    return 0


# A long-running role over the configured provisioner: (settings, database URL, provisioner, stop).
Role = Callable[[Settings, str, Provisioner, asyncio.Event], Awaitable[None]]


def _run_role(args: argparse.Namespace, role: Role) -> int:
    """Run `role` with its metrics served until a signal sets its stop; the provisioner is closed after."""
    settings = _configured(args)
    url = db.resolve_database_url(settings)

    async def run() -> None:
        provisioner = provisioners.build(settings)
        stop = asyncio.Event()
        process_roles.stop_on_signals(stop)
        process_roles.serve_metrics(settings)
        try:
            await role(settings, url, provisioner, stop)
        finally:
            await provisioner.close()

    aio.run(run())
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    async def worker(settings: Settings, url: str, provisioner: Provisioner, stop: asyncio.Event) -> None:
        await process_roles.run_worker_role(settings, url, operations.registry(provisioner), stop)

    return _run_role(args, worker)


def cmd_reconcile(args: argparse.Namespace) -> int:
    async def reconcile(settings: Settings, url: str, provisioner: Provisioner, stop: asyncio.Event) -> None:
        await process_roles.run_reconciler_role(
            settings,
            url,
            provisioner,
            operations.registry(provisioner),
            stop,
            once=args.once,
            dry_run_orphans=args.dry_run_orphans,
        )

    return _run_role(args, reconcile)


def cmd_up(args: argparse.Namespace) -> int:
    settings = _configured(args, default_format="text")
    return aio.run(process_roles.up(settings, leave_instances_running=args.leave_instances_running))
