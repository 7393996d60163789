"""Statements on notifications: the channels the transitions notify, who listens; targets and deliveries."""

from controlplane.core.lifecycle import INSTANCE

# ---- notifications: the channels the transition path notifies, and who listens -------------------

# `cp_<entity>_<state>` carries '<id>:<state_version>' of each move into that state (see _audit_tail).
INSTANCE_CHANNEL_PREFIX = "cp_instance_"
JOB_QUEUED_CHANNEL = "cp_job_queued"
# A worker wakes on every enqueued or re-queued job.
LISTEN_JOB_QUEUED = f"LISTEN {JOB_QUEUED_CHANNEL}"
# A watch follows every state an instance can reach.
INSTANCE_CHANNELS = tuple(INSTANCE_CHANNEL_PREFIX + state for state in INSTANCE.states)
LISTEN_INSTANCE_CHANNELS = "; ".join(f"LISTEN {channel}" for channel in INSTANCE_CHANNELS)

# ---- notifications: targets (webhook endpoints, email addresses) and deliveries --------------------

_TARGET_COLUMNS = (
    "id, org_id, kind, address, event_types, description, created_at, disabled_at, disabled_reason"
)
CREATE_NOTIFICATION_TARGET = f"""
INSERT INTO notification_targets (org_id, kind, address, event_types, description, secret)
VALUES (%(org)s, %(kind)s, %(address)s, %(event_types)s, %(description)s, %(secret)s)
RETURNING {_TARGET_COLUMNS}
"""
# One page of an organisation's live targets of a kind, oldest first, after a cursor.
NOTIFICATION_TARGETS_PAGE = f"""
SELECT {_TARGET_COLUMNS} FROM notification_targets
WHERE org_id = %(org)s AND kind = %(kind)s AND deleted_at IS NULL
  AND (%(after_created)s::timestamptz IS NULL OR (created_at, id) > (%(after_created)s, %(after_id)s))
ORDER BY created_at, id
LIMIT %(limit)s
"""
NOTIFICATION_TARGET = f"""
SELECT {_TARGET_COLUMNS} FROM notification_targets
WHERE id = %(id)s AND org_id = %(org)s AND kind = %(kind)s AND deleted_at IS NULL
"""
DELETE_NOTIFICATION_TARGET = """
UPDATE notification_targets SET deleted_at = now()
WHERE id = %(id)s AND org_id = %(org)s AND kind = %(kind)s AND deleted_at IS NULL
RETURNING id
"""
# The targets an event goes to: the organisation's, live, enabled, subscribed to its type.
TARGETS_FOR_EVENT = """
SELECT id, kind FROM notification_targets
WHERE org_id = %(org)s AND deleted_at IS NULL AND disabled_at IS NULL
  AND (%(type)s = ANY(event_types) OR '*' = ANY(event_types))
ORDER BY created_at, id
"""
# One delivery per target and event: a replayed event finds it and creates nothing.
CREATE_DELIVERY = """
INSERT INTO notification_deliveries (target_id, org_id, instance_id, event_id, event_type, body)
VALUES (%(target)s, %(org)s, %(instance)s, %(event_id)s, %(type)s, %(body)s)
ON CONFLICT (target_id, event_id) DO NOTHING
RETURNING id
"""
DELIVERY_TO_SEND = """
SELECT d.*, t.kind, t.address, t.secret, t.disabled_at, t.deleted_at
FROM notification_deliveries d JOIN notification_targets t ON t.id = d.target_id
WHERE d.id = %(id)s
"""
DELIVERY_ATTEMPTED = """
UPDATE notification_deliveries
SET attempts = attempts + 1, last_attempt_at = now(), last_status = %(status)s, last_error = %(error)s,
    state = %(state)s, delivered_at = CASE WHEN %(state)s = 'delivered' THEN now() END
WHERE id = %(id)s
RETURNING attempts, extract(epoch FROM now() - created_at)::float8 AS age_s
"""
DISABLE_TARGET = """
UPDATE notification_targets SET disabled_at = now(), disabled_reason = %(reason)s
WHERE id = %(id)s AND disabled_at IS NULL
"""
DELIVERIES_PAGE = """
SELECT id, event_id, event_type, instance_id, state, attempts, last_status, last_error, created_at,
       last_attempt_at, delivered_at
FROM notification_deliveries
WHERE target_id = %(target)s AND org_id = %(org)s
  AND (%(after_created)s::timestamptz IS NULL OR (created_at, id) < (%(after_created)s, %(after_id)s))
ORDER BY created_at DESC, id DESC
LIMIT %(limit)s
"""
INSTANCE_FOR_NOTICE = """
SELECT id, name, state, spec->>'plan' AS plan, failure_code FROM instances WHERE id = %(id)s
"""
GIVE_UP_DELIVERY = "UPDATE notification_deliveries SET state = 'failed' WHERE id = %(id)s"
