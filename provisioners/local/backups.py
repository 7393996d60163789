"""Backups and restores on pgBackRest: each instance's continuous archive and backups (full and
differential, the plan's retention), restores in place and into a new instance, verification.

One engine: the WAL archive, the scheduled and on-demand backups and the final backup of a deletion
are all in the instance's stanza, which outlives the instance until its retention runs out.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg

from controlplane.core.failures import RESTORE_SOURCE_UNAVAILABLE
from controlplane.core.step_errors import PermanentError, TemporaryError
from controlplane.runtime.postgres import PostgresError, make_owned_dir
from provisioners.base import (
    BACKUP_KINDS,
    BackupInfo,
    InstanceSpec,
    RecoveryWindow,
    Restored,
    RestorePoint,
    RestoreSource,
)
from provisioners.local.database import ADMIN_USER, Admin
from provisioners.local.network import Network
from provisioners.local.repository import KIND_ANNOTATION, PgTarget, Repository, StanzaBackup, StanzaInfo
from provisioners.local.server import SET_ASIDE_SIGNAL, STANDBY_SIGNAL, InstanceServer, Servers, stop_strays
from provisioners.local.storage import Storage
from provisioners.local.wal import Coverage, Mark, advance, parse_lsn, restart, seconds_between, segment_end

log = logging.getLogger(__name__)

# Files a restored cluster must not keep: the old server's run state, and the signals that would
# start it as a standby (pgBackRest's recovery.signal stays: the restore replays the archive).
NOT_RESTORED = ("postmaster.pid", "postmaster.opts", STANDBY_SIGNAL, SET_ASIDE_SIGNAL)
# What PostgreSQL says when a point-in-time target lies after the last commit the archive holds.
TARGET_NOT_REACHED = "recovery ended before configured recovery target was reached"
# How long a restore may replay before the step gives up (the job retries it).
RECOVERY_TIMEOUT_S = 3600.0
# The observation's look at the archiver, and a mark of how far the server's WAL went.
ARCHIVE_QUERY = """
SELECT now() AS at,
       current_setting('archive_mode') AS archive_mode,
       pg_is_in_recovery() AS in_recovery,
       CASE WHEN pg_is_in_recovery() THEN NULL ELSE pg_current_wal_flush_lsn()::text END AS flushed,
       pg_snapshot_xmax(pg_current_snapshot())::text AS next_xid,
       pg_snapshot_xmin(pg_current_snapshot()) = pg_snapshot_xmax(pg_current_snapshot()) AS idle,
       a.last_archived_wal, a.last_archived_time, a.last_failed_wal, a.last_failed_time
