"""Server lifecycle: initdb, managed settings, start, stop, standby mode, and processes by data directory.

Each instance's PostgreSQL server runs from its data directory, as the server user, on its port; a
suspended one runs in standby mode (read-only that no session can undo).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import shutil
import signal
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controlplane.core.step_errors import TemporaryError
from controlplane.runtime.postgres import PostgresError, PostgresServer, make_owned_dir
from provisioners.base import InstanceSpec
from provisioners.local.database import ADMIN_USER, Admin
from provisioners.local.network import PG_HBA, Network, member_key
from provisioners.local.replication import Upstream, replication_settings
from provisioners.local.repository import Repository
from provisioners.local.storage import Storage
from provisioners.local.tls import InstanceTls

log = logging.getLogger(__name__)

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
# A suspended instance's server runs in standby mode: the signal file's presence says so.
STANDBY_SIGNAL = "standby.signal"
# The signal set aside while the server runs once as a primary that no client can reach (see
# Servers.record_settings_for_standby); found at the next start, it is put back (that was cut short).
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


@dataclass
class InstanceServer(PostgresServer):
    """An instance's server: customers reach it over TCP only; its one Unix socket is in a directory
    only the server's user may enter (pgBackRest's backups and checks connect there). Without one
    (a server only looked at or stopped), no socket at all: an empty list, quoted for pg_ctl's shell."""

    sockets: Path | None = None
    # Which of its instance's servers it is (0: the first; an HA plan's standbys 1 and on).
    member: int = 0

    def socket_dir(self) -> Path:
        if self.sockets is None:
            return Path("''")
        make_owned_dir(self.sockets, self.run_as)
        return self.sockets


def managed_settings(spec: InstanceSpec) -> dict[str, str]:
    """The settings the control plane manages (`controlplane.conf`): every server's, and the plan's."""
    return {**BASE_SETTINGS, **spec.server_settings()}


def settings_text(settings: Mapping[str, str]) -> str:
    return "\n".join(f"{key} = '{_quoted(value)}'" for key, value in sorted(settings.items())) + "\n"


def _quoted(value: str) -> str:
    """A value inside a configuration file's single quotes (an archive command quotes its paths)."""
    return value.replace("'", "''")


def postmaster_pids_for(datadir: Path, programs: tuple[bytes, ...] = (b"postgres",)) -> list[int]:
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


def processes_in(datadir: Path) -> list[int]:
    """Every process whose working directory is `datadir`: a server's postmaster and all its
    children (backends, walsenders), also those a killed postmaster left behind."""
    wanted = datadir.resolve() if datadir.exists() else datadir
    found: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = Path(os.readlink(entry / "cwd"))
        except OSError:
            continue
        if cwd == wanted:
            found.append(int(entry.name))
    return found


