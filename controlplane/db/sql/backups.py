"""Statements on `backups`: what the control plane holds of each instance."""

# Backups: what the provisioner holds after a backup job, recorded (a new one, or one seen again).
RECORD_BACKUPS = """
INSERT INTO backups (instance_id, backup_id, kind, taken_at, size_bytes, location)
SELECT %(instance_id)s::uuid, b.backup_id, b.kind, b.taken_at, b.size_bytes, b.location
FROM unnest(%(ids)s::text[], %(kinds)s::text[], %(taken)s::timestamptz[], %(sizes)s::bigint[],
            %(locations)s::text[]) AS b(backup_id, kind, taken_at, size_bytes, location)
ON CONFLICT (instance_id, backup_id)
DO UPDATE SET removed_at = NULL, size_bytes = EXCLUDED.size_bytes, location = EXCLUDED.location
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
