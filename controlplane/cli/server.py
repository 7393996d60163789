"""Server roles: migrate, serve (API), worker, reconcile, and `up` (all of them on the embedded default).
Their parsers and the settings each takes; what they do is in `server_commands.py`."""

from __future__ import annotations

from typing import Any

from controlplane.cli.common import add_settings_flags
from controlplane.cli.lazy import LazyHandler

DATABASE = ("database_url", "data_dir", "pg_bindir")
MIGRATION = ("migration_database_url", "runtime_role")
LOGGING = ("log_level", "log_format")
TRACING = ("otlp_endpoint", "trace_sample_ratio")
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
    "billing_portal_url",
    "api_rate_limit",
    "api_rate_window_s",
    "api_webhook_rate_limit",
    "console_sign_in_limit",
    "stripe_webhook_secret",
    "secret_key",
    "crash_points",
)
PROVISIONER = (
    "provisioner",
    "noop_observe_latency_s",
    "noop_observe_stats",
    "local_port_min",
    "local_port_max",
    "local_listen_host",
    "local_archive_timeout_s",
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
    "kubernetes_monitoring_namespace",
    "kubernetes_pod_monitor",
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
    "meter_event_storage_gb",
    "billing_grace_period_s",
    "deprovision_after_days",
)
# The event log's consumers and the notifications they deliver (worker); the endpoint checks (API).
NOTIFY = (
    "notify_allow_http",
    "notify_allow_private",
    "notify_retry_window_s",
    "notify_timeout_s",
    "notify_concurrency",
    "notify_endpoint_concurrency",
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
    "backup_verify_interval_s",
    "heartbeat_interval_s",
    "reclaim_after_intervals",
    "retry_base_delay_s",
    "retry_max_delay_s",
    "background_lock_timeout_s",
    "background_statement_timeout_s",
    "audit_checkpoint_interval_s",
    "audit_partition_months_ahead",
    "metrics_sample_s",
    "metrics_sample_keep_s",
    "metrics_rollup_s",
    "metrics_rollup_keep_s",
    "storage_autoscale",
    "storage_autoscale_free_pct",
    "storage_autoscale_for_s",
    "storage_autoscale_cooldown_s",
    "storage_autoscale_grow_pct",
    "storage_autoscale_grow_min_gb",
)


def _flags(*groups: tuple[str, ...]) -> list[str]:
    return list(dict.fromkeys(name for group in groups for name in group))


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "migrate", help="bring the database schema to the latest revision (as the owner role)"
    )
    add_settings_flags(parser, _flags(DATABASE, MIGRATION))
    parser.set_defaults(handler=_handler("cmd_migrate"))

    parser = commands.add_parser("serve", help="run the REST API")
    add_settings_flags(parser, _flags(DATABASE, API, PROVISIONER, BILLING, NOTIFY, LOGGING, TRACING))
    parser.set_defaults(handler=_handler("cmd_serve"))

    parser = commands.add_parser("worker", help="run a job worker")
    add_settings_flags(
        parser, _flags(DATABASE, WORKER, PROVISIONER, BILLING, NOTIFY, LOGGING, TRACING, METRICS)
    )
    parser.set_defaults(handler=_handler("cmd_worker"))

    parser = commands.add_parser("reconcile", help="run the reconciler (leader-elected)")
    add_settings_flags(
        parser, _flags(DATABASE, RECONCILER, PROVISIONER, BILLING, NOTIFY, LOGGING, TRACING, METRICS)
    )
    parser.add_argument("--once", action="store_true", help="run one pass (if leader) and exit")
    parser.add_argument(
        "--dry-run-orphans", action="store_true", help="list orphaned resources instead of removing them"
    )
    parser.set_defaults(handler=_handler("cmd_reconcile"))

    parser = commands.add_parser(
        "up", help="run everything in one process: embedded PostgreSQL, API, worker, reconciler"
    )
    add_settings_flags(
        parser,
        _flags(DATABASE, MIGRATION, API, PROVISIONER, WORKER, RECONCILER, BILLING, NOTIFY, LOGGING, TRACING),
    )
    parser.add_argument(
        "--leave-instances-running",
        action="store_true",
        help="on exit, leave the instances' PostgreSQL servers running (adopted on the next start)",
    )
    parser.set_defaults(handler=_handler("cmd_up"))


def _handler(name: str) -> LazyHandler:
    return LazyHandler(f"controlplane.cli.server_commands:{name}")
