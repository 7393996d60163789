"""The local provisioner: each instance a real PostgreSQL server on this machine, own directory and port."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import errno
import fcntl
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tarfile
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from psycopg import sql

from controlplane.core.failures import CAPACITY_EXHAUSTED, QUOTA_EXCEEDED
from controlplane.core.step_errors import PermanentError, TemporaryError
from controlplane.runtime.files import write_atomically
from controlplane.runtime.postgres import PostgresError, PostgresServer, RunAs, port_in_use, server_user
from controlplane.runtime.secretbox import SecretBox, load_box
from controlplane.runtime.settings import Settings
from controlplane.runtime.tls import CaStore, CertificateAuthority, needs_new_certificate
from provisioners.base import (
    BACKUP_KINDS,
    BackupInfo,
    ConnectionInfo,
    DataLost,
    DeprovisionResult,
    InstanceSpec,
    Observation,
    Provisioner,
    Resource,
    fenced,
    fences_for,
)

log = logging.getLogger(__name__)

ADMIN_USER = "cp_admin"
DBNAME = "app"
WILDCARD_HOSTS = frozenset({"", "*", "0.0.0.0", "::"})  # noqa: S104 (recognised, not bound)

# Settings every instance server gets, whatever its plan. Hot standby lets a suspended
# (standby-mode) server serve reads; wal_level replica is what hot standby requires.
BASE_SETTINGS = {
    "hot_standby": "on",
    "wal_level": "replica",
    "password_encryption": "scram-sha-256",
    "log_min_messages": "warning",
    "log_line_prefix": "%m [%p] ",
    "log_statement": "none",
    # The certificate and key are server.crt and server.key in the data directory (the defaults).
    "ssl": "on",
}

# TLS and a password for every connection; a plain-text connection is refused. Replication only
# for the control plane's own backups, taken from this host.
PG_HBA = """\
# Managed by the control plane: TLS and SCRAM for every connection; plain TCP is refused.
local      all          all                    scram-sha-256
hostnossl  all          all        all         reject
hostssl    replication  cp_admin   samehost    scram-sha-256
hostssl    replication  all        all         reject
hostssl    all          all        0.0.0.0/0   scram-sha-256
hostssl    all          all        ::/0        scram-sha-256
"""

# What clients are told to check: the server's certificate, against the control plane's CA.
SSLMODE = "verify-full"
SERVER_CERT = "server.crt"
SERVER_KEY = "server.key"
# A backup is a directory: the compressed base backup, then (written last) what describes it.
BACKUP_ARCHIVE = "base.tar.gz"
BACKUP_META = "backup.json"
# A suspended instance's server runs in standby mode: the signal file's presence says so.
STANDBY_SIGNAL = "standby.signal"
# The signal set aside while the server runs once as a primary that no client can reach (see
# _record_settings_for_standby); found at the next start, it is put back (that was cut short).
SET_ASIDE_SIGNAL = "standby.signal.set-aside"
# Settings a hot standby may not run below what pg_control recorded of the data's last primary
# run (PostgreSQL refuses it: "insufficient parameter settings"), by pg_controldata's names.
STANDBY_MINIMUMS = {
    "max_connections": "max_connections setting",
    "max_worker_processes": "max_worker_processes setting",
    "max_wal_senders": "max_wal_senders setting",
    "max_prepared_transactions": "max_prepared_xacts setting",
    "max_locks_per_transaction": "max_locks_per_xact setting",
}
# Files a restored cluster must not keep: the old server's run state, and the signals that would
# start it as a standby.
NOT_RESTORED = ("postmaster.pid", "postmaster.opts", STANDBY_SIGNAL, SET_ASIDE_SIGNAL, "recovery.signal")

T = TypeVar("T")


def owner_role(instance_id: uuid.UUID) -> str:
    """The generated login role that owns the instance's database."""
    return f"app_{instance_id.hex[:12]}"


class InstanceServer(PostgresServer):
    """An instance's server: TCP only (an empty socket-directory list, quoted for pg_ctl's shell)."""

    def socket_dir(self) -> Path:
        return Path("''")


class PortAllocator:
    """Ports of the configured range, one per instance, recorded in a JSON file updated under flock."""

    def __init__(self, path: Path, low: int, high: int, host: str) -> None:
        self.path = path
        self.low = low
        self.high = high
        self.host = "127.0.0.1" if host in WILDCARD_HOSTS else host

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, int]]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            table = self._read()
            before = dict(table)
            yield table
            if table != before:
                write_atomically(self.path, json.dumps(table, sort_keys=True, indent=1))
        finally:
            os.close(fd)

    def _read(self) -> dict[str, int]:
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        return {str(key): int(value) for key, value in raw.items()}

    def table(self) -> dict[str, int]:
        """instance id -> port, as recorded."""
        with self._locked() as table:
            return dict(table)

    def port_of(self, instance_id: uuid.UUID) -> int | None:
        return self.table().get(str(instance_id))

    def allocate(self, instance_id: uuid.UUID, *, avoid: int | None = None) -> int:
        """The instance's port: the recorded one, else the lowest free one of the range."""
        key = str(instance_id)
        with self._locked() as table:
            current = table.get(key)
            if current is not None and current != avoid:
                return current
            taken = {port for owner, port in table.items() if owner != key}
            for port in range(self.low, self.high + 1):
                if port in taken or port == avoid or port_in_use(port, self.host):
                    continue
                table[key] = port
                return port
        raise TemporaryError(f"no free port in {self.low}-{self.high}", delay_s=30, code=CAPACITY_EXHAUSTED)

    def release(self, instance_id: uuid.UUID) -> bool:
        with self._locked() as table:
            return table.pop(str(instance_id), None) is not None


