"""Standbys: the streaming standbys an HA plan's instance runs beside its primary, how they are seeded
and watched, and the failover (fence the lost primary, promote the most advanced standby).

Each standby is seeded from the running primary with `pg_basebackup` (as the server user, over
TLS), runs in its own data directory on its own port, and streams from the primary under its name
(`replication.member_name`). The primary waits for any one of them at each commit once they were
started (`state.json`'s `replicating`): an acknowledged commit is on two servers, and with the only
standby down, commits wait (no acknowledged write is ever on one server only).

A failover never promotes while the old primary could still take a write: the fence stops it
(immediately, and every process left on its data directory) and marks its data directory a
standby's, so nothing starts it as a primary again; it is rebuilt as a standby from the new
primary (a fresh seed: its diverged end, never acknowledged, is discarded).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

import psycopg

from controlplane.core.step_errors import TemporaryError
from controlplane.runtime.logs import first_line
from controlplane.runtime.postgres import make_owned_dir
from provisioners.base import InstanceSpec, Promotion
from provisioners.local.database import ADMIN_USER, Admin
from provisioners.local.network import Network
from provisioners.local.pooler import Pooler
from provisioners.local.replication import member_name
from provisioners.local.server import STANDBY_SIGNAL, InstanceServer, Servers, kill_everything_in, stop_strays
from provisioners.local.storage import Storage
from provisioners.local.wal import parse_lsn

log = logging.getLogger(__name__)

# How long a started standby may take to stream from its primary.
STREAMING_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Replication:
    """What the primary says of its standbys: those expected, and the names of those streaming."""

    expected: int
    streaming: tuple[str, ...]
    synchronous: bool

    @property
    def degraded(self) -> bool:
        return len(self.streaming) < self.expected

    @property
    def detail(self) -> str:
        if self.expected == 0:
            return ""
        return f"{len(self.streaming)} of {self.expected} standbys streaming" + (
            " (commits wait for one)" if self.synchronous else " (commits do not wait yet)"
        )


class Standbys:
    """The standbys of each HA instance: seeded, started, watched, and promoted in a failover."""

    def __init__(self, storage: Storage, network: Network, servers: Servers, admin: Admin) -> None:
        self.storage = storage
        self.network = network
        self.servers = servers
        self.admin = admin

    # ---- membership --------------------------------------------------------------------------

    def standby_members(self, instance_id: uuid.UUID, servers: int) -> list[int]:
        """The members that are the instance's standbys for a shape of `servers` servers: the
        lowest-numbered ones besides the primary."""
        primary = self.storage.primary_member(instance_id)
        return [m for m in range(servers + 1) if m != primary][: max(0, servers - 1)]

    def extra_members(self, instance_id: uuid.UUID, servers: int) -> list[int]:
        """Servers the instance has beyond its shape (left by a larger plan)."""
        keep = {self.storage.primary_member(instance_id), *self.standby_members(instance_id, servers)}
        return [
            m
            for m in self._on_disk(instance_id)
            if m not in keep and self._member(instance_id, m).initialised
        ]

    def _on_disk(self, instance_id: uuid.UUID) -> list[int]:
        """The members whose data directory exists (the first one's is looked for too)."""
        directory = self.storage.instance_dir(instance_id)
        found = {0}
        if directory.exists():
            for path in directory.iterdir():
                number = path.name.removeprefix("pgdata-")
                if path.name.startswith("pgdata-") and number.isdigit() and path.is_dir():
                    found.add(int(number))
        return sorted(found)

    def _member(self, instance_id: uuid.UUID, member: int) -> InstanceServer:
        return self.servers.server(instance_id, member=member)

    def all_members(self, instance_id: uuid.UUID) -> list[int]:
        """Every server the instance has on disk, the primary first."""
        primary = self.storage.primary_member(instance_id)
        return [primary, *(m for m in self._on_disk(instance_id) if m != primary)]

    # ---- standing up -------------------------------------------------------------------------

    def ensure(self, instance_id: uuid.UUID, spec: InstanceSpec) -> bool:
        """Every standby of the shape seeded, configured and streaming, a standby left by a larger
        plan removed; then commits wait for one. True when something changed."""
        servers = spec.shape.instances
        changed = False
        for member in self.extra_members(instance_id, servers):
            self._remove(instance_id, member)
            changed = True
        if servers <= 1:
            state = self.storage.load_state(instance_id)
            if state.pop("replicating", None) is not None:
                self.storage.save_state(instance_id, state)
            return changed
        primary = self.servers.server(instance_id)
        if not primary.is_running():
            raise TemporaryError(f"instance {instance_id}: its primary is not running; standbys need it")
        rebuild = set(self.storage.load_state(instance_id).get("rebuild", []))
        members = self.standby_members(instance_id, servers)
        for member in members:
            changed = self._ensure_member(instance_id, spec, member, member in rebuild) or changed
        self._wait_streaming(instance_id, primary, [member_name(m) for m in members])
        state = self.storage.load_state(instance_id)
        if not state.get("replicating") or state.get("rebuild"):
            state["replicating"] = True
            state.pop("rebuild", None)
            self.storage.save_state(instance_id, state)
            changed = True
        changed = self.servers.conform(instance_id, primary, spec) or changed
        return changed

    def _ensure_member(self, instance_id: uuid.UUID, spec: InstanceSpec, member: int, rebuild: bool) -> bool:
        server = self._member(instance_id, member)
        changed = False
        if rebuild or not server.initialised:
            self._seed(instance_id, member)
            server = self._member(instance_id, member)
            changed = True
        server.port = self.network.port_to_start_on(instance_id, server, member)
        changed = self.servers.conform(instance_id, server, spec, member) or changed
        signal_file = server.datadir / STANDBY_SIGNAL
        if not signal_file.exists():
            signal_file.touch()
            self.storage.chown(signal_file)
            if server.is_running():  # a former primary, running as one: it must not
                server.stop("immediate")
        if not server.is_running():
            self.servers.ensure_started(server)
            changed = True
        return changed

    def _seed(self, instance_id: uuid.UUID, member: int) -> None:
        """A fresh copy of the primary's data for `member` (pg_basebackup into a partial directory,
        renamed into place); what was there (a fenced former primary) is removed."""
        datadir = self.storage.member_datadir(instance_id, member)
        stop_strays(datadir)
        old = self._member(instance_id, member)
        if old.is_running():
            old.stop("immediate")
        if datadir.exists():
            shutil.rmtree(datadir)
        partial = datadir.with_name(f"{datadir.name}.partial")
        if partial.exists():
            shutil.rmtree(partial)
        make_owned_dir(partial, self.storage.run_as)
        primary = self.servers.server(instance_id)
        state = self.storage.load_state(instance_id)
        tool = replace(
            self.servers.server(instance_id, port=0, member=member),
            datadir=partial,
            env={
                **primary.env,
                "PGPASSWORD": self.storage.unseal(state["admin_password"]),
                "PGSSLMODE": "verify-full",
                "PGSSLROOTCERT": str(self.admin.tls.store.cert_path),
                # No client certificate is looked for in the caller's home (root's, unreadable).
                "HOME": str(self.storage.instance_dir(instance_id)),
            },
        )
        result = tool.run_tool(
            "pg_basebackup",
            [
                f"--host={self.network.connect_host}",
                f"--port={primary.port}",
                f"--username={ADMIN_USER}",
                "--no-password",
                f"--pgdata={partial}",
                "--wal-method=stream",
                "--checkpoint=fast",
            ],
            timeout=3600,
        )
        if result.returncode != 0:
            raise TemporaryError(
                f"seeding {member_name(member)} of {instance_id} failed: {result.stdout.strip()}"
            )
        os.replace(partial, datadir)
        log.info("instance %s: %s seeded from the primary", instance_id, member_name(member))

    def _remove(self, instance_id: uuid.UUID, member: int) -> None:
        server = self._member(instance_id, member)
        server.stop("fast")
        stop_strays(server.datadir)
        shutil.rmtree(server.datadir, ignore_errors=True)

    def _wait_streaming(self, instance_id: uuid.UUID, primary: InstanceServer, names: list[str]) -> None:
        deadline = time.monotonic() + STREAMING_TIMEOUT_S
        while True:
            streaming = set(self._streaming(instance_id, primary.port))
            if set(names) <= streaming:
                return
            if time.monotonic() > deadline:
                lagging = sorted(set(names) - streaming)
                # Seeded again on the next attempt (its history may have diverged from the primary's).
                state = self.storage.load_state(instance_id)
                members = {int(name.removeprefix("member")) for name in lagging}
                state["rebuild"] = sorted({*state.get("rebuild", []), *members})
                self.storage.save_state(instance_id, state)
                missing = ", ".join(lagging)
                raise TemporaryError(f"instance {instance_id}: {missing} not streaming from the primary")
            time.sleep(0.2)

    def _streaming(self, instance_id: uuid.UUID, port: int) -> list[str]:
        with self.admin.connect(instance_id, port, timeout=3) as admin:
            rows = admin.execute(
                "SELECT application_name FROM pg_stat_replication WHERE state = 'streaming'"
            ).fetchall()
        return [str(row[0]) for row in rows]

    # ---- watching ----------------------------------------------------------------------------

    def observe(self, instance_id: uuid.UUID, admin: psycopg.Connection[Any], servers: int) -> Replication:
        """The primary's standbys as its own view says (on the session `admin` has open)."""
        expected = self.standby_members(instance_id, servers)
        names = {member_name(m) for m in expected}
        rows = admin.execute("SELECT application_name FROM pg_stat_replication WHERE state = 'streaming'")
        streaming = tuple(sorted(names & {str(row[0]) for row in rows.fetchall()}))
        synchronous = bool(self.storage.load_state(instance_id).get("replicating"))
        return Replication(len(expected), streaming, synchronous)

    def candidate(self, instance_id: uuid.UUID, servers: int) -> tuple[int, int] | None:
        """The most advanced running standby (member, WAL position received), or None."""
        best: tuple[int, int] | None = None
        for member in self.standby_members(instance_id, servers):
            position = self._received(instance_id, member)
            if position is not None and (best is None or position > best[1]):
                best = (member, position)
        return best

    def _received(self, instance_id: uuid.UUID, member: int) -> int | None:
        """How far a running standby has WAL (received, else replayed); None: not a standby now."""
        server = self._member(instance_id, member)
        if not server.port or not server.is_running():
            return None
        try:
            with self.admin.connect(instance_id, server.port, timeout=3) as admin:
                row = admin.execute(
                    "SELECT pg_is_in_recovery(), pg_last_wal_receive_lsn(), pg_last_wal_replay_lsn()"
                ).fetchone()
        except psycopg.Error:
            return None
        if row is None or not row[0]:
            return None
        return max(parse_lsn(str(row[1] or "0/0")), parse_lsn(str(row[2] or "0/0")))

    def reader(self, instance_id: uuid.UUID, servers: int) -> int | None:
        """The port of the standby the read-only endpoint leads to: the first one (lowest member)
        streaming from the primary; when none streams (the primary lost, the standbys down or
        catching up), the first one all the same, never the primary: only a server in recovery
        refuses every write whatever a session sets, so reads there wait at the pooler for it (and
        fail if it is not back in time). None: the shape has no standby (or it has no port yet)."""
        members = self.standby_members(instance_id, servers)
        ports = {m: self._member(instance_id, m).port for m in members}
        members = [m for m in members if ports[m]]
        if not members:
            return None
        primary = self.servers.server(instance_id)
        streaming: set[str] = set()
        if primary.port and primary.is_running():
            try:
                streaming = set(self._streaming(instance_id, primary.port))
            except psycopg.Error as exc:  # no standby is known to stream: the first one, then
                log.warning(
                    "instance %s: the primary did not say which standby streams (%s); reads go to %s",
                    instance_id,
                    first_line(exc),
                    member_name(members[0]),
                )
        first = next((m for m in members if member_name(m) in streaming), members[0])
        return ports[first]

    # ---- failover ----------------------------------------------------------------------------

    def fence(self, instance_id: uuid.UUID) -> str | None:
        """The primary can never take another write: stopped at once (and any process left on its
        data directory), its data directory marked a standby's, to be rebuilt. Refused while it
        answers as a writable primary (there is nothing to fail over from). Returns its name."""
        state = self.storage.load_state(instance_id)
        primary = self.storage.primary_member(instance_id)
        if state.get("fenced") == primary:
            return member_name(primary)  # fenced already (this step ran before)
        server = self._member(instance_id, primary)
        if server.is_running() and server.port and self._writable(instance_id, server.port):
            raise TemporaryError(f"instance {instance_id}: its primary answers and takes writes; no failover")
        # Every process of it, also the backends a killed postmaster left (they could still serve
        # their sessions): none may answer again.
        kill_everything_in(server.datadir)
        server.wait_until_down(10)
        if server.is_running():
            raise TemporaryError(f"instance {instance_id}: its old primary could not be stopped")
        if server.datadir.exists():
            signal_file = server.datadir / STANDBY_SIGNAL
            signal_file.touch()
            self.storage.chown(signal_file)
        state = self.storage.load_state(instance_id)
        state["fenced"] = primary
        state["rebuild"] = sorted({*state.get("rebuild", []), primary})
        self.storage.save_state(instance_id, state)
        log.warning("instance %s: %s fenced (stopped, marked a standby)", instance_id, member_name(primary))
        return member_name(primary)

    def _writable(self, instance_id: uuid.UUID, port: int) -> bool:
        try:
            with self.admin.connect(instance_id, port, timeout=3) as admin:
                row = admin.execute("SELECT pg_is_in_recovery()").fetchone()
        except psycopg.Error:
            return False
        return bool(row is not None and not row[0])

    def promote(self, instance_id: uuid.UUID, spec: InstanceSpec) -> Promotion:
        """The most advanced standby promoted, once the old primary is fenced; the instance's
        record names it the primary, and the other standbys stream from it."""
        state = self.storage.load_state(instance_id)
        primary = self.storage.primary_member(instance_id)
        done = state.get("promotion")
        if state.get("fenced") is not None and state["fenced"] != primary and done:
            return Promotion(**done)  # promoted already (this step ran before)
        if state.get("fenced") != primary:
            raise TemporaryError(f"instance {instance_id}: its primary is not fenced; no promotion before")
        found = self.candidate(instance_id, spec.shape.instances)
        if found is None:
            raise TemporaryError(f"instance {instance_id}: no running standby to promote")
        promotion = self._promote(instance_id, spec, found, primary)
        state = self.storage.load_state(instance_id)
        # The other standbys' settings (their new upstream).
        for other in self.standby_members(instance_id, spec.shape.instances):
            standby = self._member(instance_id, other)
            if standby.initialised and other not in state.get("rebuild", []):
                self.servers.conform(instance_id, standby, spec, other)
        log.warning(
            "instance %s: %s promoted at %s (%s fenced)",
            instance_id,
            promotion.promoted,
            promotion.lsn,
            promotion.fenced,
        )
        return promotion

    def _promote(
        self, instance_id: uuid.UUID, spec: InstanceSpec, found: tuple[int, int], old: int
    ) -> Promotion:
        """The standby `found` (member, WAL position) promoted in place of the member `old`: the
        instance's record names it the primary, its settings are a primary's (no upstream)."""
        member, position = found
        server = self._member(instance_id, member)
        with self.admin.connect(instance_id, server.port) as admin:
            promoted = admin.execute("SELECT pg_promote(true, 60)").fetchone()
        if not (promoted and promoted[0]):
            raise TemporaryError(
                f"instance {instance_id}: {member_name(member)} did not finish its promotion"
            )
        (server.datadir / STANDBY_SIGNAL).unlink(missing_ok=True)
        lsn = f"{position >> 32:X}/{position & 0xFFFFFFFF:X}"
        promotion = Promotion(member_name(member), member_name(old), lsn, dt.datetime.now(dt.UTC).isoformat())
        state = self.storage.load_state(instance_id)
        state.update(primary=member, promotion=promotion.as_dict())
        self.storage.save_state(instance_id, state)
        self.servers.conform(instance_id, server, spec, member)
        return promotion

    # ---- switchover --------------------------------------------------------------------------

    def switchover(self, instance_id: uuid.UUID, spec: InstanceSpec, pooler: Pooler) -> Promotion | None:
        """A planned change of primary, writes paused at the pooler meanwhile: the primary stopped
        cleanly (its standbys receive all its WAL before it goes), the most advanced standby
        promoted once it has all of it, the pooler re-pointed, the old primary restarted as a
        standby of the new one. None when there is no standby to switch to."""
        servers = spec.shape.instances
        old = self.storage.primary_member(instance_id)
        primary = self._member(instance_id, old)
        if servers <= 1 or self.candidate(instance_id, servers) is None:
            return None
        admin_password = self.storage.unseal(self.storage.load_state(instance_id)["admin_password"])
        pooler.console(instance_id, admin_password, "PAUSE")
        try:
            primary.stop("fast")
            end = parse_lsn(primary.control_data()["Latest checkpoint location"])
            found = self._caught_up(instance_id, servers, end)
            promotion = self._promote(instance_id, spec, found, old)
            pooler.repoint(
                instance_id, self._member(instance_id, found[0]).port, self.reader(instance_id, servers)
            )
            # The old primary, shut down cleanly, follows the new one onto its timeline.
            signal_file = primary.datadir / STANDBY_SIGNAL
            signal_file.touch()
            self.storage.chown(signal_file)
            for other in self.standby_members(instance_id, servers):
                standby = self._member(instance_id, other)
                if standby.initialised:
                    self.servers.conform(instance_id, standby, spec, other)
            self.servers.ensure_started(self._member(instance_id, old))
        finally:
            pooler.console(instance_id, admin_password, "RESUME")
        log.warning("instance %s: switched over to %s at %s", instance_id, promotion.promoted, promotion.lsn)
        return promotion

    def _caught_up(self, instance_id: uuid.UUID, servers: int, end: int) -> tuple[int, int]:
        """The most advanced standby once it has received the stopped primary's WAL up to `end`."""
        deadline = time.monotonic() + 30
        while True:
            found = self.candidate(instance_id, servers)
            if found is not None and found[1] > end:  # past the shutdown checkpoint's start
                return found
            if time.monotonic() > deadline:
                raise TemporaryError(f"instance {instance_id}: no standby received the primary's last WAL")
            time.sleep(0.05)
