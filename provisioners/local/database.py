"""Databases: the control plane's admin role on each server, and the customer's owner role and database.

The admin's sessions and the client tools it runs (pg_dump, pg_basebackup) go over TLS, the
server's certificate verified against the control plane's CA.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from typing import Any

import psycopg
from psycopg import sql

from controlplane.runtime.postgres import PostgresServer
from provisioners.local.storage import Storage
from provisioners.local.tls import SSLMODE, InstanceTls

ADMIN_USER = "cp_admin"
DBNAME = "app"


def owner_role(instance_id: uuid.UUID) -> str:
    """The generated login role that owns the instance's database."""
    return f"app_{instance_id.hex[:12]}"


class Admin:
    """The control plane's superuser on each server, reached at `host` over TLS (the server's
    certificate verified against the CA), its password sealed in the instance's state."""

    def __init__(self, storage: Storage, tls: InstanceTls, host: str) -> None:
        self.storage = storage
        self.tls = tls
        self.host = host

    def connect(
        self, instance_id: uuid.UUID, port: int, *, timeout: int = 10, dbname: str = "postgres"
    ) -> psycopg.Connection[Any]:
        state = self.storage.load_state(instance_id)
        self.tls.authority()
        return psycopg.connect(
            host=self.host,
            port=port,
            user=ADMIN_USER,
            password=self.storage.unseal(state["admin_password"]),
            dbname=dbname,
            connect_timeout=timeout,
            autocommit=True,
            sslmode=SSLMODE,
            sslrootcert=str(self.tls.store.cert_path),
        )

    def client_tool(
        self, instance_id: uuid.UUID, server: PostgresServer, tool: str, args: list[str]
    ) -> subprocess.CompletedProcess[str]:
        """Run a client tool (pg_dump, pg_basebackup) against the server as the admin, over TLS."""
        self.tls.authority()
        env = dict(
            os.environ,
            PGPASSWORD=self.storage.unseal(self.storage.load_state(instance_id)["admin_password"]),
            PGSSLMODE=SSLMODE,
            PGSSLROOTCERT=str(self.tls.store.cert_path),
            LC_ALL="C",
        )
        connection = [f"--host={self.host}", f"--port={server.port}", f"--username={ADMIN_USER}"]
        return subprocess.run(
            [server.bin(tool), *connection, "--no-password", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=3600,
            check=False,
            stdin=subprocess.DEVNULL,
        )

    def in_recovery(self, instance_id: uuid.UUID, port: int) -> bool:
        with self.connect(instance_id, port) as admin:
            row = admin.execute("SELECT pg_is_in_recovery()").fetchone()
        return bool(row and row[0])


def show(conn: psycopg.Connection[Any], name: str) -> str:
    row = conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()
    return "" if row is None else str(row[0])


def ensure_owner(admin: psycopg.Connection[Any], role: str, password: str) -> None:
    """The owner role (never superuser) with `password`, and the database it owns."""
    ident = sql.Identifier(role)
    attributes = sql.SQL("LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS")
    exists = admin.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
    verb = sql.SQL("ALTER ROLE") if exists else sql.SQL("CREATE ROLE")
    admin.execute(sql.SQL("{} {} {}").format(verb, ident, attributes))
    # The SCRAM verifier is computed here: the password itself never reaches the server or its logs.
    verifier = admin.pgconn.encrypt_password(password.encode(), role.encode(), b"scram-sha-256")
    admin.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(ident, sql.Literal(verifier.decode())))
    if not admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DBNAME,)).fetchone():
        admin.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(DBNAME), ident))
    admin.execute(sql.SQL("REVOKE CONNECT ON DATABASE {} FROM PUBLIC").format(sql.Identifier(DBNAME)))
    admin.execute(sql.SQL("REVOKE CONNECT ON DATABASE postgres FROM PUBLIC"))
    admin.execute(sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(sql.Identifier(DBNAME), ident))


def former_owners(admin: psycopg.Connection[Any], role: str) -> list[str]:
    """Owner roles of other instances in this cluster: it was restored from another instance's
    backup (their objects become `role`'s, then they go)."""
    rows = admin.execute(
        "SELECT rolname FROM pg_roles WHERE rolname LIKE 'app\\_%%' AND rolname <> %s ORDER BY 1", (role,)
    ).fetchall()
    return [str(row[0]) for row in rows]


def take_over(conn: psycopg.Connection[Any], former: str, role: str) -> None:
    """In the database `conn` is on: what `former` owns becomes `role`'s, its grants go."""
    conn.execute(sql.SQL("REASSIGN OWNED BY {} TO {}").format(sql.Identifier(former), sql.Identifier(role)))
    conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(former)))
