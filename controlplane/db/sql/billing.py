"""Statements on billing: Stripe events, an organisation's hold, the billing policy, usage, meter events."""

from controlplane.core.lifecycle import INSTANCE
from controlplane.db.sql.template import state_list

# ---- billing (Stripe events) ------------------------------------------------------------------

# Store a verified event by id; a duplicate returns nothing (and is a no-op).
RECORD_STRIPE_EVENT = """
INSERT INTO stripe_events (id, type, customer_id, created, status, outcome)
VALUES (%(id)s, %(type)s, %(customer)s, %(created)s, %(status)s, 'received')
ON CONFLICT (id) DO NOTHING RETURNING id
"""
# The newest decisive (hold or release) event recorded for a customer no organisation was linked to then.
NEWEST_UNMAPPED_STRIPE_EVENT = """
SELECT id, status, created FROM stripe_events
WHERE customer_id = %(customer)s AND outcome = 'unknown_customer' AND status = ANY(%(decisive)s)
ORDER BY created DESC, received_at DESC LIMIT 1
"""
SET_STRIPE_EVENT_OUTCOME = "UPDATE stripe_events SET outcome = %(outcome)s WHERE id = %(id)s"

# The organisation of a Stripe customer, locked while its hold is decided (FOR NO KEY UPDATE: the
# instances and keys being created for it meanwhile need only their foreign-key share lock).
LOCK_ORGANISATION_OF_CUSTOMER = """
SELECT id, billing_event_created FROM organisations WHERE stripe_customer_id = %(customer)s
FOR NO KEY UPDATE
"""
SET_BILLING_HOLD = """
UPDATE organisations SET billing_hold = %(hold)s, billing_status = %(status)s,
    billing_event_created = %(created)s
WHERE id = %(id)s
"""

# An organisation's instances in some states (a hold suspends those that can be suspended).
ORG_INSTANCES_IN = "SELECT id FROM instances WHERE org_id = %(org)s AND state = ANY(%(states)s::text[])"
# Those the billing hold suspended (a release resumes them, and only them).
ORG_INSTANCES_SUSPENDED_BY_BILLING = ORG_INSTANCES_IN + " AND suspended_by_billing"

# ---- usage: the instance events that a window's usage is computed from ------------------------------

_USAGE_EVENTS = f"""
SELECT e.instance_id, i.org_id, e.seq, e.to_state, e.at, e.detail
FROM instances i JOIN instance_events e ON e.instance_id = i.id
{{join}}
WHERE i.created_at < %(end)s AND e.at < %(end)s
  AND NOT (i.state IN {state_list(tuple(sorted(INSTANCE.terminal)))} AND i.state_entered_at <= %(start)s)
  {{where}}
ORDER BY e.instance_id, e.seq
"""
# One organisation's instances that lived in [start, end), with their events up to the end.
USAGE_EVENTS_OF_ORG = _USAGE_EVENTS.format(join="", where="AND i.org_id = %(org)s")
# The same for every organisation with a Stripe customer (what a report sends).
USAGE_EVENTS_BILLED = _USAGE_EVENTS.format(
    join="JOIN organisations o ON o.id = i.org_id AND o.stripe_customer_id IS NOT NULL", where=""
)
STRIPE_CUSTOMERS = "SELECT id, stripe_customer_id FROM organisations WHERE stripe_customer_id IS NOT NULL"
LAST_USAGE_REPORT = "SELECT max(period_start) AS period_start FROM usage_reports"
# A period's report, enqueued once (a second reconciler pass finds it and does nothing).
RECORD_USAGE_REPORT = """
INSERT INTO usage_reports (period_start, period_end) VALUES (%(start)s, %(end)s)
ON CONFLICT (period_start) DO NOTHING RETURNING period_start
"""
SET_USAGE_REPORT_JOB = "UPDATE usage_reports SET job_id = %(job)s WHERE period_start = %(start)s"
FINISH_USAGE_REPORT = """
UPDATE usage_reports SET reported_at = now(), meter_events = %(count)s WHERE period_start = %(start)s
"""
METER_EVENTS_SENT_IN = "SELECT identifier FROM meter_events_sent WHERE period_start = %(start)s"
RECORD_METER_EVENT = """
INSERT INTO meter_events_sent
    (identifier, period_start, org_id, instance_id, plan, billing, event_name, value)
VALUES (%(identifier)s, %(start)s, %(org)s, %(instance)s, %(plan)s, %(billing)s, %(event_name)s, %(value)s)
ON CONFLICT (identifier) DO NOTHING
"""
METER_EVENTS_SENT = """
SELECT identifier, period_start, org_id, instance_id, plan, billing, event_name, value
FROM meter_events_sent ORDER BY period_start, identifier
"""
USAGE_REPORTS = "SELECT * FROM usage_reports ORDER BY period_start"

# ---- billing policy: the grace period after past_due, deletion after a long suspension -------------

MARK_PAST_DUE = """
UPDATE organisations o SET past_due_since = COALESCE(o.past_due_since, to_timestamp(%(created)s)),
    billing_status = %(status)s
FROM organisations before
WHERE o.id = %(id)s AND before.id = o.id
RETURNING o.past_due_since, before.past_due_since IS NULL AS started
"""
CLEAR_PAST_DUE = "UPDATE organisations SET past_due_since = NULL WHERE id = %(id)s"
# Organisations past due for longer than the grace period and not on hold yet.
GRACE_OVER = """
SELECT id FROM organisations
WHERE past_due_since IS NOT NULL AND NOT billing_hold
  AND past_due_since + make_interval(secs => %(grace_s)s::float8) <= %(now)s
ORDER BY past_due_since
FOR UPDATE SKIP LOCKED
"""
HOLD_AFTER_GRACE = "UPDATE organisations SET billing_hold = true WHERE id = %(id)s"
# The gauges: organisations on hold, and past due but still within their grace period.
COUNT_BILLING_HOLDS = """
SELECT count(*) FILTER (WHERE billing_hold) AS held,
       count(*) FILTER (WHERE past_due_since IS NOT NULL AND NOT billing_hold) AS grace
FROM organisations WHERE billing_hold OR past_due_since IS NOT NULL
"""
# Instances suspended by billing for longer than the deletion delay, not being deleted yet.
LONG_SUSPENDED = """
SELECT id, org_id, state_entered_at FROM instances
WHERE state = 'suspended' AND suspended_by_billing AND deletion_requested_at IS NULL
  AND NOT deletion_protection
  AND state_entered_at + make_interval(secs => %(after_s)s::float8) <= %(now)s
ORDER BY state_entered_at
LIMIT 100
"""
ORGANISATION_BILLING = """
SELECT id, billing_hold, billing_status, past_due_since FROM organisations WHERE id = %(id)s
"""
