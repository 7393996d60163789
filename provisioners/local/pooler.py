"""The pooler: one PgBouncer per HA instance, its stable endpoint, pointed at the current primary.

Customers of an HA plan connect to the pooler's port, which never changes across failovers and
switchovers: a failover re-points it (its configuration rewritten, then reloaded). The same port
is the read-only endpoint too: the database `READ_ONLY_DBNAME` (`app_readonly`) leads to the
customer's database on a standby (`Standbys.reader`: the first one streaming), which refuses every
write; it is re-pointed with the primary's, and whenever the standbys change. It speaks TLS
to clients with a certificate from the control plane's CA (as the servers do) and TLS to the
primary, checking the server's certificate. It pools by transaction (`POOL_MODE`); a session's
features that need one server connection for the whole session (LISTEN, session-level advisory
locks, prepared statements by name) are for the direct endpoint, the primary's own port.

It runs as the servers' user, from `<instance>/pooler/` (its configuration, the owner's password
file, its certificate, its log and pid file), on the port recorded as `<id>.pooler`. Its admin
console (`PAUSE`, `RESUME`, `RELOAD`) is reached by the control plane's admin role over TLS.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg

from controlplane.core.step_errors import PermanentError, TemporaryError
from controlplane.runtime.files import write_atomically
from controlplane.runtime.postgres import make_owned_dir, port_in_use
from controlplane.runtime.tls import needs_new_certificate
from provisioners.local.database import ADMIN_USER, DBNAME
from provisioners.local.network import POOLER, Network, member_key
from provisioners.local.storage import Storage
from provisioners.local.tls import SSLMODE, InstanceTls

PGBOUNCER = "pgbouncer"
# How the pooled endpoint shares server connections: one per transaction.
POOL_MODE = "transaction"
# The pooler's database name of the read-only endpoint: the customer's database on a standby.
READ_ONLY_DBNAME = f"{DBNAME}_readonly"
CERT, KEY = "pooler.crt", "pooler.key"


class Pooler:
    """Each HA instance's PgBouncer: configured, started, re-pointed, paused and resumed."""

    def __init__(self, storage: Storage, network: Network, tls: InstanceTls) -> None:
        self.storage = storage
        self.network = network
        self.tls = tls

    def directory(self, instance_id: uuid.UUID) -> Path:
        return self.storage.instance_dir(instance_id) / "pooler"

    def port(self, instance_id: uuid.UUID) -> int | None:
        return self.network.ports.port_of(member_key(instance_id, POOLER))

    def pid(self, instance_id: uuid.UUID) -> int | None:
        try:
            pid = int((self.directory(instance_id) / "pgbouncer.pid").read_text().strip())
            os.kill(pid, 0)
        except (OSError, ValueError):
            return None
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return pid
        return pid if PGBOUNCER.encode() in command else None

    def configured(self, instance_id: uuid.UUID) -> bool:
        return (self.directory(instance_id) / "pgbouncer.ini").exists()

    def is_running(self, instance_id: uuid.UUID) -> bool:
        return self.pid(instance_id) is not None

    def ensure(
        self, instance_id: uuid.UUID, primary_port: int, reader_port: int | None, users: dict[str, str]
    ) -> int:
        """The pooler configured for the primary on `primary_port`, the read-only endpoint for the
        standby on `reader_port` (None: none yet) and the logins `users` (the owner's, and the
        admin's for the console), running (a changed configuration reloaded); returns its port."""
        if shutil.which(PGBOUNCER) is None:
            raise PermanentError(
                "PgBouncer is not installed: run `python3 dev.py up` (it installs it) or "
                "`apt-get install -y pgbouncer`"
            )
        directory = self.directory(instance_id)
        make_owned_dir(directory, self.storage.run_as)
        port = self.network.ports.allocate(member_key(instance_id, POOLER))
        if not self.is_running(instance_id) and port_in_use(port, self.network.connect_host):
            port = self.network.ports.allocate(member_key(instance_id, POOLER), avoid=port)
        changed = self._certificate(directory)
        changed = self._write(directory / "userlist.txt", _userlist(users)) or changed
        changed = (
            self._write(directory / "pgbouncer.ini", self._config(directory, port, primary_port, reader_port))
            or changed
        )
        if not self.is_running(instance_id):
            self._start(instance_id, directory)
        elif changed:
            self.reload(instance_id)
        return port

    def start_configured(self, instance_id: uuid.UUID) -> bool:
        """Start a configured pooler that is not running (after a restart of the host); True if so."""
        directory = self.directory(instance_id)
        if self.is_running(instance_id) or not (directory / "pgbouncer.ini").exists():
            return False
        self._start(instance_id, directory)
        return True

    def repoint(self, instance_id: uuid.UUID, primary_port: int, reader_port: int | None) -> bool:
        """Point a configured pooler at the primary on `primary_port`, its read-only endpoint at the
        standby on `reader_port` (reloaded); True if it changed."""
        directory = self.directory(instance_id)
        port = self.port(instance_id)
        if port is None or not (directory / "pgbouncer.ini").exists():
            return False
        config = self._config(directory, port, primary_port, reader_port)
        if not self._write(directory / "pgbouncer.ini", config):
            return False
        if self.is_running(instance_id):
            self.reload(instance_id)
        return True

    def reload(self, instance_id: uuid.UUID) -> None:
        pid = self.pid(instance_id)
        if pid is not None:
            os.kill(pid, signal.SIGHUP)

    def stop(self, instance_id: uuid.UUID) -> bool:
        pid = self.pid(instance_id)
        if pid is None:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGINT)  # a safe shutdown: waits for the clients' transactions
        deadline = time.monotonic() + 10
        while self.is_running(instance_id) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.is_running(instance_id):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return True

    def console(self, instance_id: uuid.UUID, admin_password: str, command: str) -> None:
        """One command of the admin console (PAUSE, RESUME, RECONNECT...), as the admin role."""
        port = self.port(instance_id)
        if port is None:
            raise TemporaryError(f"instance {instance_id} has no pooler")
        with psycopg.connect(
            host=self.network.connect_host,
            port=port,
            user=ADMIN_USER,
            password=admin_password,
            dbname="pgbouncer",
            autocommit=True,
            sslmode=SSLMODE,
            sslrootcert=str(self.tls.store.cert_path),
            connect_timeout=5,
            prepare_threshold=None,
        ) as conn:
            conn.execute(command)

    # ---- the files ---------------------------------------------------------------------------

    def _write(self, path: Path, text: str) -> bool:
        if path.exists() and path.read_text() == text:
            return False
        write_atomically(path, text, 0o600)
        self.storage.chown(path)
        return True

    def _certificate(self, directory: Path) -> bool:
        cert_path = directory / CERT
        current = cert_path.read_bytes() if cert_path.exists() else None
        ca = self.tls.authority()
        if not needs_new_certificate(current, ca, self.tls.names):
            return False
        issued = ca.issue_server(self.tls.names, common_name=f"{directory.parent.name}-pooler")
        write_atomically(directory / KEY, issued.key_pem, 0o600)
        write_atomically(cert_path, issued.cert_pem, 0o644)
        self.storage.chown(directory / KEY)
        self.storage.chown(cert_path)
        return True

    def _config(self, directory: Path, port: int, primary_port: int, reader_port: int | None) -> str:
        host = self.network.connect_host
        values: dict[str, Any] = {
            "listen_addr": self.network.listen_host or "127.0.0.1",
            "listen_port": port,
            "unix_socket_dir": "",
            "auth_type": "scram-sha-256",
            "auth_file": directory / "userlist.txt",
            "admin_users": ADMIN_USER,
            "pool_mode": POOL_MODE,
            "max_client_conn": 200,
            "default_pool_size": 20,
            "ignore_startup_parameters": "extra_float_digits",
            "client_tls_sslmode": "require",
            "client_tls_cert_file": directory / CERT,
            "client_tls_key_file": directory / KEY,
            "server_tls_sslmode": SSLMODE,
            "server_tls_ca_file": self.tls.store.cert_path,
            "server_connect_timeout": 3,
            "server_login_retry": 1,
            "logfile": directory / "pgbouncer.log",
            "pidfile": directory / "pgbouncer.pid",
        }
        settings = "".join(f"{key} = {value}\n" for key, value in values.items())
        databases = f"{DBNAME} = host={host} port={primary_port} dbname={DBNAME}\n"
        if reader_port is not None:
            databases += f"{READ_ONLY_DBNAME} = host={host} port={reader_port} dbname={DBNAME}\n"
        return (
            "; Managed by the control plane: the instance's pooled endpoint, at its primary, and its\n"
            "; read-only endpoint, at a standby.\n"
            f"[databases]\n{databases}\n[pgbouncer]\n{settings}"
        )

    def _start(self, instance_id: uuid.UUID, directory: Path) -> None:
        (directory / "userlist.txt").chmod(0o600)
        run_as = self.storage.run_as
        result = subprocess.run(
            [PGBOUNCER, "-d", str(directory / "pgbouncer.ini")],
            cwd="/",
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            stdin=subprocess.DEVNULL,
            user=run_as.uid,
            group=run_as.gid,
            extra_groups=[] if run_as.is_switch else None,
        )
        deadline = time.monotonic() + 10
        while not self.is_running(instance_id) and time.monotonic() < deadline:
            time.sleep(0.05)
        if result.returncode != 0 or not self.is_running(instance_id):
            said = (result.stderr or result.stdout).strip()
            raise TemporaryError(f"the pooler of instance {instance_id} did not start: {said[-500:]}")


def _userlist(users: dict[str, str]) -> str:
    """PgBouncer's auth_file: each login with its password (the file is the server user's alone)."""
    return "".join(f'"{user}" "{password}"\n' for user, password in sorted(users.items()))
