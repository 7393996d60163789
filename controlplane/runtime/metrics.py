"""Prometheus metrics of the control plane, registered once in the default registry."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics


def configure_process() -> None:
    """What a serving process sets once, where it starts: no `_created` series (one more series per
    counter and histogram child that dashboards and alerts never read)."""
    disable_created_metrics()  # type: ignore[no-untyped-call]


# The API's requests, named and labelled as OpenTelemetry's HTTP server conventions name them in
# Prometheus (http.server.request.duration): the route as its template (`/v1/instances/{instance_id}`;
# `unmatched` for a path no route serves), the method, and the status class (`2xx` ... `5xx`). The
# request count is the histogram's `_count`. Buckets: OpenTelemetry's advice for this instrument.
HTTP_REQUEST_DURATION = Histogram(
    "http_server_request_duration_seconds",
    "Duration of the API's HTTP requests, until the last byte of the answer, by method, route template"
    " and status class.",
    ["method", "route", "status_class"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10),
)

TRANSITIONS = Counter(
    "controlplane_transitions_total",
    "State transitions applied, by entity, from, to and event.",
    ["entity", "from_state", "to_state", "event"],
)
ALERTING_TRANSITIONS = Counter(
    "controlplane_instance_alerting_transitions_total",
    "Instance moves the lifecycle marks as alerting (into failed or degraded), by target, event and"
    " failure code.",
    ["to_state", "event", "code"],
)
ILLEGAL_TRANSITIONS = Counter(
    "controlplane_illegal_transitions_total",
    "Transitions refused because the lifecycle table does not allow them.",
    ["entity", "state", "event"],
)
CONFLICTS = Counter(
    "controlplane_transition_conflicts_total",
    "Transitions that lost an optimistic-lock race.",
    ["entity", "event"],
)
INVARIANT_VIOLATIONS = Counter(
    "controlplane_invariant_violations_total",
    "Rows found in a state the transition path never wrote (same version, other state).",
    ["entity"],
)
ENTITIES_BY_STATE = Gauge(
    "controlplane_entities",
    "Instances and jobs by state, as of the last reconciler pass.",
    ["entity", "state"],
)
OVER_DEADLINE = Gauge(
    "controlplane_instances_over_deadline",
    "Instances past their state deadline, as of the last reconciler pass.",
)
TIME_IN_STATE = Histogram(
    "controlplane_time_in_state_seconds",
    "Time an entity spent in a state before leaving it.",
    ["entity", "state"],
    buckets=(0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
)
PROVISIONING_DURATION = Histogram(
    "controlplane_provisioning_duration_seconds",
    "Time from instance creation to ready.",
    buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600),
)
RECONCILE_PASS_DURATION = Histogram(
    "controlplane_reconciler_pass_seconds",
    "Duration of one reconciler pass.",
    buckets=(0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
RECONCILE_LAST_SUCCESS = Gauge(
    "controlplane_reconciler_last_success_timestamp_seconds",
    "Unix time of the last reconciler pass that completed.",
)
RECONCILER_LEADER = Gauge(
    "controlplane_reconciler_leader",
    "1 while this reconciler holds the leader lock (its gauges are current), else 0.",
)
RECONCILE_ACTIONS = Counter(
    "controlplane_reconciler_actions_total",
    "Corrective actions taken by the reconciler, by kind.",
    ["action"],
)
DATA_LOSS = Counter(
    "controlplane_data_loss_total",
    "Instances found to have lost their data (their storage gone), recorded by the reconciler.",
)
ARCHIVE_FAILING = Gauge(
    "controlplane_archive_failing_instances",
    "Instances whose continuous WAL archive failed at its last observation (set by each reconciler "
    "for the instances it observed).",
)
ARCHIVE_LAG_SECONDS = Gauge(
    "controlplane_archive_lag_seconds_max",
    "The largest archive lag among the instances a reconciler observed in its last pass: how far the "
    "latest restorable moment trails the observation.",
)
BACKUP_VERIFICATIONS = Counter(
    "controlplane_backup_verifications_total",
    "Checks of an instance's backups and archive by the reconciler's maintenance, by outcome "
    "(sound, broken).",
    ["outcome"],
)
ORPHANS_REMOVED = Counter(
    "controlplane_orphans_removed_total",
    "Provisioner resources removed because no live instance owns them.",
)
WEBHOOKS = Counter(
    "controlplane_webhooks_total",
    "Stripe webhook deliveries, by outcome.",
    ["outcome"],
)
JOBS_FINISHED = Counter(
    "controlplane_jobs_finished_total",
    "Jobs finished by a worker, by kind and outcome.",
    ["kind", "outcome"],
)
LOST_RACES = Counter(
    "controlplane_lost_races_total",
    "Transactions that lost to a deadlock or a serialization failure: run again, or given up "
    "after the last attempt.",
    ["outcome"],
)
DATABASE_REFUSALS = Counter(
    "controlplane_api_database_refusals_total",
    "API requests answered with a problem because of the database, by reason: lock_timeout (409), "
    "lost_race (409), statement_timeout, read_only and unavailable (503).",
    ["reason"],
)
AUDIT_CHECKPOINT_AT = Gauge(
    "controlplane_audit_last_checkpoint_timestamp_seconds",
    "Unix time of the newest signed checkpoint of the audit log this process made or saw.",
)
AUDIT_PARTITIONS_UNTIL = Gauge(
    "controlplane_audit_partitions_until_timestamp_seconds",
    "Unix time up to which the event tables have partitions, as last made sure by the reconciler.",
)
CONSUMER_EVENTS = Counter(
    "controlplane_consumer_events_total",
    "Instance events applied by a consumer of the event log (replays after a crash count again).",
    ["consumer"],
)
CONSUMER_LAG_EVENTS = Gauge(
    "controlplane_consumer_lag_events",
    "Instance events written after a consumer's position, as of its last pass.",
    ["consumer"],
)
CONSUMER_LAG_SECONDS = Gauge(
    "controlplane_consumer_lag_seconds",
    "Age of the oldest instance event a consumer has not applied yet (0: caught up), as of its last pass.",
    ["consumer"],
)
USAGE_REPORTS = Counter(
    "controlplane_usage_reports_total",
    "Usage periods reported to Stripe as meter events, by outcome.",
    ["outcome"],
)
NOTIFICATION_DELIVERIES = Counter(
    "controlplane_notification_deliveries_total",
    "Notification delivery attempts, by channel (webhook, email) and outcome.",
    ["channel", "outcome"],
)
QUEUE_DEPTH = Gauge(
    "controlplane_queue_depth",
    "Queued jobs by kind (due or not yet due), as of the last reconciler pass.",
    ["kind"],
)
QUEUE_OLDEST_AGE = Gauge(
    "controlplane_queue_oldest_age_seconds",
    "How long the oldest due queued job of a kind has waited for a worker (since its run_at; 0: none"
    " waits), as of the last reconciler pass.",
    ["kind"],
)
WORKER_SLOTS = Gauge(
    "controlplane_worker_slots",
    "Slots of this worker, by lane: `shared` (the instance operations and the other kinds), or a kind"
    " with slots of its own (deliveries). Exported by worker processes only.",
    ["lane"],
)
WORKER_SLOTS_IN_USE = Gauge(
    "controlplane_worker_slots_in_use",
    "Slots of this worker running a handler now, by lane.",
    ["lane"],
)
BILLING_ORGANISATIONS = Gauge(
    "controlplane_billing_organisations",
    "Organisations on billing hold (`held`) and past due within their grace period (`grace`), as of"
    " the last reconciler pass.",
    ["state"],
)
