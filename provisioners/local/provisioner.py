"""`LocalProvisioner`: the interface's steps, each one synchronous body composed of the package's parts.

The parts are storage, network, TLS, databases, servers and backups; `steps` runs each body.
"""

from __future__ import annotations

import datetime as dt
import secrets
import shutil
import uuid
from collections.abc import Collection
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg
import psycopg.sql

from controlplane.core import plans
from controlplane.core.dbmetrics import DatabaseStats
from controlplane.core.step_errors import TemporaryError
from controlplane.runtime.postgres import RunAs
from controlplane.runtime.secretbox import SecretBox
from controlplane.runtime.settings import Settings
from controlplane.runtime.tls import CaStore
from provisioners.base import (
    BackupInfo,
    ConnectionInfo,
    DataLost,
    DeprovisionResult,
    InstanceSpec,
    Observation,
    Promotion,
    Provisioner,
    RecoveryWindow,
    Resource,
    Restored,
    RestorePoint,
    fences_for,
)
from provisioners.local.backups import Backups
from provisioners.local.database import (
    ADMIN_USER,
    DBNAME,
    Admin,
    ensure_owner,
    former_owners,
    owner_role,
    show,
    take_over,
)
from provisioners.local.network import Network, owner_of
from provisioners.local.pooler import POOL_MODE, READ_ONLY_DBNAME, Pooler
from provisioners.local.replication import member_name
from provisioners.local.repository import Repository
from provisioners.local.server import InstanceServer, Servers, settings_text, stop_strays
from provisioners.local.standbys import Standbys
from provisioners.local.steps import in_thread, step
from provisioners.local.storage import Storage
from provisioners.local.tls import SSLMODE, InstanceTls