def _postmaster_pids_for(datadir: Path, programs: tuple[bytes, ...] = (b"postgres",)) -> list[int]:
    """Servers still running from `datadir` (found by command line), e.g. after it was deleted;
    with `programs`, any of those (an `initdb` into it)."""
    wanted = str(datadir)
    found: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if args and args[0].endswith(programs) and wanted.encode() in args:
            found.append(int(entry.name))
    return found


def _remove_cut_short(partial: Path, timeout_s: float = 10.0) -> None:
    """Remove what an initdb cut short left; an initdb still writing there (its worker was killed,
    it was not) is killed first, and the removal repeated until nothing is left (the initdb's
    bootstrap server may write a last file while it goes)."""
    for pid in _postmaster_pids_for(partial, (b"initdb", b"postgres")):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while partial.exists():
        shutil.rmtree(partial, ignore_errors=True)
        if partial.exists():
            if time.monotonic() > deadline:
                raise TemporaryError(f"{partial} (an initdb cut short) cannot be removed yet")
            time.sleep(0.05)


class LocalProvisioner(Provisioner):
    """Instances as PostgreSQL servers under data_dir/instances/<id>/, on ports of the configured range."""

    name = "local"
    supports_backups = True

    @classmethod
    def from_settings(cls, settings: Settings) -> LocalProvisioner:
        return cls(settings)

    def __init__(
        self,
        settings: Settings,
        *,
        run_as: RunAs | None = None,
        box: SecretBox | None = None,
    ) -> None:
        self.settings = settings
        self.root = Path(settings.data_dir).resolve() / "instances"
        self.backups = Path(settings.data_dir).resolve() / "backups"
        self.tls_dir = Path(settings.data_dir).resolve() / "tls"
        self.listen_host = settings.provisioner.local_listen_host
        self.connect_host = "127.0.0.1" if self.listen_host in WILDCARD_HOSTS else self.listen_host
        self.advertise_host = socket.gethostname() if self.listen_host in WILDCARD_HOSTS else self.listen_host
        self._run_as = run_as
        self._box = box
        self._ca: CertificateAuthority | None = None
        self.fences = fences_for(Path(settings.data_dir).resolve())
        self.ports = PortAllocator(
            self.root / "ports.json",
            settings.provisioner.local_port_min,
            settings.provisioner.local_port_max,
            self.listen_host,
        )

    # ---- paths, state, helpers -------------------------------------------------------------

    @property
    def run_as(self) -> RunAs:
        if self._run_as is None:
            self._run_as = server_user()
        return self._run_as

    @property
    def box(self) -> SecretBox:
        if self._box is None:
            self._box = load_box(self.settings)
        return self._box

    @property
    def ca_store(self) -> CaStore:
        return CaStore(self.tls_dir, self.box)

    def _authority(self) -> CertificateAuthority:
        """The control plane's CA (made on first use), which signs every instance's certificate."""
        if self._ca is None:
            self._ca = self.ca_store.load()
        return self._ca

    def instance_dir(self, instance_id: uuid.UUID) -> Path:
        return self.root / str(instance_id)

    def backup_dir(self, instance_id: uuid.UUID) -> Path:
        """The instance's periodic and on-demand backups (outside its directory: they outlive it)."""
        return self.backups / str(instance_id)

    def datadir(self, instance_id: uuid.UUID) -> Path:
        return self.instance_dir(instance_id) / "pgdata"

    def _state_path(self, instance_id: uuid.UUID) -> Path:
        return self.instance_dir(instance_id) / "state.json"

    def _load_state(self, instance_id: uuid.UUID) -> dict[str, Any]:
        try:
            state: dict[str, Any] = json.loads(self._state_path(instance_id).read_text())
        except FileNotFoundError:
            return {}
        return state

    def _save_state(self, instance_id: uuid.UUID, state: Mapping[str, Any]) -> None:
        write_atomically(self._state_path(instance_id), json.dumps(dict(state), sort_keys=True, indent=1))

    def _seal(self, secret: str) -> str:
        return base64.b64encode(self.box.encrypt(secret)).decode()

    def _unseal(self, sealed: str) -> str:
        return self.box.decrypt(base64.b64decode(sealed))

    def _server(self, instance_id: uuid.UUID, port: int | None = None) -> InstanceServer:
        if port is None:
            port = self.ports.port_of(instance_id) or 0
        return InstanceServer(
            datadir=self.datadir(instance_id),
            port=port,
            host=self.listen_host,
            run_as=self.run_as,
            preferred_bindir=self.settings.database.pg_bindir,
        )

    def _prepare_root(self) -> None:
        for directory in (Path(self.settings.data_dir).resolve(), self.root):
            directory.mkdir(parents=True, exist_ok=True)
            if self.run_as.is_switch:
                mode = os.stat(directory).st_mode
                os.chmod(directory, mode | 0o111)  # noqa: S103 (the server user must traverse it)

    def _chown(self, path: Path) -> None:
        if self.run_as.is_switch:
            assert self.run_as.uid is not None and self.run_as.gid is not None
            os.chown(path, self.run_as.uid, self.run_as.gid)

    def _admin(self, instance_id: uuid.UUID, port: int, *, timeout: int = 10) -> psycopg.Connection[Any]:
        state = self._load_state(instance_id)
        self._authority()
        return psycopg.connect(
            host=self.connect_host,
            port=port,
            user=ADMIN_USER,
            password=self._unseal(state["admin_password"]),
            dbname="postgres",
            connect_timeout=timeout,
            autocommit=True,
            sslmode=SSLMODE,
            sslrootcert=str(self.ca_store.cert_path),
        )

    def _client_tool(
        self, instance_id: uuid.UUID, server: InstanceServer, tool: str, args: list[str]
    ) -> subprocess.CompletedProcess[str]:
        """Run a client tool (pg_dump, pg_basebackup) against the server as the admin, over TLS."""
        self._authority()
        env = dict(
            os.environ,
            PGPASSWORD=self._unseal(self._load_state(instance_id)["admin_password"]),
            PGSSLMODE=SSLMODE,
            PGSSLROOTCERT=str(self.ca_store.cert_path),
            LC_ALL="C",
        )
        connection = [f"--host={self.connect_host}", f"--port={server.port}", f"--username={ADMIN_USER}"]
        return subprocess.run(
            [server.bin(tool), *connection, "--no-password", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=3600,
            check=False,
            stdin=subprocess.DEVNULL,
        )

    def _tls_hosts(self) -> list[str]:
        """The names clients reach the servers by: the advertised host and the one we connect to."""
        return list(dict.fromkeys([self.advertise_host, self.connect_host]))

    def _ensure_tls(self, server: PostgresServer) -> bool:
        """The server's certificate from the control plane's CA, for its hosts; True when (re)issued."""
        cert_path = server.datadir / SERVER_CERT
        current = cert_path.read_bytes() if cert_path.exists() else None
        ca = self._authority()
        if not needs_new_certificate(current, ca, self._tls_hosts()):
            return False
        issued = ca.issue_server(self._tls_hosts(), common_name=server.datadir.parent.name)
        key_path = server.datadir / SERVER_KEY
        write_atomically(key_path, issued.key_pem, 0o600)
        write_atomically(cert_path, issued.cert_pem, 0o644)
        self._chown(key_path)
        self._chown(cert_path)
        return True

    def _conform(self, server: InstanceServer, spec: InstanceSpec) -> None:
        """Certificate, access rules and managed settings as they must be; a running server reloads."""
        changed = self._ensure_tls(server)
        hba = server.datadir / "pg_hba.conf"
        if hba.read_text() != PG_HBA:
            hba.write_text(PG_HBA)
            changed = True
        desired = {**BASE_SETTINGS, **spec.server_settings()}
        managed = server.datadir / "controlplane.conf"
        if not managed.exists() or managed.read_text() != _settings_text(desired):
            server.write_settings(desired)
            changed = True
        if changed and server.is_running():
            server.reload()

    def _had_cluster(self, instance_id: uuid.UUID) -> bool:
        """Whether a cluster was made for the instance once: if it is not there, it was lost."""
        return bool(self._load_state(instance_id).get("cluster_created_at")) or (
            self.ports.port_of(instance_id) is not None
        )

    def _require_storage(self, instance_id: uuid.UUID) -> InstanceServer:
        server = self._server(instance_id)
        if not server.initialised:
            raise TemporaryError(f"instance {instance_id} has no storage (allocate_storage runs first)")
        return server

    def _require_port(self, instance_id: uuid.UUID) -> int:
        port = self.ports.port_of(instance_id)
        if port is None:
            raise TemporaryError(f"instance {instance_id} has no port (configure_network runs first)")
        return port

    def _ensure_started(self, server: InstanceServer, attempts: int = 5) -> None:
        """Start the server, waiting out the processes of a killed postmaster that still hold it."""
        self._ensure_tls(server)  # ssl = on: no server starts without its certificate
        for attempt in range(attempts):
            try:
                self._record_settings_for_standby(server)
                server.start()
                return
            except PostgresError:
                if attempt == attempts - 1:
                    raise
                time.sleep(0.5 * (attempt + 1))

    def _record_settings_for_standby(self, server: InstanceServer) -> None:
        """Before a standby-mode start: if a setting is below what pg_control recorded of the last
        primary run (a plan lowered while the server was down, then a suspension), PostgreSQL
        would refuse to start. The server then runs once as a primary that no client can reach
        (no listener; a socket only its user may reach), which records the settings it has."""
        signal_file, set_aside = server.datadir / STANDBY_SIGNAL, server.datadir / SET_ASIDE_SIGNAL
        if set_aside.exists():
            os.replace(set_aside, signal_file)
        if server.is_running() or not signal_file.exists():
            return
        recorded = server.control_data()
        lower = [
            name
            for name, field in STANDBY_MINIMUMS.items()
            if int(server.configured(name)) < int(recorded[field])
        ]
        if not lower:
            return
        log.info("recording %s of %s before its standby start", ", ".join(lower), server.datadir)
        os.replace(signal_file, set_aside)
        server.start_and_stop_privately()  # a primary's start records its settings in pg_control
        os.replace(set_aside, signal_file)

    async def _step(self, instance_id: uuid.UUID, fence: int, work: Callable[[], T]) -> T:
        """Run `work` in a thread while holding the instance's fence; translate errors at this edge.

        A cancelled step lets the thread finish before the fence lock is released, so a second
        step never overlaps a half-done one.
        """
        async with fenced(self.fences, instance_id, fence):
            task = asyncio.ensure_future(asyncio.to_thread(_translated, work))
            try:
                return await asyncio.shield(task)
            except asyncio.CancelledError:
                await asyncio.wait({task})
                raise

    # ---- steps -----------------------------------------------------------------------------

    async def allocate_storage(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> None:
        await self._step(instance_id, fence, lambda: self._allocate_storage(instance_id, spec, fence))

    def _prepare_instance(self, instance_id: uuid.UUID, state: dict[str, Any]) -> dict[str, Any]:
        """The instance's directory, and its state with an admin password (generated once)."""
        self._prepare_root()
        directory = self.instance_dir(instance_id)
        directory.mkdir(mode=0o711, exist_ok=True)
        os.chmod(directory, 0o711)  # noqa: S103 (the server user traverses; state.json stays 0600)
        if "admin_password" not in state:
            state = {
                "instance_id": str(instance_id),
                "admin_password": self._seal(secrets.token_urlsafe(32)),
                **state,
            }
            self._save_state(instance_id, state)
        return state

    def _allocate_storage(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> None:
        state = self._prepare_instance(instance_id, self._load_state(instance_id))
        if (self.datadir(instance_id) / "PG_VERSION").exists():
            return
        if self._had_cluster(instance_id):
            raise DataLost(
                f"the data directory of instance {instance_id} is gone: restore a backup, or accept "
                "an empty re-initialisation"
            )
        self._build_cluster(instance_id, spec, fence, state)

    def _stop_strays(self, datadir: Path) -> None:
        """Stop servers still running from `datadir` (found by command line), e.g. after it was deleted."""
        for pid in _postmaster_pids_for(datadir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGQUIT)

    def _build_cluster(
        self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, state: dict[str, Any]
    ) -> None:
        """initdb into a partial directory, renamed into place: a crash leaves nothing to adopt."""
        directory = self.instance_dir(instance_id)
        datadir = self.datadir(instance_id)
        self._stop_strays(datadir)
        if datadir.exists():  # a directory without a cluster: nothing worth keeping
            shutil.rmtree(datadir)
        for partial in directory.glob("pgdata.partial-*"):  # an initdb cut short by a crash
            _remove_cut_short(partial)
        for password_file in directory.glob(".pgdata.partial-*.pw"):  # and its password file
            password_file.unlink(missing_ok=True)
        partial = directory / f"pgdata.partial-{fence}"
        builder = InstanceServer(
            datadir=partial,
            port=0,
            host=self.listen_host,
            run_as=self.run_as,
            preferred_bindir=self.settings.database.pg_bindir,
        )
        builder.initdb(
            ADMIN_USER, self._unseal(state["admin_password"]), {**BASE_SETTINGS, **spec.server_settings()}
        )
        os.replace(partial, datadir)
        self._save_state(instance_id, {**state, "cluster_created_at": dt.datetime.now(dt.UTC).isoformat()})

    async def configure_network(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> None:
        await self._step(instance_id, fence, lambda: self._configure_network(instance_id, spec))

    def _configure_network(self, instance_id: uuid.UUID, spec: InstanceSpec) -> None:
        server = self._require_storage(instance_id)
        self._port_to_start_on(instance_id, server)
        self._conform(server, spec)

    def _port_to_start_on(self, instance_id: uuid.UUID, server: InstanceServer) -> int:
        """The instance's port, moved to a free one if another process holds it while this server
        is not running (the connection details initialize_database returns carry the new one)."""
        port = self.ports.allocate(instance_id)
        if not server.is_running() and port_in_use(port, self.connect_host):
            log.warning("port %s of instance %s is taken by another process; moving", port, instance_id)
            port = self.ports.allocate(instance_id, avoid=port)
        return port

    async def initialize_database(
        self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, *, password: str | None = None
    ) -> ConnectionInfo:
        return await self._step(
            instance_id, fence, lambda: self._initialize_database(instance_id, spec, password)
        )

    def _initialize_database(
        self, instance_id: uuid.UUID, spec: InstanceSpec, password: str | None
    ) -> ConnectionInfo:
        current = self._require_storage(instance_id)
        self._require_port(instance_id)  # configure_network ran
        # A port taken since configure_network ran is left for another: these details carry it.
        port = self._port_to_start_on(instance_id, current)
        server = self._server(instance_id, port)
        self._ensure_started(server)
        state = self._load_state(instance_id)
        if password is None:
            password = self._unseal(state["owner_password"]) if "owner_password" in state else None
        if password is None:
            password = secrets.token_urlsafe(24)
        if state.get("owner_password") is None or self._unseal(state["owner_password"]) != password:
            state["owner_password"] = self._seal(password)  # recorded before the role gets it
            self._save_state(instance_id, state)
        role = owner_role(instance_id)
        with self._admin(instance_id, port) as admin:
            in_recovery = admin.execute("SELECT pg_is_in_recovery()").fetchone()
            if in_recovery and in_recovery[0]:
                raise TemporaryError(f"instance {instance_id} is read-only; resume runs first")
            _ensure_owner(admin, role, password)
        if "plan" not in state:
            state.update(plan=spec.plan, generation=spec.generation)
            self._save_state(instance_id, state)
        ca = self._authority().cert_pem.decode()
        return ConnectionInfo(
            self.advertise_host, port, DBNAME, role, password, sslmode=SSLMODE, ca_certificate=ca
        )

    async def apply_plan(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> bool:
        return await self._step(instance_id, fence, lambda: self._apply_plan(instance_id, spec))

    def _apply_plan(self, instance_id: uuid.UUID, spec: InstanceSpec) -> bool:
        server = self._require_storage(instance_id)
        desired = {**BASE_SETTINGS, **spec.server_settings()}
        managed = server.datadir / "controlplane.conf"
        changed = False
        if managed.read_text() != _settings_text(desired):
            server.write_settings(desired)
            changed = True
        if server.is_running():
            with self._admin(instance_id, server.port) as admin:
                live = {key: _show(admin, key) for key in spec.server_settings()}
            if live != spec.server_settings():
                server.restart()
                changed = True
        state = self._load_state(instance_id)
        if (state.get("plan"), state.get("generation")) != (spec.plan, spec.generation):
            state.update(plan=spec.plan, generation=spec.generation)
            self._save_state(instance_id, state)
        return changed

    async def suspend(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> bool:
        return await self._step(instance_id, fence, lambda: self._suspend(instance_id))

    def _suspend(self, instance_id: uuid.UUID) -> bool:
        """Restart the server in standby mode: read-only that no session can undo; sessions end."""
        server = self._require_storage(instance_id)
        signal_file = server.datadir / STANDBY_SIGNAL
        if server.is_running() and signal_file.exists() and self._in_recovery(instance_id, server.port):
            return False
        signal_file.touch()
        if self.run_as.is_switch:
            assert self.run_as.uid is not None and self.run_as.gid is not None
            os.chown(signal_file, self.run_as.uid, self.run_as.gid)
        server.stop("fast")  # a fast shutdown ends every session, as pg_terminate_backend does
        self._ensure_started(server)
        if not self._in_recovery(instance_id, server.port):
            raise TemporaryError(f"instance {instance_id} did not come back read-only")
        return True

    async def resume(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> bool:
        return await self._step(instance_id, fence, lambda: self._resume(instance_id))

    def _resume(self, instance_id: uuid.UUID) -> bool:
        """Leave standby mode: promote a running server, or start a stopped one without the signal."""
        server = self._require_storage(instance_id)
        signal_file = server.datadir / STANDBY_SIGNAL
        if not server.is_running():
            set_aside = server.datadir / SET_ASIDE_SIGNAL
            was_suspended = signal_file.exists() or set_aside.exists()
            signal_file.unlink(missing_ok=True)
            set_aside.unlink(missing_ok=True)
            self._ensure_started(server)
            return was_suspended
        if not self._in_recovery(instance_id, server.port):
            signal_file.unlink(missing_ok=True)
            return False
        with self._admin(instance_id, server.port) as admin:
            promoted = admin.execute("SELECT pg_promote(true, 60)").fetchone()
        if not (promoted and promoted[0]) or self._in_recovery(instance_id, server.port):
            raise TemporaryError(f"instance {instance_id} could not leave read-only mode")
        signal_file.unlink(missing_ok=True)
        return True

    def _in_recovery(self, instance_id: uuid.UUID, port: int) -> bool:
        with self._admin(instance_id, port) as admin:
            row = admin.execute("SELECT pg_is_in_recovery()").fetchone()
        return bool(row and row[0])

    async def deprovision(
        self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, *, skip_backup: bool = False
    ) -> DeprovisionResult:
        return await self._step(instance_id, fence, lambda: self._deprovision(instance_id, skip_backup))

    async def final_backup(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> str | None:
        taken = await self._step(instance_id, fence, lambda: self._take_final_backup(instance_id))
        return None if taken is None else Path(taken).name

    def _take_final_backup(self, instance_id: uuid.UUID) -> str | None:
        """The final dump's path: the one recorded (if it is still there), else a new one; None
        when there is no cluster to dump."""
        state = self._load_state(instance_id)
        server = self._server(instance_id)
        backup: str | None = state.get("final_backup")
        if server.initialised and not (backup and Path(backup).exists()):
            backup = str(self._final_backup(instance_id, server))
            state["final_backup"] = backup
            self._save_state(instance_id, state)
        return backup

    def _deprovision(self, instance_id: uuid.UUID, skip_backup: bool) -> DeprovisionResult:
        directory = self.instance_dir(instance_id)
        server = self._server(instance_id)
        existed = directory.exists() or self.ports.port_of(instance_id) is not None
        backup = None if skip_backup else self._take_final_backup(instance_id)
        held = self._list_backups(instance_id)
        if backup is not None or skip_backup:
            shutil.rmtree(self.backup_dir(instance_id), ignore_errors=True)
        elif held:
            # No data left to dump (it was lost): the newest backup is what remains, and is kept.
            backup = held[-1].location
        if server.initialised:
            server.stop("fast")
        self._stop_strays(server.datadir)
        if directory.exists():
            shutil.rmtree(directory)
        self.ports.release(instance_id)
        return DeprovisionResult(backup=None if skip_backup else backup, removed=existed)

    def _final_backup(self, instance_id: uuid.UUID, server: InstanceServer) -> Path:
        if server.port == 0:
            server.port = self.ports.allocate(instance_id)
        self._ensure_started(server)
        self.backups.mkdir(parents=True, exist_ok=True, mode=0o700)
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
        final = self.backups / f"{instance_id}-{stamp}.dump"
        partial = final.with_name(final.name + ".partial")
        result = self._client_tool(
            instance_id, server, "pg_dump", ["--format=custom", f"--file={partial}", DBNAME]
        )
        if result.returncode != 0:
            partial.unlink(missing_ok=True)
            raise TemporaryError(f"final backup of {instance_id} failed: {result.stderr.strip()[-500:]}")
        os.replace(partial, final)
        return final

    # ---- reading ---------------------------------------------------------------------------

    async def observe(self, instance_id: uuid.UUID) -> Observation:
        return await asyncio.to_thread(self._observe, instance_id)

    def _observe(self, instance_id: uuid.UUID) -> Observation:
        server = self._server(instance_id)
        state = self._load_state(instance_id)
        port = server.port or None
        endpoint = None if port is None else (self.advertise_host, port)
        plan, generation = state.get("plan"), state.get("generation")
        if not server.initialised:
            return Observation(
                False,
                endpoint=endpoint,
                detail="data directory missing",
                data_lost=self._had_cluster(instance_id),
            )
        if not server.is_running():
            return Observation(
                True, endpoint=endpoint, plan_applied=plan, generation=generation, detail="server not running"
            )
        try:
            with self._admin(instance_id, server.port, timeout=3) as admin:
                row = admin.execute("SELECT pg_is_in_recovery()").fetchone()
        except psycopg.Error as exc:
            return Observation(
                True,
                running=True,
                endpoint=endpoint,
                plan_applied=plan,
                generation=generation,
                detail=f"not accepting connections: {str(exc).strip()[:200]}",
            )
        read_only = bool(row and row[0])
        return Observation(
            True,
            running=True,
            healthy=True,
            read_only=read_only,
            endpoint=endpoint,
            plan_applied=plan,
            generation=generation,
            detail="read-only (standby mode)" if read_only else "accepting writes",
        )

    async def inventory(self) -> list[Resource]:
        return await asyncio.to_thread(self._inventory)

    def _inventory(self) -> list[Resource]:
        found: list[Resource] = []
        if self.root.exists():
            for entry in sorted(self.root.iterdir()):
                instance_id = _as_uuid(entry.name)
                if instance_id is None or not entry.is_dir():
                    continue
                found.append(Resource("data_directory", str(entry), instance_id))
                pid = self._server(instance_id, 0).pid()
                if pid is not None:
                    found.append(Resource("server", f"pid {pid}", instance_id))
        for owner, port in sorted(self.ports.table().items(), key=lambda item: item[1]):
            found.append(Resource("port", str(port), _as_uuid(owner)))
        return found

    async def start_all(self, instance_ids: Collection[uuid.UUID]) -> list[uuid.UUID]:
        return await asyncio.to_thread(self._start_all, list(instance_ids))

    def _start_all(self, instance_ids: list[uuid.UUID]) -> list[uuid.UUID]:
        started = []
        for instance_id in instance_ids:
            server = self._server(instance_id)
            if server.port and server.initialised and not server.is_running():
                state = self._load_state(instance_id)
                applied = InstanceSpec.for_removal(
                    {"plan": state.get("plan", "dev")}, int(state.get("generation", 1))
                )
                self._conform(server, applied)  # servers made before a change of the rules get them
                self._ensure_started(server)
                started.append(instance_id)
        return started

    async def stop_all(self) -> list[uuid.UUID]:
        return await asyncio.to_thread(self._stop_all)

    def _stop_all(self) -> list[uuid.UUID]:
        stopped = []
        if self.root.exists():
            for entry in sorted(self.root.iterdir()):
                instance_id = _as_uuid(entry.name)
                if instance_id is None:
                    continue
                server = self._server(instance_id)
                if server.is_running():
                    server.stop()
                    stopped.append(instance_id)
        return stopped

    # ---- backups, restore, the CA -----------------------------------------------------------

    async def take_backup(
        self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, *, kind: str = "on_demand"
    ) -> BackupInfo:
        return await self._step(instance_id, fence, lambda: self._take_backup(instance_id, spec, kind))

    def _take_backup(self, instance_id: uuid.UUID, spec: InstanceSpec, kind: str) -> BackupInfo:
        """pg_basebackup (tar, gzip, the WAL it needs included) into a partial directory, renamed."""
        if kind not in BACKUP_KINDS:
            raise PermanentError(f"unknown backup kind {kind!r}; kinds are {', '.join(BACKUP_KINDS)}")
        server = self._require_storage(instance_id)
        port = self._require_port(instance_id)
        if not server.is_running():
            raise TemporaryError(f"instance {instance_id} is not running; a backup needs its server")
        taken = dt.datetime.now(dt.UTC)
        backup_id = taken.strftime("%Y%m%dT%H%M%S") + f"{taken.microsecond // 1000:03d}Z"
        root = self.backup_dir(instance_id)
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        for stale in root.glob(".partial-*"):  # a backup cut short by a crash
            shutil.rmtree(stale, ignore_errors=True)
        partial = root / f".partial-{backup_id}"
        partial.mkdir(mode=0o700)
        server.port = port
        options = ["--format=tar", "--wal-method=fetch", "--checkpoint=fast", "--compress=client-gzip:1"]
        result = self._client_tool(
            instance_id,
            server,
            "pg_basebackup",
            [f"--pgdata={partial}", *options, f"--label=controlplane {backup_id}"],
        )
        if result.returncode != 0:
            shutil.rmtree(partial, ignore_errors=True)
            raise TemporaryError(f"backup of {instance_id} failed: {result.stderr.strip()[-500:]}")
        state = self._load_state(instance_id)
        meta = {
            "id": backup_id,
            "instance_id": str(instance_id),
            # The end of the backup: the point its data is from (the WAL it holds reaches it).
            "completed_at": dt.datetime.now(dt.UTC).isoformat(),
            "kind": kind,
            "size_bytes": sum(f.stat().st_size for f in partial.rglob("*") if f.is_file()),
            "plan": spec.plan,
            "generation": spec.generation,
            # The sealed passwords the backup's cluster knows, for a restore after state.json is lost.
            "state": {key: state[key] for key in ("admin_password", "owner_password") if key in state},
        }
        write_atomically(partial / BACKUP_META, json.dumps(meta, indent=1))
        os.replace(partial, root / backup_id)
        self._prune(instance_id, spec.backup_schedule().keep)
        return _backup_of(root / backup_id, meta)

    def _prune(self, instance_id: uuid.UUID, keep: int) -> None:
        """Retention: remove the oldest backups beyond the newest `keep` (at least one is kept)."""
        held = self._list_backups(instance_id)
        for old in held[: -max(1, keep)]:
            shutil.rmtree(old.location, ignore_errors=True)

    async def list_backups(self, instance_id: uuid.UUID) -> list[BackupInfo]:
        return await asyncio.to_thread(self._list_backups, instance_id)

    def _list_backups(self, instance_id: uuid.UUID) -> list[BackupInfo]:
        root = self.backup_dir(instance_id)
        if not root.exists():
            return []
        held = []
        for entry in root.iterdir():
            meta_path = entry / BACKUP_META
            if entry.name.startswith(".") or not meta_path.exists():
                continue
            held.append(_backup_of(entry, json.loads(meta_path.read_text())))
        return sorted(held, key=lambda backup: backup.completed_at or "")

    async def restore(
        self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, *, backup_id: str | None
    ) -> None:
        await self._step(instance_id, fence, lambda: self._restore(instance_id, spec, fence, backup_id))

    def _restore(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, backup_id: str | None) -> None:
        """The cluster from backup `backup_id` (or a new empty one), in place of whatever is there."""
        meta: dict[str, Any] | None = None
        source = self.backup_dir(instance_id) / (backup_id or "")
        if backup_id is not None:
            if "/" in backup_id or backup_id.startswith(".") or not (source / BACKUP_META).exists():
                raise PermanentError(f"instance {instance_id} has no backup {backup_id!r}")
            meta = json.loads((source / BACKUP_META).read_text())
        state = self._load_state(instance_id)
        if meta is not None:
            # The restored cluster knows the admin password of the time of its backup.
            state.update({key: value for key, value in meta["state"].items() if key == "admin_password"})
            state.setdefault("owner_password", meta["state"].get("owner_password"))
        state = self._prepare_instance(instance_id, {k: v for k, v in state.items() if v is not None})
        self._save_state(instance_id, state)
        server = self._server(instance_id)
        if server.is_running():
            server.stop("fast")
        self._stop_strays(server.datadir)
        self._set_aside(instance_id)
        if meta is None:
            self._build_cluster(instance_id, spec, fence, state)
            return
        directory = self.instance_dir(instance_id)
        for stale in directory.glob("pgdata.restoring-*"):
            shutil.rmtree(stale, ignore_errors=True)
        partial = directory / f"pgdata.restoring-{fence}"
        partial.mkdir(mode=0o700)
        with tarfile.open(source / BACKUP_ARCHIVE) as archive:
            archive.extractall(partial, filter="data")
        for name in NOT_RESTORED:
            (partial / name).unlink(missing_ok=True)
        os.chmod(partial, 0o700)
        for path in (partial, *partial.rglob("*")):
            self._chown(path)
        os.replace(partial, server.datadir)
        self._save_state(
            instance_id,
            {
                **state,
                "cluster_created_at": state.get("cluster_created_at") or meta["completed_at"],
                "restored_from": backup_id,
            },
        )

    def _set_aside(self, instance_id: uuid.UUID) -> None:
        """Whatever is left of a data directory is moved aside, never removed (it may hold data)."""
        datadir = self.datadir(instance_id)
        if datadir.exists():
            stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
            os.replace(datadir, datadir.with_name(f"pgdata.replaced-{stamp}"))

    async def ca_certificate(self) -> str | None:
        return (await asyncio.to_thread(self._authority)).cert_pem.decode()

    def roles(self, instance_id: uuid.UUID) -> list[str]:
        """Login roles of the instance's server other than the control plane's own (for checks)."""
        port = self._require_port(instance_id)
        with self._admin(instance_id, port) as admin:
            rows = admin.execute(
                "SELECT rolname FROM pg_roles WHERE rolcanlogin AND rolname <> %s ORDER BY 1", (ADMIN_USER,)
            ).fetchall()
        return [row[0] for row in rows]


def _backup_of(path: Path, meta: Mapping[str, Any]) -> BackupInfo:
    return BackupInfo(
        name=str(meta["id"]),
        instance_id=uuid.UUID(str(meta["instance_id"])),
        completed_at=str(meta["completed_at"]),
        kind=str(meta.get("kind", "scheduled")),
        size_bytes=None if meta.get("size_bytes") is None else int(meta["size_bytes"]),
        location=str(path),
    )


def _as_uuid(text: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(text)
    except ValueError:
        return None


def _settings_text(settings: Mapping[str, str]) -> str:
    return "\n".join(f"{key} = '{value}'" for key, value in sorted(settings.items())) + "\n"


def _show(conn: psycopg.Connection[Any], name: str) -> str:
    row = conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()
    return "" if row is None else str(row[0])


def _ensure_owner(admin: psycopg.Connection[Any], role: str, password: str) -> None:
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


def _translated(work: Callable[[], T]) -> T:
    """Third-party failures become the engine's two kinds of error (a full or over-quota disk
    with the code customers are told)."""
    try:
        return work()
    except (TemporaryError, PermanentError):
        raise
    except OSError as exc:
        message = f"{type(exc).__name__}: {str(exc).strip()[:500]}"
        if exc.errno == errno.EDQUOT:
            raise PermanentError(message, code=QUOTA_EXCEEDED) from exc
        if exc.errno == errno.ENOSPC:
            raise TemporaryError(message, code=CAPACITY_EXHAUSTED) from exc
        raise TemporaryError(message) from exc
    except (PostgresError, psycopg.OperationalError, subprocess.TimeoutExpired) as exc:
        raise TemporaryError(f"{type(exc).__name__}: {str(exc).strip()[:500]}") from exc
    except psycopg.Error as exc:
        raise TemporaryError(f"{type(exc).__name__}: {str(exc).strip()[:500]}") from exc
