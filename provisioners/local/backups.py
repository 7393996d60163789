"""Backups and restores: base backups (pg_basebackup), their retention, restore, the final pg_dump.

Each instance's backups are directories under its backup directory, listed and pruned by the plan's
retention; a restore puts one in place of the data directory; a deletion keeps a final dump.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import tarfile
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from controlplane.core.step_errors import PermanentError, TemporaryError
from controlplane.runtime.files import write_atomically
from provisioners.base import BACKUP_KINDS, BackupInfo, InstanceSpec
from provisioners.local.database import DBNAME, Admin
from provisioners.local.network import Network
from provisioners.local.server import SET_ASIDE_SIGNAL, STANDBY_SIGNAL, InstanceServer, Servers, stop_strays
from provisioners.local.storage import Storage

# A backup is a directory: the compressed base backup, then (written last) what describes it.
BACKUP_ARCHIVE = "base.tar.gz"
BACKUP_META = "backup.json"
# Files a restored cluster must not keep: the old server's run state, and the signals that would
# start it as a standby.
NOT_RESTORED = ("postmaster.pid", "postmaster.opts", STANDBY_SIGNAL, SET_ASIDE_SIGNAL, "recovery.signal")


class Backups:
    """Each instance's backups under `data_dir/backups/<id>/`, and the final dumps beside them."""

    def __init__(self, storage: Storage, network: Network, servers: Servers, admin: Admin) -> None:
        self.storage = storage
        self.network = network
        self.servers = servers
        self.admin = admin

    def take(self, instance_id: uuid.UUID, spec: InstanceSpec, kind: str) -> BackupInfo:
        """pg_basebackup (tar, gzip, the WAL it needs included) into a partial directory, renamed."""
        if kind not in BACKUP_KINDS:
            raise PermanentError(f"unknown backup kind {kind!r}; kinds are {', '.join(BACKUP_KINDS)}")
        server = self.servers.require_storage(instance_id)
        port = self.network.require_port(instance_id)
        if not server.is_running():
            raise TemporaryError(f"instance {instance_id} is not running; a backup needs its server")
        taken = dt.datetime.now(dt.UTC)
        backup_id = taken.strftime("%Y%m%dT%H%M%S") + f"{taken.microsecond // 1000:03d}Z"
        root = self.storage.backup_dir(instance_id)
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        for stale in root.glob(".partial-*"):  # a backup cut short by a crash
            shutil.rmtree(stale, ignore_errors=True)
        partial = root / f".partial-{backup_id}"
        partial.mkdir(mode=0o700)
        server.port = port
        options = ["--format=tar", "--wal-method=fetch", "--checkpoint=fast", "--compress=client-gzip:1"]
        result = self.admin.client_tool(
            instance_id,
            server,
            "pg_basebackup",
            [f"--pgdata={partial}", *options, f"--label=controlplane {backup_id}"],
        )
        if result.returncode != 0:
            shutil.rmtree(partial, ignore_errors=True)
            raise TemporaryError(f"backup of {instance_id} failed: {result.stderr.strip()[-500:]}")
        state = self.storage.load_state(instance_id)
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
        held = self.held(instance_id)
        for old in held[: -max(1, keep)]:
            shutil.rmtree(old.location, ignore_errors=True)

    def held(self, instance_id: uuid.UUID) -> list[BackupInfo]:
        """The instance's backups, oldest first."""
        root = self.storage.backup_dir(instance_id)
        if not root.exists():
            return []
        held = []
        for entry in root.iterdir():
            meta_path = entry / BACKUP_META
            if entry.name.startswith(".") or not meta_path.exists():
                continue
            held.append(_backup_of(entry, json.loads(meta_path.read_text())))
        return sorted(held, key=lambda backup: backup.completed_at or "")

    def restore(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, backup_id: str | None) -> None:
        """The cluster from backup `backup_id` (or a new empty one), in place of whatever is there."""
        meta: dict[str, Any] | None = None
        source = self.storage.backup_dir(instance_id) / (backup_id or "")
        if backup_id is not None:
            if "/" in backup_id or backup_id.startswith(".") or not (source / BACKUP_META).exists():
                raise PermanentError(f"instance {instance_id} has no backup {backup_id!r}")
            meta = json.loads((source / BACKUP_META).read_text())
        state = self.storage.load_state(instance_id)
        if meta is not None:
            # The restored cluster knows the admin password of the time of its backup.
            state.update({key: value for key, value in meta["state"].items() if key == "admin_password"})
            state.setdefault("owner_password", meta["state"].get("owner_password"))
        state = self.storage.prepare_instance(instance_id, {k: v for k, v in state.items() if v is not None})
        self.storage.save_state(instance_id, state)
        server = self.servers.server(instance_id)
        if server.is_running():
            server.stop("fast")
        stop_strays(server.datadir)
        self.storage.set_aside(instance_id)
        if meta is None:
            self.servers.build_cluster(instance_id, spec, fence, state)
            return
        directory = self.storage.instance_dir(instance_id)
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
            self.storage.chown(path)
        os.replace(partial, server.datadir)
        self.storage.save_state(
            instance_id,
            {
                **state,
                "cluster_created_at": state.get("cluster_created_at") or meta["completed_at"],
                "restored_from": backup_id,
            },
        )

    def take_final(self, instance_id: uuid.UUID) -> str | None:
        """The final dump's path: the one recorded (if it is still there), else a new one; None
        when there is no cluster to dump."""
        state = self.storage.load_state(instance_id)
        server = self.servers.server(instance_id)
        backup: str | None = state.get("final_backup")
        if server.initialised and not (backup and Path(backup).exists()):
            backup = str(self._final_dump(instance_id, server))
            state["final_backup"] = backup
            self.storage.save_state(instance_id, state)
        return backup

    def _final_dump(self, instance_id: uuid.UUID, server: InstanceServer) -> Path:
        if server.port == 0:
            server.port = self.network.ports.allocate(instance_id)
        self.servers.ensure_started(server)
        self.storage.backups.mkdir(parents=True, exist_ok=True, mode=0o700)
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
        final = self.storage.backups / f"{instance_id}-{stamp}.dump"
        partial = final.with_name(final.name + ".partial")
        result = self.admin.client_tool(
            instance_id, server, "pg_dump", ["--format=custom", f"--file={partial}", DBNAME]
        )
        if result.returncode != 0:
            partial.unlink(missing_ok=True)
            raise TemporaryError(f"final backup of {instance_id} failed: {result.stderr.strip()[-500:]}")
        os.replace(partial, final)
        return final


def _backup_of(path: Path, meta: Mapping[str, Any]) -> BackupInfo:
    return BackupInfo(
        name=str(meta["id"]),
        instance_id=uuid.UUID(str(meta["instance_id"])),
        completed_at=str(meta["completed_at"]),
        kind=str(meta.get("kind", "scheduled")),
        size_bytes=None if meta.get("size_bytes") is None else int(meta["size_bytes"]),
        location=str(path),
    )
