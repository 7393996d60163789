"""Meta: the schema's revision (readiness), whether the session can write, leader and shard locks."""

from controlplane.db.sql.template import SHARD_OF

SCHEMA_REVISION = "SELECT version_num FROM alembic_version"
# Whether this session can write (a standby, or default_transaction_read_only, says off).
SESSION_WRITABLE = "SELECT current_setting('transaction_read_only') = 'off' AS writable"

PING = "SELECT 1"
TRY_LEADER_LOCK = "SELECT pg_try_advisory_lock(%(key)s) AS locked"
RELEASE_LEADER_LOCK = "SELECT pg_advisory_unlock(%(key)s)"

# Reconciler shards: an instance's shard is a hash of its id; each shard is a session advisory lock
# (class, shard) held by one reconciler process, and each process holds a membership lock
# (class, its backend pid) so that the others can count the processes sharing the shards.
JOIN_SHARDS = "SELECT pg_advisory_lock(%(members)s, pg_backend_pid()), pg_backend_pid() AS pid"
SHARD_MEMBERS = """
SELECT count(*) AS members FROM pg_locks
WHERE locktype = 'advisory' AND classid = %(members)s::oid AND objsubid = 2 AND granted
"""
TRY_SHARD = "SELECT pg_try_advisory_lock(%(shards)s, %(shard)s) AS locked"
RELEASE_SHARD = "SELECT pg_advisory_unlock(%(shards)s, %(shard)s)"
# Inside the transaction that acts on an instance: its shard's lock is still held by `pid`.
HOLDS_SHARD_OF = f"""
SELECT EXISTS (
    SELECT 1 FROM pg_locks
    WHERE locktype = 'advisory' AND classid = %(shards)s::oid AND objsubid = 2 AND granted
      AND pid = %(pid)s AND objid = {SHARD_OF.format(id="%(id)s")}::oid
) AS held
"""
