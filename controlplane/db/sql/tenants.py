"""Statements on the tenants: organisations, API keys, console sessions and idempotency keys."""

# ---- organisations and API keys ---------------------------------------------------------------------

CREATE_ORGANISATION = """
INSERT INTO organisations (name, stripe_customer_id) VALUES (%(name)s, %(stripe_customer_id)s) RETURNING *
"""
ORGANISATION_BY_ID = "SELECT * FROM organisations WHERE id = %(id)s"
# The organisation, locked while its Stripe customer is linked (a unique key column: FOR UPDATE).
LOCK_ORGANISATION_FOR_LINK = "SELECT * FROM organisations WHERE id = %(id)s FOR UPDATE"
LINK_STRIPE_CUSTOMER = """
UPDATE organisations SET stripe_customer_id = %(customer)s WHERE id = %(id)s AND stripe_customer_id IS NULL
"""

CREATE_API_KEY = """
INSERT INTO api_keys (org_id, is_admin, prefix, key_hash, name)
VALUES (%(org_id)s, %(is_admin)s, %(prefix)s, %(key_hash)s, %(name)s) RETURNING id
"""
# Serialises the first start's admin key across replicas (a transaction-scoped advisory lock).
LOCK_ADMIN_KEY_CREATION = "SELECT pg_advisory_xact_lock(%(key)s)"
ANY_LIVE_ADMIN_KEY = "SELECT 1 FROM api_keys WHERE is_admin AND revoked_at IS NULL LIMIT 1"
LIVE_KEY_BY_PREFIX = """
SELECT id, org_id, is_admin, key_hash FROM api_keys WHERE prefix = %(prefix)s AND revoked_at IS NULL
"""
# Revoke a live key of an organisation (any organisation's when org is NULL: an admin).
REVOKE_API_KEY = """
UPDATE api_keys SET revoked_at = now()
WHERE id = %(id)s AND revoked_at IS NULL AND (%(org)s::uuid IS NULL OR org_id = %(org)s::uuid)
RETURNING id
"""
# The organisations, oldest first, or the one of a name.
LIST_ORGANISATIONS = """
SELECT id, name, stripe_customer_id, billing_hold, billing_status, created_at FROM organisations
WHERE %(name)s::text IS NULL OR name = %(name)s::text ORDER BY created_at, id LIMIT %(limit)s
"""

# A page of an organisation's keys (revoked ones too), oldest first, after a (created_at, id) cursor.
LIST_API_KEYS = """
SELECT id, prefix, name, created_at, revoked_at FROM api_keys
WHERE org_id = %(org)s
  AND (%(after_created)s::timestamptz IS NULL
       OR (created_at, id) > (%(after_created)s::timestamptz, %(after_id)s::uuid))
ORDER BY created_at, id LIMIT %(limit)s
"""
# The organisation, locked while a key is added (two creations count its live keys one at a time).
LOCK_ORGANISATION = "SELECT id FROM organisations WHERE id = %(id)s FOR NO KEY UPDATE"
COUNT_LIVE_KEYS = "SELECT count(*) AS n FROM api_keys WHERE org_id = %(org)s AND revoked_at IS NULL"

# ---- console sessions (an organisation key signed in to the console) -----------------------------

START_CONSOLE_SESSION = """
INSERT INTO console_sessions (key_id, org_id, expires_at)
VALUES (%(key_id)s, %(org_id)s, now() + make_interval(secs => %(ttl_s)s))
RETURNING id, key_id, org_id, expires_at
"""
# A session that is live at `now` (default the database's time): not ended, not expired, its key live.
LIVE_CONSOLE_SESSION = """
SELECT s.id, s.key_id, s.org_id, s.expires_at
FROM console_sessions s JOIN api_keys k ON k.id = s.key_id
WHERE s.id = %(id)s AND s.ended_at IS NULL AND k.revoked_at IS NULL
  AND s.expires_at > COALESCE(%(now)s::timestamptz, now())
"""
END_CONSOLE_SESSION = "UPDATE console_sessions SET ended_at = now() WHERE id = %(id)s AND ended_at IS NULL"
# Sessions expired a day ago (ended ones too, once expired): nothing reads them any more.
PURGE_CONSOLE_SESSIONS = "DELETE FROM console_sessions WHERE expires_at < now() - interval '1 day'"

# ---- idempotency keys (the API's creating requests) ----------------------------------------------

# Claim an (organisation, key) pair for this transaction; false while another request holds it.
TRY_IDEMPOTENCY_LOCK = "SELECT pg_try_advisory_xact_lock(hashtextextended(%(lock)s, 0)) AS locked"
# The response stored for a key within its retention.
STORED_RESPONSE = """
SELECT request_hash, status_code, response, headers FROM idempotency_keys
WHERE org_id = %(org)s AND key = %(key)s AND created_at >= now() - make_interval(secs => %(retention_s)s)
"""
SAVE_RESPONSE = """
INSERT INTO idempotency_keys (org_id, key, request_hash, status_code, response, headers)
VALUES (%(org)s, %(key)s, %(hash)s, %(status)s, %(response)s, %(headers)s)
ON CONFLICT (org_id, key) DO UPDATE SET request_hash = EXCLUDED.request_hash,
    status_code = EXCLUDED.status_code, response = EXCLUDED.response,
    headers = EXCLUDED.headers, created_at = now()
"""
# Delete a bounded batch of expired keys (skipping rows another purge holds).
PURGE_IDEMPOTENCY_KEYS = """
DELETE FROM idempotency_keys WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM idempotency_keys WHERE created_at < now() - make_interval(secs => %(retention_s)s)
    LIMIT %(limit)s FOR UPDATE SKIP LOCKED))
"""
