"""Statements on `backups` and `recovery_windows`: what the control plane holds of each instance,
and the moments it can be restored to."""

# Backups: what the provisioner holds after a backup job, recorded (a new one, or one seen again).
RECORD_BACKUPS = """
INSERT INTO backups (instance_id, backup_id, kind, taken_at, size_bytes, location, type)
SELECT %(instance_id)s::uuid, b.backup_id, b.kind, b.taken_at, b.size_bytes, b.location, b.type
FROM unnest(%(ids)s::text[], %(kinds)s::text[], %(taken)s::timestamptz[], %(sizes)s::bigint[],
            %(locations)s::text[], %(types)s::text[])
     AS b(backup_id, kind, taken_at, size_bytes, location, type)
ON CONFLICT (instance_id, backup_id)
DO UPDATE SET removed_at = NULL, size_bytes = EXCLUDED.size_bytes, location = EXCLUDED.location,
              type = EXCLUDED.type
"""

# Backups: those the provisioner no longer holds (retention removed them) are no longer held.
FORGET_BACKUPS = """
UPDATE backups SET removed_at = now()
WHERE instance_id = %(instance_id)s AND removed_at IS NULL AND NOT (backup_id = ANY(%(ids)s::text[]))
"""

# Backups held of one instance, newest first, after a cursor (ix_backups_held serves it).
HELD_BACKUPS = """
SELECT * FROM backups
WHERE instance_id = %(instance_id)s AND removed_at IS NULL
  AND (%(before_taken)s::timestamptz IS NULL
       OR (taken_at, backup_id) < (%(before_taken)s::timestamptz, %(before_id)s::text))
ORDER BY taken_at DESC, backup_id DESC
LIMIT %(limit)s
"""

# One held backup by its id.
HELD_BACKUP = """
SELECT * FROM backups WHERE instance_id = %(instance_id)s AND backup_id = %(backup_id)s AND removed_at IS NULL
"""

# Recovery windows: what the provisioner reported of some instances, recorded (one row each). An
# archive failing since an earlier report keeps the time it started failing.
RECORD_RECOVERY_WINDOWS = """
INSERT INTO recovery_windows AS w
    (instance_id, earliest_at, latest_at, archive_healthy, archive_detail, archive_failing_since,
     lag_s, lag_bytes, last_archived_at, observed_at, retained_until, recorded_at)
SELECT v.instance_id, v.earliest_at, v.latest_at, v.archive_healthy, v.archive_detail,
       CASE WHEN v.archive_healthy IS FALSE THEN now() END,
       v.lag_s, v.lag_bytes, v.last_archived_at, v.observed_at, v.retained_until, now()
FROM unnest(%(ids)s::uuid[], %(earliest)s::timestamptz[], %(latest)s::timestamptz[], %(healthy)s::boolean[],
            %(details)s::text[], %(lag_s)s::float8[], %(lag_bytes)s::bigint[],
            %(archived)s::timestamptz[], %(observed)s::timestamptz[], %(retained)s::timestamptz[])
     AS v(instance_id, earliest_at, latest_at, archive_healthy, archive_detail, lag_s, lag_bytes,
          last_archived_at, observed_at, retained_until)
ON CONFLICT (instance_id) DO UPDATE SET
    earliest_at = EXCLUDED.earliest_at,
    latest_at = EXCLUDED.latest_at,
    archive_healthy = EXCLUDED.archive_healthy,
    archive_detail = EXCLUDED.archive_detail,
    archive_failing_since = CASE WHEN EXCLUDED.archive_healthy IS FALSE
                                 THEN COALESCE(w.archive_failing_since, now()) END,
    lag_s = EXCLUDED.lag_s,
    lag_bytes = EXCLUDED.lag_bytes,
    last_archived_at = EXCLUDED.last_archived_at,
    observed_at = EXCLUDED.observed_at,
    retained_until = EXCLUDED.retained_until,
    expired_at = NULL,
    recorded_at = now()
"""

# Recovery windows: one instance's.
RECOVERY_WINDOW = """
SELECT * FROM recovery_windows WHERE instance_id = %(instance_id)s
"""

# Recovery windows: those whose backups are due a check (never checked first; ix_recovery_windows_verify).
DUE_VERIFICATIONS = """
SELECT instance_id FROM recovery_windows
WHERE expired_at IS NULL AND earliest_at IS NOT NULL
  AND (verified_at IS NULL OR verified_at < %(before)s::timestamptz)
ORDER BY verified_at NULLS FIRST
LIMIT %(limit)s
"""

# Recovery windows: the result of a check of an instance's backups and archive.
RECORD_VERIFICATION = """
UPDATE recovery_windows SET verified_at = now(), verify_problem = %(problem)s
WHERE instance_id = %(instance_id)s
"""

# Recovery windows: deleted instances whose retention ran out (ix_recovery_windows_retained).
EXPIRED_WINDOWS = """
SELECT instance_id FROM recovery_windows
WHERE retained_until IS NOT NULL AND expired_at IS NULL AND retained_until < %(now)s::timestamptz
ORDER BY retained_until
LIMIT %(limit)s
"""

# Recovery windows: a deleted instance's archive removed; nothing is restorable any more.
MARK_EXPIRED = """
UPDATE recovery_windows SET expired_at = now(), earliest_at = NULL, latest_at = NULL
WHERE instance_id = %(instance_id)s
"""
