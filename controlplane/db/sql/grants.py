"""Least privilege: the statements with which `migrate` grants the runtime role (db.grant_runtime)."""

# Whether the role can be trusted with the runtime's rights: not a superuser, not the owner.
ROLE_ATTRIBUTES = """
SELECT r.rolsuper, pg_has_role(r.oid, current_user, 'MEMBER') AS member, r.rolname = current_user AS same
FROM pg_roles r WHERE r.rolname = %(role)s
"""
PUBLIC_TABLES = """
SELECT c.relname, c.relispartition FROM pg_class c
WHERE c.relnamespace = 'public'::regnamespace AND c.relkind IN ('r', 'p') ORDER BY c.relname
"""
GRANT_SCHEMA_USAGE = "GRANT USAGE ON SCHEMA public TO {role}"
REVOKE_TABLE = "REVOKE ALL ON {table} FROM {role}"
GRANT_TABLE = "GRANT {privileges} ON {table} TO {role}"
APPEND_ONLY_PRIVILEGES = "SELECT, INSERT"
READ_ONLY_PRIVILEGES = "SELECT"
READ_WRITE_PRIVILEGES = "SELECT, INSERT, UPDATE, DELETE"
GRANT_SEQUENCES = "GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO {role}"
REVOKE_FUNCTION_FROM_PUBLIC = "REVOKE EXECUTE ON FUNCTION {function} FROM PUBLIC"
GRANT_FUNCTION = "GRANT EXECUTE ON FUNCTION {function} TO {role}"