class LocalProvisioner(Provisioner):
    """Instances as PostgreSQL servers under data_dir/instances/<id>/, on ports of the configured range."""

    name = "local"
    supports_backups = True
    supports_restore = True
    reports_windows = True
    pools_ha_endpoint = True
    serves_read_only = True

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
        self.storage = Storage(settings, run_as=run_as, box=box)
        self.network = Network(settings, self.storage.root, self.storage.primary_member)
        self.tls = InstanceTls(self.storage.data_dir / "tls", self.storage, self.network.names())
        self.admin = Admin(self.storage, self.tls, self.network.connect_host)
        self.repository = Repository(self.storage, settings.provisioner.local_archive_timeout_s)
        self.servers = Servers(
            self.storage, self.network, self.tls, self.admin, self.repository, settings.database.pg_bindir
        )
        self.backups = Backups(self.storage, self.network, self.servers, self.admin, self.repository)
        self.standbys = Standbys(self.storage, self.network, self.servers, self.admin)
        self.pooler = Pooler(self.storage, self.network, self.tls)
        self.fences = fences_for(self.storage.data_dir)
        # What tests, the bench and the chaos soak look at.
        self.root = self.storage.root
        self.ports = self.network.ports
        self.advertise_host = self.network.advertise_host

    @property
    def run_as(self) -> RunAs:
        return self.storage.run_as

    @property
    def box(self) -> SecretBox:
        return self.storage.box

    @property
    def ca_store(self) -> CaStore:
        return self.tls.store

    def instance_dir(self, instance_id: uuid.UUID) -> Path:
        return self.storage.instance_dir(instance_id)

    def datadir(self, instance_id: uuid.UUID) -> Path:
        return self.storage.datadir(instance_id)

    def _server(
        self, instance_id: uuid.UUID, port: int | None = None, member: int | None = None
    ) -> InstanceServer:
        return self.servers.server(instance_id, port, member)

    def _had_cluster(self, instance_id: uuid.UUID) -> bool:
        """Whether a cluster was made for the instance once: if it is not there, it was lost."""
        return bool(self.storage.load_state(instance_id).get("cluster_created_at")) or (
            self.ports.port_of(instance_id) is not None
        )

    # ---- steps -----------------------------------------------------------------------------

    @step
    def allocate_storage(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> None:
        state = self.storage.prepare_instance(instance_id, self.storage.load_state(instance_id))
        if (self.datadir(instance_id) / "PG_VERSION").exists():
            return
        if self._had_cluster(instance_id):
            raise DataLost(
                f"the data directory of instance {instance_id} is gone: restore a backup, or accept "
                "an empty re-initialisation"
            )
        if spec.restore_from is not None:
            self.backups.restore_new(instance_id, spec, fence, spec.restore_from)
            return
        self.servers.build_cluster(instance_id, spec, fence, state)

    @step
    def configure_network(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> None:
        server = self.servers.require_storage(instance_id)
        self.network.port_to_start_on(instance_id, server)
        self.servers.conform(instance_id, server, spec)

    @step
    def initialize_database(
        self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, *, password: str | None = None
    ) -> ConnectionInfo:
        current = self.servers.require_storage(instance_id)
        self.network.require_port(instance_id)  # configure_network ran
        # A port taken since configure_network ran is left for another: these details carry it.
        port = self.network.port_to_start_on(instance_id, current)
        server = self._server(instance_id, port)
        self.servers.ensure_started(server)
        state = self.storage.load_state(instance_id)
        if password is None:
            password = self.storage.unseal(state["owner_password"]) if "owner_password" in state else None
        if password is None:
            password = secrets.token_urlsafe(24)
        if state.get("owner_password") is None or self.storage.unseal(state["owner_password"]) != password:
            state["owner_password"] = self.storage.seal(password)  # recorded before the role gets it
            self.storage.save_state(instance_id, state)
        role = owner_role(instance_id)
        with self.admin.connect(instance_id, port) as admin:
            in_recovery = admin.execute("SELECT pg_is_in_recovery()").fetchone()
            if in_recovery and in_recovery[0]:
                raise TemporaryError(f"instance {instance_id} is read-only; resume runs first")
            ensure_owner(admin, role, password)
            former = former_owners(admin, role)
        for name in former:  # restored from another instance: its owner's tables become ours
            with self.admin.connect(instance_id, port, dbname=DBNAME) as app:
                take_over(app, name, role)
            with self.admin.connect(instance_id, port) as admin:
                take_over(admin, name, role)
                admin.execute(psycopg.sql.SQL("DROP ROLE {}").format(psycopg.sql.Identifier(name)))
        if "plan" not in state:
            state.update(plan=spec.plan, generation=spec.generation)
            self.storage.save_state(instance_id, state)
        ca = self.tls.authority().cert_pem.decode()
        if spec.shape.instances <= 1:
            return ConnectionInfo(
                self.advertise_host, port, DBNAME, role, password, sslmode=SSLMODE, ca_certificate=ca
            )
        # An HA plan's customers connect to its pooler, whose address never changes.
        admin_password = self.storage.unseal(state["admin_password"])
        reader = self.standbys.reader(instance_id, spec.shape.instances)
        logins = {role: password, ADMIN_USER: admin_password}
        pooled = self.pooler.ensure(instance_id, port, reader, logins)
        return ConnectionInfo(
            self.advertise_host,
            pooled,
            DBNAME,
            role,
            password,
            sslmode=SSLMODE,
            ca_certificate=ca,
            pool_mode=POOL_MODE,
            direct=(self.advertise_host, port),
            read_only=(self.advertise_host, pooled, READ_ONLY_DBNAME),
        )

    @step
    def apply_plan(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> bool:
        server = self.servers.require_storage(instance_id)
        # Rolled server by server: the standbys first, the primary last (a hot standby may not run
        # with fewer connections than its primary: when the plan lowers them, the primary first).
        standbys = [
            self._server(instance_id, member=m)
            for m in self.standbys.standby_members(instance_id, spec.shape.instances)
        ]
        standbys = [each for each in standbys if each.initialised]
        lowering = server.is_running() and int(spec.server_settings().get("max_connections", 0)) < int(
            self._live(instance_id, server, ["max_connections"]).get("max_connections", 0)
        )
        changed = False
        if not lowering:
            changed = any([self._apply_to(instance_id, spec, each) for each in standbys])
            # Not a restart of the primary: a switchover to a standby that runs the plan already
            # (writes paused at the pooler meanwhile); the old primary joins it as a standby.
            restarts = standbys and server.is_running() and self._restarts(instance_id, spec, server)
            if restarts and self.standbys.switchover(instance_id, spec, self.pooler) is not None:
                server = self._server(instance_id, member=server.member)
                changed = True
        changed = self._apply_to(instance_id, spec, server) or changed
        if lowering:
            changed = any([self._apply_to(instance_id, spec, each) for each in standbys]) or changed
        changed = self.standbys.ensure(instance_id, spec) or changed
        changed = self._repoint(instance_id, spec) or changed
        state = self.storage.load_state(instance_id)
        applied = (state.get("plan"), state.get("generation"), state.get("allocated_gb"))
        if applied != (spec.plan, spec.generation, spec.volume_gb):
            # The allocation is the control plane's record here (no volume of that size exists):
            # kept beside the plan, what the reconciler holds the database's size to.
            changed = changed or state.get("allocated_gb") != spec.volume_gb
            state.update(plan=spec.plan, generation=spec.generation, allocated_gb=spec.volume_gb)
            self.storage.save_state(instance_id, state)
        return changed

    def _live(self, instance_id: uuid.UUID, server: InstanceServer, names: Collection[str]) -> dict[str, str]:
        with self.admin.connect(instance_id, server.port) as admin:
            return {key: show(admin, key) for key in names}

    def _restarts(self, instance_id: uuid.UUID, spec: InstanceSpec, server: InstanceServer) -> bool:
        """Whether the plan's settings differ from the running server's (applying them restarts it)."""
        return self._live(instance_id, server, spec.server_settings()) != spec.server_settings()

    def _apply_to(self, instance_id: uuid.UUID, spec: InstanceSpec, server: InstanceServer) -> bool:
        """The plan's settings written to one server, restarted when they differ from its live ones."""
        desired = self.servers.settings_for(instance_id, spec, server.member)
        changed = False
        if (server.datadir / "controlplane.conf").read_text() != settings_text(desired):
            server.write_settings(desired)
            changed = True
        if server.is_running():
            if self._restarts(instance_id, spec, server):
                server.restart()
                changed = True
            elif changed:
                server.reload()
        return changed

    @step
    def configure_archive(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> None:
        self.backups.configure_archive(instance_id)

    @step
    def start_standbys(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> bool:
        try:
            changed = self.standbys.ensure(instance_id, spec)
        except Exception:
            # A standby not back (yet): the read-only endpoint meanwhile to the first that streams.
            self._repoint(instance_id, spec)
            raise
        return self._repoint(instance_id, spec) or changed

    def _repoint(self, instance_id: uuid.UUID, spec: InstanceSpec) -> bool:
        """The pooler (where the instance has one) at the primary, its read-only endpoint at the
        first streaming standby (`Standbys.reader`); True when that changed its configuration."""
        if not self.pooler.configured(instance_id):
            return False
        primary = self.network.require_port(instance_id)
        return self.pooler.repoint(
            instance_id, primary, self.standbys.reader(instance_id, spec.shape.instances)
        )

    @step
    def fence_primary(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> str | None:
        return self.standbys.fence(instance_id)

    @step
    def promote_standby(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> Promotion:
        promotion = self.standbys.promote(instance_id, spec)
        self._repoint(instance_id, spec)
        return promotion

    @step
    def switchover(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> Promotion | None:
        promotion = self.standbys.switchover(instance_id, spec, self.pooler)
        # The old primary, a standby now, streams by this time or soon: the read-only endpoint
        # looked again (the first streaming standby).
        self._repoint(instance_id, spec)
        return promotion

    @step
    def suspend(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> bool:
        return self.servers.suspend(instance_id)

    @step
    def resume(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> bool:
        return self.servers.resume(instance_id)

    @step
    def final_backup(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> str | None:
        return self.backups.take_final(instance_id, spec)

    @step
    def deprovision(
        self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, *, skip_backup: bool = False
    ) -> DeprovisionResult:
        directory = self.instance_dir(instance_id)
        server = self._server(instance_id)
        existed = directory.exists() or self.ports.port_of(instance_id) is not None
        backup = None if skip_backup else self.backups.take_final(instance_id, spec)
        held = [] if skip_backup else self.backups.held(instance_id)
        if backup is None and held:
            # No data left to back up (it was lost): the newest backup is what remains, and is kept.
            backup = held[-1].name
        # The archive and backups stay for the plan's retention (a restore of the deleted instance
        # into a new one), unless the deletion skipped the final backup: then nothing is kept.
        self.backups.forget_deleted(instance_id, spec, kept=bool(held))
        self.pooler.stop(instance_id)
        for member in self.standbys.all_members(instance_id):
            each = self._server(instance_id, member=member)
            if each.initialised:
                each.stop("fast")
            stop_strays(each.datadir)
        stop_strays(server.datadir)
        if directory.exists():
            shutil.rmtree(directory)
        self.ports.release(instance_id)
        # Where the final backup is kept (its name is the path's last part, what customers see).
        kept = None if skip_backup or backup is None else self.backups.location(instance_id, backup)
        return DeprovisionResult(backup=kept, removed=existed)

    # ---- reading ---------------------------------------------------------------------------

    @in_thread
    def recovery_window(self, instance_id: uuid.UUID) -> RecoveryWindow | None:
        return self.backups.window(instance_id)

    @in_thread
    def verify_backups(self, instance_id: uuid.UUID) -> str | None:
        return self.backups.verify(instance_id)

    @in_thread
    def expire(self, instance_id: uuid.UUID) -> bool:
        return self.backups.expire(instance_id, dt.datetime.now(dt.UTC))

    @in_thread
    def observe(self, instance_id: uuid.UUID) -> Observation:
        seen = self._observe_primary(instance_id)
        state = self.storage.load_state(instance_id)
        servers = plans.SHAPES[state["plan"]].instances if state.get("plan") in plans.SHAPES else 1
        if servers <= 1 or not state.get("replicating"):
            return seen
        seen = replace(seen, servers=servers)
        if not seen.healthy:
            # The primary is lost: a failover, when a standby can take over (its data is not lost).
            found = self.standbys.candidate(instance_id, servers)
            if found is None:
                return seen
            return replace(seen, exists=True, data_lost=False, failover_to=member_name(found[0]))
        if self.pooler.configured(instance_id) and not self.pooler.is_running(instance_id):
            return replace(seen, healthy=False, detail="pooler not running")
        return seen

    def _observe_primary(self, instance_id: uuid.UUID) -> Observation:
        server = self._server(instance_id)
        state = self.storage.load_state(instance_id)
        port = server.port or None
        endpoint = None if port is None else (self.advertise_host, port)
        plan, generation = state.get("plan"), state.get("generation")
        servers = plans.SHAPES[str(plan)].instances if plan in plans.SHAPES else 1
        if not server.initialised:
            return Observation(
                False,
                endpoint=endpoint,
                detail="data directory missing",
                data_lost=self._had_cluster(instance_id),
                recovery=self.backups.window(instance_id),
            )
        if not server.is_running():
            return Observation(
                True, endpoint=endpoint, plan_applied=plan, generation=generation, detail="server not running"
            )
        replication = None
        try:
            with self.admin.connect(instance_id, server.port, timeout=3) as admin:
                row = admin.execute(OBSERVE, {"dbname": DBNAME}).fetchone()
                recovery = self._archive_window(instance_id, admin)
                if servers > 1 and state.get("replicating") and row and not row[0]:
                    replication = self.standbys.observe(instance_id, admin, servers)
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
        stats = _stats(row)
        if stats is not None and recovery.lag_s is not None:
            stats = replace(stats, archive_lag_s=recovery.lag_s)
        return Observation(
            True,
            stats=stats,
            running=True,
            healthy=True,
            read_only=read_only,
            endpoint=endpoint,
            plan_applied=plan,
            generation=generation,
            detail="read-only (standby mode)" if read_only else "accepting writes",
            recovery=recovery,
            standbys_streaming=None if replication is None else len(replication.streaming),
            replication_detail="" if replication is None else replication.detail,
        )

    def _archive_window(self, instance_id: uuid.UUID, admin: psycopg.Connection[Any]) -> RecoveryWindow:
        window = self.backups.observe_archive(instance_id, admin)
        if not self.repository.has_stanza(instance_id):
            return replace(
                window, archive_healthy=False, archive_detail="no archive yet: its stanza is not made"
            )
        return window

    @in_thread
    def inventory(self) -> list[Resource]:
        found: list[Resource] = []
        if self.root.exists():
            for entry in sorted(self.root.iterdir()):
                instance_id = _as_uuid(entry.name)
                if instance_id is None or not entry.is_dir():
                    continue
                found.append(Resource("data_directory", str(entry), instance_id))
                for rank, member in enumerate(self.standbys.all_members(instance_id)):
                    pid = self._server(instance_id, 0, member).pid()
                    if pid is not None:
                        kind = "server" if rank == 0 else "standby_server"  # the primary first
                        found.append(Resource(kind, f"pid {pid}", instance_id))
                pooler = self.pooler.pid(instance_id)
                if pooler is not None:
                    found.append(Resource("pooler", f"pid {pooler}", instance_id))
        for key, port in sorted(self.ports.table().items(), key=lambda item: item[1]):
            # The first server's port is the instance's `port`; its other servers' and its pooler's
            # are kinds of their own (one port per instance and kind).
            owner, held_by = owner_of(key)
            kind = "port" if held_by == "0" else f"{held_by}_port" if held_by == "pooler" else "standby_port"
            found.append(Resource(kind, str(port), owner))
        return found

    @in_thread
    def start_all(self, instance_ids: Collection[uuid.UUID]) -> list[uuid.UUID]:
        started = []
        for instance_id in instance_ids:
            state = self.storage.load_state(instance_id)
            applied = InstanceSpec.for_removal(
                {"plan": state.get("plan", "dev")}, int(state.get("generation", 1))
            )
            began = False
            # The primary first (its standbys stream from it), then the standbys, then the pooler.
            for member in self.standbys.all_members(instance_id):
                server = self._server(instance_id, member=member)
                if server.port and server.initialised and not server.is_running():
                    # Servers made before a change of the rules get them.
                    self.servers.conform(instance_id, server, applied, member)
                    self.servers.ensure_started(server)
                    began = True
            began = self.pooler.start_configured(instance_id) or began
            if began:
                started.append(instance_id)
        return started

    @in_thread
    def stop_all(self) -> list[uuid.UUID]:
        stopped = []
        if self.root.exists():
            for entry in sorted(self.root.iterdir()):
                instance_id = _as_uuid(entry.name)
                if instance_id is None:
                    continue
                ended = self.pooler.stop(instance_id)
                for member in reversed(self.standbys.all_members(instance_id)):
                    server = self._server(instance_id, member=member)
                    if server.is_running():
                        server.stop()
                        ended = True
                if ended:
                    stopped.append(instance_id)
        return stopped

    # ---- backups, restore, the CA -----------------------------------------------------------

    @step
    def take_backup(
        self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, *, kind: str = "on_demand"
    ) -> BackupInfo:
        return self.backups.take(instance_id, spec, kind)

    @in_thread
    def list_backups(self, instance_id: uuid.UUID) -> list[BackupInfo]:
        return self.backups.held(instance_id)

    @step
    def restore(
        self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, *, point: RestorePoint
    ) -> Restored:
        return self.backups.restore(instance_id, spec, fence, point)

    @in_thread
    def ca_certificate(self) -> str | None:
        return self.tls.authority().cert_pem.decode()

    def roles(self, instance_id: uuid.UUID) -> list[str]:
        """Login roles of the instance's server other than the control plane's own (for checks)."""
        port = self.network.require_port(instance_id)
        with self.admin.connect(instance_id, port) as admin:
            rows = admin.execute(
                "SELECT rolname FROM pg_roles WHERE rolcanlogin AND rolname <> %s ORDER BY 1", (ADMIN_USER,)
            ).fetchall()
        return [row[0] for row in rows]


# What observe reads, in one round trip: whether the server is read-only, and the customer
# database's own metrics (the control plane's admin sessions are not counted as connections).
OBSERVE = """
SELECT pg_is_in_recovery(), s.*
FROM (SELECT 1) AS one LEFT JOIN (
    SELECT (SELECT count(*) FROM pg_stat_activity a
            WHERE a.backend_type = 'client backend' AND a.usename <> current_user)::int AS connections,
           current_setting('max_connections')::int AS max_connections,
           d.xact_commit + d.xact_rollback AS transactions, d.tup_returned AS rows_read,
           d.tup_inserted + d.tup_updated + d.tup_deleted AS rows_written,
           d.blks_hit AS blocks_hit, d.blks_read AS blocks_read, pg_database_size(d.datid) AS size_bytes
    FROM pg_stat_database d WHERE d.datname = %(dbname)s
) AS s ON true
"""


def _stats(row: tuple[Any, ...] | None) -> DatabaseStats | None:
    """The customer database's metrics from observe's row (None before its database exists)."""
    if row is None or row[1] is None:
        return None
    return DatabaseStats(*(int(value) for value in row[1:9]))


def _as_uuid(text: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(text)
    except ValueError:
        return None
