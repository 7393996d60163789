"""Statements on the consumers of the instance event log (`event_consumers`): locks, positions, lag."""

# A consumer's lock (one runner at a time per consumer, across replicas), held for one pass.
TRY_CONSUMER_LOCK = "SELECT pg_try_advisory_lock(hashtextextended('cp_consumer:' || %(name)s, 0)) AS locked"
RELEASE_CONSUMER_LOCK = "SELECT pg_advisory_unlock(hashtextextended('cp_consumer:' || %(name)s, 0))"
ENSURE_CONSUMER = "INSERT INTO event_consumers (name) VALUES (%(name)s) ON CONFLICT (name) DO NOTHING"
CONSUMER_POSITION = (
    "SELECT name, last_xid::text::bigint AS last_xid, last_id FROM event_consumers WHERE name = %(name)s"
)
# The next events after a position, in (xid, id) order, only from transactions older than the
# oldest one still running: every such transaction has ended, so no event can still appear below
# the new position. (Reading by `id > last` would skip an event whose transaction took its id
# first and committed last.) Served by ix_instance_events_xid_id.
CONSUMER_EVENTS = """
SELECT e.id, e.xid::text::bigint AS xid, e.instance_id, i.org_id, e.from_state, e.to_state, e.event,
       e.actor_kind, e.actor_id, e.reason, e.detail, e.at, e.seq, e.state_version
FROM instance_events e JOIN instances i ON i.id = e.instance_id
WHERE (e.xid, e.id) > (%(last_xid)s::text::xid8, %(last_id)s)
  AND e.xid < pg_snapshot_xmin(pg_current_snapshot())
ORDER BY e.xid, e.id
LIMIT %(limit)s
"""
ADVANCE_CONSUMER = """
UPDATE event_consumers
SET last_xid = %(last_xid)s::text::xid8, last_id = %(last_id)s, processed = processed + %(count)s,
    last_event_at = %(last_event_at)s, updated_at = now()
WHERE name = %(name)s
"""
# How far behind a consumer is: events after its position (visible now, whether or not they are
# below the horizon yet) and the age of the oldest.
CONSUMER_LAG = """
SELECT count(*) AS events, extract(epoch FROM now() - min(e.at))::float8 AS seconds
FROM instance_events e, event_consumers c
WHERE c.name = %(name)s AND (e.xid, e.id) > (c.last_xid, c.last_id)
"""
CONSUMERS = """
SELECT name, last_xid::text AS last_xid, last_id, processed, last_event_at, updated_at
FROM event_consumers ORDER BY name
"""