def kill_everything_in(datadir: Path) -> None:
    """SIGKILL every process of the server in `datadir` (a fence: none may serve one more query)."""
    for pid in {*processes_in(datadir), *postmaster_pids_for(datadir)}:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def stop_strays(datadir: Path, timeout_s: float = 10.0) -> None:
    """Stop servers still running from `datadir` (found by command line), e.g. after it was deleted,
    and wait until they are gone: a server started next on the same port would find their socket's
    lock file. SIGQUIT first; SIGKILL to those still there after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    stop = signal.SIGQUIT
    while pids := postmaster_pids_for(datadir):
        if time.monotonic() > deadline:
            if stop == signal.SIGKILL:
                raise TemporaryError(f"servers {pids} of {datadir} do not stop")
            stop, deadline = signal.SIGKILL, time.monotonic() + timeout_s
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, stop)
        time.sleep(0.05)


def remove_cut_short(partial: Path, timeout_s: float = 10.0) -> None:
    """Remove what an initdb cut short left; an initdb still writing there (its worker was killed,
    it was not) is killed first, and the removal repeated until nothing is left (the initdb's
    bootstrap server may write a last file while it goes)."""
    for pid in postmaster_pids_for(partial, (b"initdb", b"postgres")):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while partial.exists():
        shutil.rmtree(partial, ignore_errors=True)
        if partial.exists():
            if time.monotonic() > deadline:
                raise TemporaryError(f"{partial} (an initdb cut short) cannot be removed yet")
            time.sleep(0.05)


class Servers:
    """The instances' servers: each runs from its data directory, as the server user, on its port."""

    def __init__(
        self,
        storage: Storage,
        network: Network,
        tls: InstanceTls,
        admin: Admin,
        repository: Repository,
        pg_bindir: Path | None,
    ) -> None:
        self.storage = storage
        self.network = network
        self.tls = tls
        self.admin = admin
        self.repository = repository
        self.pg_bindir = pg_bindir

    def _at(self, instance_id: uuid.UUID, datadir: Path, port: int, member: int = 0) -> InstanceServer:
        return InstanceServer(
            member=member,
            datadir=datadir,
            port=port,
            host=self.network.listen_host,
            run_as=self.storage.run_as,
            preferred_bindir=self.pg_bindir,
            # archive_command and restore_command run pgBackRest, which needs the repository's key.
            env=self.repository.environment(),
            sockets=self.storage.socket_dir(instance_id),
        )

    def server(
        self, instance_id: uuid.UUID, port: int | None = None, member: int | None = None
    ) -> InstanceServer:
        """The instance's primary server (or its server `member`), on `port` (by default its
        recorded one; 0 when it has none)."""
        if member is None:
            member = self.storage.primary_member(instance_id)
        if port is None:
            port = self.network.ports.port_of(member_key(instance_id, member)) or 0
        return self._at(instance_id, self.storage.member_datadir(instance_id, member), port, member)

    def settings_for(
        self, instance_id: uuid.UUID, spec: InstanceSpec, member: int | None = None
    ) -> dict[str, str]:
        """The managed settings of the instance's primary (or of its server `member`): every
        server's, the plan's, its archive's, and on an HA plan its replication's."""
        primary = self.storage.primary_member(instance_id)
        member = primary if member is None else member
        datadir = self.storage.member_datadir(instance_id, member)
        state = self.storage.load_state(instance_id)
        upstream = None
        primary_port = self.network.ports.port_of(member_key(instance_id, primary))
        if member != primary and primary_port is not None:
            upstream = Upstream(
                self.network.connect_host,
                primary_port,
                self.storage.unseal(state["admin_password"]),
                str(self.tls.store.cert_path),
            )
        replication = replication_settings(
            spec.shape.instances, member, primary, upstream, synchronous=bool(state.get("replicating"))
        )
        return {
            **managed_settings(spec),
            **self.repository.archive_settings(instance_id, datadir),
            **replication,
        }

    def require_storage(self, instance_id: uuid.UUID) -> InstanceServer:
        server = self.server(instance_id)
        if not server.initialised:
            raise TemporaryError(f"instance {instance_id} has no storage (allocate_storage runs first)")
        return server

    def build_cluster(
        self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, state: dict[str, Any]
    ) -> None:
        """initdb into a partial directory, renamed into place: a crash leaves nothing to adopt."""
        directory = self.storage.instance_dir(instance_id)
        datadir = self.storage.datadir(instance_id)
        stop_strays(datadir)
        if datadir.exists():  # a directory without a cluster: nothing worth keeping
            shutil.rmtree(datadir)
        for partial in directory.glob("pgdata.partial-*"):  # an initdb cut short by a crash
            remove_cut_short(partial)
        for password_file in directory.glob(".pgdata.partial-*.pw"):  # and its password file
            password_file.unlink(missing_ok=True)
        partial = directory / f"pgdata.partial-{fence}"
        builder = self._at(instance_id, partial, 0)
        builder.initdb(
            ADMIN_USER, self.storage.unseal(state["admin_password"]), self.settings_for(instance_id, spec)
        )
        os.replace(partial, datadir)
        self.storage.save_state(
            instance_id, {**state, "cluster_created_at": dt.datetime.now(dt.UTC).isoformat()}
        )

    def conform(
        self, instance_id: uuid.UUID, server: InstanceServer, spec: InstanceSpec, member: int | None = None
    ) -> bool:
        """Certificate, access rules and managed settings of the primary (or of `member`) as they
        must be; a running server reloads. True when something changed."""
        changed = self.tls.ensure(server)
        hba = server.datadir / "pg_hba.conf"
        if hba.read_text() != PG_HBA:
            hba.write_text(PG_HBA)
            changed = True
        desired = self.settings_for(instance_id, spec, member)
        managed = server.datadir / "controlplane.conf"
        if not managed.exists() or managed.read_text() != settings_text(desired):
            server.write_settings(desired)
            changed = True
        if changed and server.is_running():
            server.reload()
        return changed

    def ensure_started(self, server: InstanceServer, attempts: int = 5) -> None:
        """Start the server, waiting out the processes of a killed postmaster that still hold it."""
        self.tls.ensure(server)  # ssl = on: no server starts without its certificate
        for attempt in range(attempts):
            try:
                self.record_settings_for_standby(server)
                server.start()
                return
            except PostgresError:
                if attempt == attempts - 1:
                    raise
                time.sleep(0.5 * (attempt + 1))

    def record_settings_for_standby(self, server: InstanceServer) -> None:
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

    def suspend(self, instance_id: uuid.UUID) -> bool:
        """Restart the server in standby mode: read-only that no session can undo; sessions end."""
        server = self.require_storage(instance_id)
        signal_file = server.datadir / STANDBY_SIGNAL
        if server.is_running() and signal_file.exists() and self.admin.in_recovery(instance_id, server.port):
            return False
        if server.is_running() and not self.admin.in_recovery(instance_id, server.port):
            # The last writes close their segment: the archiver pushes it before the server stops,
            # so the suspended data is all in the archive.
            with self.admin.connect(instance_id, server.port) as admin:
                admin.execute("SELECT pg_switch_wal()")
        signal_file.touch()
        self.storage.chown(signal_file)
        server.stop("fast")  # a fast shutdown ends every session, as pg_terminate_backend does
        self.ensure_started(server)
        if not self.admin.in_recovery(instance_id, server.port):
            raise TemporaryError(f"instance {instance_id} did not come back read-only")
        return True

    def resume(self, instance_id: uuid.UUID) -> bool:
        """Leave standby mode: promote a running server, or start a stopped one without the signal."""
        server = self.require_storage(instance_id)
        signal_file = server.datadir / STANDBY_SIGNAL
        if not server.is_running():
            set_aside = server.datadir / SET_ASIDE_SIGNAL
            was_suspended = signal_file.exists() or set_aside.exists()
            signal_file.unlink(missing_ok=True)
            set_aside.unlink(missing_ok=True)
            self.ensure_started(server)
            return was_suspended
        if not self.admin.in_recovery(instance_id, server.port):
            signal_file.unlink(missing_ok=True)
            return False
        with self.admin.connect(instance_id, server.port) as admin:
            promoted = admin.execute("SELECT pg_promote(true, 60)").fetchone()
        if not (promoted and promoted[0]) or self.admin.in_recovery(instance_id, server.port):
            raise TemporaryError(f"instance {instance_id} could not leave read-only mode")
        signal_file.unlink(missing_ok=True)
        return True