FROM pg_stat_archiver a
"""


class Backups:
    """Each instance's stanza in the repository: archive, backups, restores, verification."""

    def __init__(
        self, storage: Storage, network: Network, servers: Servers, admin: Admin, repository: Repository
    ) -> None:
        self.storage = storage
        self.network = network
        self.servers = servers
        self.admin = admin
        self.repository = repository

    def _target(self, instance_id: uuid.UUID, server: InstanceServer) -> PgTarget:
        return PgTarget(server.datadir, server.port, self.storage.socket_dir(instance_id))

    # ---- the archive -----------------------------------------------------------------------------

    def configure_archive(self, instance_id: uuid.UUID) -> None:
        """The instance's stanza made (or upgraded to a new cluster) and checked: a switched WAL
        segment reaches the archive. A server started before it archived restarts once."""
        server = self.servers.require_storage(instance_id)
        server.port = self.network.require_port(instance_id)
        if not server.is_running():
            raise TemporaryError(f"instance {instance_id} is not running; its archive needs its server")
        self.repository.remember_admin(instance_id, self.repository.admin_password(instance_id))
        with self.admin.connect(instance_id, server.port) as admin:
            row = admin.execute(
                "SELECT current_setting('archive_mode'), current_setting('archive_command'),"
                " pg_is_in_recovery()"
            ).fetchone()
        assert row is not None
        mode, command, in_recovery = row
        if mode != "on" or "archive-push" not in command:
            log.info("instance %s: restarting its server to start archiving", instance_id)
            server.restart()
        self.repository.ensure_stanza(instance_id, PgTarget(server.datadir))
        if not in_recovery:  # a standby (suspended) archives nothing: checked once it is resumed
            self.repository.check(instance_id, self._target(instance_id, server))

    def observe_archive(self, instance_id: uuid.UUID, admin: psycopg.Connection[Any]) -> RecoveryWindow:
        """The archiver's health and a new mark of the server's WAL: how far the archive covers the
        instance's writes (kept in its record), as the recoverable window."""
        row = admin.execute(ARCHIVE_QUERY).fetchone()
        assert row is not None
        (at, mode, in_recovery, flushed, next_xid, idle, archived, archived_at, _failed, failed_at) = row
        mark = None if flushed is None else Mark(at, parse_lsn(flushed), int(next_xid), bool(idle))
        with self.repository.updating(instance_id) as record:
            coverage = advance(Coverage.from_json(record.get("coverage")), mark, segment_end(archived))
            record["coverage"] = coverage.as_json()
            if mark is not None:
                record["last_seen_at"] = at.isoformat()
            earliest = record.get("earliest")
        failing = failed_at is not None and (archived_at is None or failed_at > archived_at)
        if not (failing or in_recovery) and _overdue(coverage, at, self.repository.archive_timeout_s):
            # Writes older than archive_timeout are still in an open segment (the server's own timer
            # was seen to skip switches): closed here, so the archive's lag stays bounded.
            admin.execute("SELECT pg_switch_wal()")
        detail = ""
        if in_recovery:
            pass  # a standby (suspended) archives nothing; its primary run's archive is what counts
        elif mode != "on":
            detail = "archive_mode is off: the server was started before it archived"
        elif failing:
            detail = _archive_error(self.storage.datadir(instance_id)) or "archive-push fails"
        return RecoveryWindow(
            earliest=earliest,
            latest=None if coverage.latest is None else coverage.latest.isoformat(),
            archive_healthy=None if in_recovery else not detail,
            archive_detail=detail,
            lag_s=seconds_between(coverage.latest, at),
            lag_bytes=coverage.lag_bytes(),
            last_archived_at=None if archived_at is None else archived_at.isoformat(),
            observed_at=at.isoformat(),
        )

    def window(self, instance_id: uuid.UUID) -> RecoveryWindow | None:
        """The window as last recorded (no server is asked): for an instance lost, or deleted."""
        record = self.repository.record(instance_id)
        if not record:
            return None
        coverage = Coverage.from_json(record.get("coverage"))
        latest = max(
            (moment for moment in (coverage.latest, _at(record.get("final_at"))) if moment is not None),
            default=None,
        )
        return RecoveryWindow(
            earliest=record.get("earliest"),
            latest=None if latest is None else latest.isoformat(),
            lag_bytes=coverage.lag_bytes(),
            observed_at=record.get("last_seen_at"),
            retained_until=record.get("retained_until"),
        )

    # ---- backups -----------------------------------------------------------------------------------

    def take(self, instance_id: uuid.UUID, spec: InstanceSpec, kind: str) -> BackupInfo:
        """A pgBackRest backup of the running instance: full when the plan's schedule says so (or
        none is held), else differential; then the plan's retention (pgBackRest expires the rest)."""
        if kind not in BACKUP_KINDS:
            raise PermanentError(f"unknown backup kind {kind!r}; kinds are {', '.join(BACKUP_KINDS)}")
        server = self.servers.require_storage(instance_id)
        server.port = self.network.require_port(instance_id)
        if not server.is_running():
            raise TemporaryError(f"instance {instance_id} is not running; a backup needs its server")
        self.repository.remember_admin(instance_id, self.repository.admin_password(instance_id))
        schedule = spec.backup_schedule()
        held = self.repository.info(instance_id).backups
        fulls = [b for b in held if b.type == "full"]
        due = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=schedule.full_interval_s * 0.9)
        backup_type = (
            "full" if schedule.full_every <= 1 or not fulls or fulls[-1].stopped_at < due else "diff"
        )
        options = [
            f"--type={backup_type}",
            f"--annotation={KIND_ANNOTATION}={kind}",
            "--repo1-retention-full-type=count",
            f"--repo1-retention-full={max(1, schedule.keep)}",
            f"--repo1-retention-diff={max(1, schedule.full_every)}",
        ]
        if self.admin.in_recovery(instance_id, server.port):
            # A suspended instance changes nothing: its newest backup and archive already hold it.
            raise PermanentError(
                f"instance {instance_id} is read-only (suspended): back it up once it is resumed"
            )
        result = self.repository.run(instance_id, "backup", options, target=self._target(instance_id, server))
        self.repository.must(result, f"the {backup_type} backup of {instance_id}")
        info = self._record_info(instance_id)
        if not info.backups:
            raise TemporaryError(f"the backup of {instance_id} is not listed by the repository")
        return self._backup_info(instance_id, info.backups[-1])

    def _record_info(self, instance_id: uuid.UUID) -> StanzaInfo:
        info = self.repository.info(instance_id)
        with self.repository.updating(instance_id) as record:
            record["earliest"] = None if info.earliest is None else info.earliest.isoformat()
        return info

    def held(self, instance_id: uuid.UUID) -> list[BackupInfo]:
        """The instance's backups (of its current cluster), oldest first."""
        if not self.repository.has_stanza(instance_id):
            return []
        return [self._backup_info(instance_id, b) for b in self.repository.info(instance_id).backups]

    def _backup_info(self, instance_id: uuid.UUID, backup: StanzaBackup) -> BackupInfo:
        return BackupInfo(
            name=backup.label,
            instance_id=instance_id,
            completed_at=backup.stopped_at.isoformat(),
            kind=backup.kind if backup.kind in BACKUP_KINDS else "scheduled",
            size_bytes=backup.repository_bytes,
            location=self.location(instance_id, backup.label),
            type=backup.type,
        )

    def location(self, instance_id: uuid.UUID, label: str) -> str:
        """Where a backup is kept (SREs' words): its directory in the repository."""
        return str(self.repository.repo / "backup" / self.repository.stanza(instance_id) / label)

    def take_final(self, instance_id: uuid.UUID, spec: InstanceSpec) -> str | None:
        """The final backup's name: the one recorded (if the repository still has it), else a new
        one; None when there is no cluster to back up. It ends the instance's recoverable window."""
        record = self.repository.record(instance_id)
        server = self.servers.server(instance_id)
        final: str | None = record.get("final_backup")
        if final and final in {b.name for b in self.held(instance_id)}:
            return final
        if not server.initialised:
            return None
        if server.port == 0:
            server.port = self.network.ports.allocate(instance_id)
        self.servers.ensure_started(server)
        if self.admin.in_recovery(instance_id, server.port):
            # A suspended instance is a standby: it is made writable for the backup only, by no one
            # else (the server is being deleted), and its last WAL archived.
            self.servers.resume(instance_id)
        if not self.repository.has_stanza(instance_id):
            self.configure_archive(instance_id)
        taken = self.take(instance_id, spec, "final")
        with self.repository.updating(instance_id) as record:
            record["final_backup"] = taken.name
            record["final_at"] = taken.completed_at
        return taken.name

    def forget_deleted(self, instance_id: uuid.UUID, spec: InstanceSpec, kept: bool) -> None:
        """After a deletion: the stanza is kept until its retention runs out (when a final backup or
        earlier ones exist), else removed with the record."""
        if not kept:
            self.repository.delete_stanza(instance_id)
            return
        schedule = spec.backup_schedule()
        until = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=schedule.full_interval_s * schedule.keep)
        with self.repository.updating(instance_id) as record:
            record.setdefault("deleted_at", dt.datetime.now(dt.UTC).isoformat())
            record.setdefault("retained_until", until.isoformat())

    def expire(self, instance_id: uuid.UUID, now: dt.datetime) -> bool:
        """A deleted instance's stanza removed once its retention ran out."""
        until = _at(self.repository.record(instance_id).get("retained_until"))
        if until is None or now < until:
            return False
        self.repository.delete_stanza(instance_id)
        return True

    def verify(self, instance_id: uuid.UUID) -> str | None:
        if not self.repository.has_stanza(instance_id):
            return None
        problem = self.repository.verify(instance_id)
        with self.repository.updating(instance_id) as record:
            record["verified_at"] = dt.datetime.now(dt.UTC).isoformat()
            record["verify_problem"] = problem
        return problem

    # ---- restores ----------------------------------------------------------------------------------

    def restore(
        self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, point: RestorePoint
    ) -> Restored:
        """The cluster put back in place of whatever is there (set aside): to the end of the archive,
        from one backup as it was, or a new empty one (its loss accepted)."""
        state = self.storage.load_state(instance_id)
        recorded = self.repository.record(instance_id).get("admin_password")
        if recorded and not point.empty:
            # The restored cluster knows the admin password its stanza recorded (the state may be
            # gone with the instance directory, or remade since).
            state["admin_password"] = recorded
        state = self.storage.prepare_instance(instance_id, state)
        self.storage.save_state(instance_id, state)
        server = self.servers.server(instance_id)
        if server.is_running():
            server.stop("fast")
        stop_strays(server.datadir)
        self.storage.set_aside(instance_id)
        record = self.repository.record(instance_id)
        before = Coverage.from_json(record.get("coverage"))
        if point.empty:
            self.servers.build_cluster(instance_id, spec, fence, state)
            with self.repository.updating(instance_id) as rec:
                rec["coverage"] = Coverage().as_json()
            return Restored()
        if point.backup is not None:
            if point.backup not in {b.name for b in self.held(instance_id)}:
                raise PermanentError(f"instance {instance_id} has no backup {point.backup!r}")
            options = [f"--set={point.backup}", "--type=immediate", "--target-action=promote"]
        else:
            options = []  # everything archived, from the newest backup
        recovered_to = self._restore_cluster(instance_id, spec, fence, str(instance_id), options)
        covered = before.latest
        last_seen = _at(record.get("last_seen_at"))
        with self.repository.updating(instance_id) as rec:
            rec["coverage"] = (restart(before) if point.backup is None else Coverage()).as_json()
        self.storage.save_state(
            instance_id,
            {
                **self.storage.load_state(instance_id),
                "cluster_created_at": state.get("cluster_created_at") or dt.datetime.now(dt.UTC).isoformat(),
                "restored_from": point.backup or "archive",
            },
        )
        if point.backup is not None:
            return Restored(recovered_to=recovered_to, backup=point.backup)
        return Restored(
            recovered_to=recovered_to,
            covered_until=None if covered is None else covered.isoformat(),
            lost_s=seconds_between(covered, last_seen) if covered is not None else None,
        )

    def restore_new(
        self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, source: RestoreSource
    ) -> None:
        """A new instance's cluster from another instance's stanza (live or deleted): a point in
        time, a backup, or everything archived. Its own archive starts with its first run."""
        if not self.repository.has_stanza(source.instance_id):
            raise PermanentError(
                f"instance {source.instance_id} has no archive to restore from",
                code=RESTORE_SOURCE_UNAVAILABLE,
            )
        state = self.storage.load_state(instance_id)
        # The restored cluster knows the source's admin password: the new instance takes it.
        state["admin_password"] = self.repository.admin_password(source.instance_id)
        state = self.storage.prepare_instance(instance_id, state)
        self.storage.save_state(instance_id, state)
        options: list[str] = []
        if source.backup is not None:
            options.append(f"--set={source.backup}")
        if source.point_in_time is not None:
            moment = dt.datetime.fromisoformat(source.point_in_time).astimezone(dt.UTC)
            target = moment.strftime("%Y-%m-%d %H:%M:%S.%f+00")
            options += ["--type=time", f"--target={target}", "--target-action=promote"]
        elif source.backup is not None:
            options += ["--type=immediate", "--target-action=promote"]
        self._restore_cluster(instance_id, spec, fence, str(source.instance_id), options)
        self.storage.save_state(
            instance_id,
            {
                **self.storage.load_state(instance_id),
                "cluster_created_at": dt.datetime.now(dt.UTC).isoformat(),
                "restored_from": source.as_dict(),
            },
        )

    def _restore_cluster(
        self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, stanza: str, options: list[str]
    ) -> str | None:
        """pgBackRest restore of `stanza` into a partial directory, the instance's own settings
        written (its archive goes to its own stanza), renamed into place, then replayed to its
        target and promoted on a start no client can reach. Returns the recovery point."""
        directory = self.storage.instance_dir(instance_id)
        datadir = self.storage.datadir(instance_id)
        for stale in directory.glob("pgdata.restoring-*"):
            shutil.rmtree(stale, ignore_errors=True)
        partial = directory / f"pgdata.restoring-{fence}"
        make_owned_dir(partial, self.storage.run_as)
        # The replay fetches WAL from the source's stanza, into the data directory's final place.
        fetch = (
            f"pgbackrest --config={self.repository.config} --stanza={stanza} --pg1-path={datadir}"
            ' archive-get %f "%p"'
        )
        result = self.repository.run(
            instance_id,
            "restore",
            [*options, f"--recovery-option=restore_command={fetch}"],
            target=PgTarget(partial),
            stanza=stanza,
        )
        if result.returncode != 0:
            shutil.rmtree(partial, ignore_errors=True)
            self.repository.must(result, f"the restore of {instance_id} from {stanza}")
        for name in NOT_RESTORED:
            (partial / name).unlink(missing_ok=True)
        staged = self.servers.server(instance_id)
        staged.datadir = partial
        staged.write_settings(self.servers.settings_for(instance_id, spec))
        os.replace(partial, datadir)
        return self._replay(instance_id)

    def _replay(self, instance_id: uuid.UUID) -> str | None:
        """Start the restored cluster where no client can reach it (nor, as it is no hot standby,
        connect before it is promoted), until it is promoted; a target after the archive's last
        commit replays everything archived instead (it holds nothing later than the target).
        Stopped again; returns the time of the last transaction replayed."""
        server = self.servers.server(instance_id, port=self.network.ports.port_of(instance_id) or 5432)
        sockets = self.storage.socket_dir(instance_id)
        password = self.storage.unseal(self.repository.admin_password(instance_id))
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        try:
            for to_target in (True, False):
                offset = _size(server.logfile)
                with contextlib.suppress(PostgresError):
                    # No hot standby while it replays: a hot standby may not run with fewer
                    # connections (or workers, locks) than the WAL's primary had, and the plan
                    # written for this instance may be smaller than the one its backup ran.
                    server.start_private(sockets, settings={"hot_standby": "off"})
                while server.is_running():
                    promoted = _promoted(sockets, server.port, password)
                    if promoted is not None:
                        return promoted or None
                    if time.monotonic() > deadline:
                        raise TemporaryError(f"the restore of {instance_id} is still replaying")
                    time.sleep(0.1)
                said = _since(server.logfile, offset)
                if not (to_target and TARGET_NOT_REACHED in said):
                    break
                _drop_recovery_target(server.datadir)
            raise TemporaryError(f"the restored cluster of {instance_id} did not start: {said[-500:]}")
        finally:
            server.stop("fast")


def _archive_error(datadir: Path) -> str:
    """The last error pgBackRest's archive-push printed into the server's log (SREs' words)."""
    log_file = datadir.parent / f"{datadir.name}.log"
    said = _since(log_file, max(0, _size(log_file) - 65536))
    errors = [line for line in said.splitlines() if " ERROR: [" in line]
    return errors[-1].split(" ERROR: ", 1)[1].strip()[:500] if errors else ""


def _overdue(coverage: Coverage, now: dt.datetime, archive_timeout_s: float) -> bool:
    """Whether writes waiting for the archive are older than archive_timeout (with some slack)."""
    return bool(coverage.waiting) and coverage.waiting[0].at < now - dt.timedelta(
        seconds=archive_timeout_s * 1.5
    )


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _since(path: Path, offset: int) -> str:
    """What a log file says from `offset` on."""
    try:
        with path.open("rb") as handle:
            handle.seek(offset)
            return handle.read().decode(errors="replace")
    except FileNotFoundError:
        return ""


def _promoted(sockets: Path, port: int, password: str) -> str | None:
    """'' or the recovery point once the cluster left recovery; None while it replays."""
    try:
        with psycopg.connect(
            host=str(sockets),
            port=port,
            user=ADMIN_USER,
            password=password,
            dbname="postgres",
            connect_timeout=5,
            autocommit=True,
        ) as conn:
            row = conn.execute("SELECT pg_is_in_recovery(), pg_last_xact_replay_timestamp()").fetchone()
    except psycopg.OperationalError as exc:
        if "password authentication failed" in str(exc):
            raise TemporaryError(
                f"the restored cluster refuses the admin password it should know: {exc}"
            ) from exc
        return None
    if row is None or row[0]:
        return None
    return "" if row[1] is None else row[1].isoformat()


def _drop_recovery_target(datadir: Path) -> None:
    """Replay to the end of the archive instead of a target after its last commit."""
    auto = datadir / "postgresql.auto.conf"
    kept = [line for line in auto.read_text().splitlines() if not line.startswith("recovery_target")]
    auto.write_text("\n".join(kept) + "\n")


def _at(value: Any) -> dt.datetime | None:
    return None if not value else dt.datetime.fromisoformat(str(value))
