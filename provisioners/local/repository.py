"""The pgBackRest repository: every instance's stanza (its WAL archive and its backups) in one
repository under `data_dir/pgbackrest/`, encrypted with a key the control plane holds.

The key is generated once and kept sealed with the control plane's secret key; it reaches
pgBackRest only through the environment of the processes that need it (the servers, whose
`archive_command` and `restore_command` run pgBackRest, and the commands run here), never a file.
pgBackRest runs as the servers' user; its configuration, locks, logs and spool are its own.
Each instance's record (`records/<id>.json`) keeps what the repository alone cannot say and a
restore after the instance is gone needs: its sealed admin password, how far its archive covers
its writes, its earliest restorable moment, when it was deleted.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import secrets
import shlex
import shutil
import subprocess
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controlplane.core.step_errors import PermanentError, TemporaryError
from controlplane.runtime.files import write_atomically
from controlplane.runtime.postgres import make_owned_dir
from provisioners.local.database import ADMIN_USER
from provisioners.local.storage import Storage

PGBACKREST = "pgbackrest"
CIPHER_ENV = "PGBACKREST_REPO1_CIPHER_PASS"
# pgBackRest's exit code when a stanza's info files do not match the cluster (a new system id:
# the instance was re-initialised empty, its loss accepted): the stanza is upgraded, its history kept.
STANZA_MISMATCH = 28
# What a backup's annotation says it was taken for (`BackupInfo.kind`).
KIND_ANNOTATION = "controlplane-kind"


@dataclass(frozen=True)
class PgTarget:
    """The cluster a command works on: its data directory and, for commands that connect (backup,
    check, stanza-create), the port and private socket directory it listens on."""

    datadir: Path
    port: int | None = None
    socket_dir: Path | None = None

    def options(self) -> list[str]:
        found = [f"--pg1-path={self.datadir}"]
        if self.port is not None and self.socket_dir is not None:
            found += [
                f"--pg1-port={self.port}",
                f"--pg1-socket-path={self.socket_dir}",
                f"--pg1-user={ADMIN_USER}",
            ]
        return found


@dataclass(frozen=True)
class StanzaBackup:
    """One backup of a stanza, as `pgbackrest info` lists it."""

    label: str
    type: str
    started_at: dt.datetime
    stopped_at: dt.datetime
    size_bytes: int
    repository_bytes: int
    db_id: int
    kind: str

    @property
    def restorable_from(self) -> dt.datetime:
        """The first moment a point-in-time restore can start from this backup: its stop time has
        one-second resolution and pgBackRest needs a target after it."""
        return self.stopped_at + dt.timedelta(seconds=1)


@dataclass(frozen=True)
class StanzaInfo:
    """A stanza's backups (oldest first) and archive, of its current database (after an empty
    re-initialisation the stanza keeps the older one's history beside it)."""

    backups: tuple[StanzaBackup, ...]
    db_id: int | None
    archive_max: str | None
    status: str

    @property
    def earliest(self) -> dt.datetime | None:
        return self.backups[0].restorable_from if self.backups else None


class Repository:
    """The one pgBackRest repository of this host's instances, and the commands run on it."""

    def __init__(self, storage: Storage, archive_timeout_s: float) -> None:
        self.storage = storage
        self.archive_timeout_s = archive_timeout_s
        self.root = storage.data_dir / "pgbackrest"
        self.config = self.root / "pgbackrest.conf"
        self.repo = self.root / "repo"
        self.records = self.root / "records"
        self._cipher: str | None = None

    # ---- setting up ----------------------------------------------------------------------------

    def prepare(self) -> None:
        """The repository's directories (the server user's) and its configuration, made once."""
        # The control plane's own (the sealed key, the records); the server user only passes through.
        self.root.mkdir(parents=True, exist_ok=True, mode=0o711)
        os.chmod(self.root, 0o711)  # noqa: S103 (traversed by the server user; nothing listable)
        for directory in (self.repo, self.root / "lock", self.root / "log", self.root / "spool"):
            make_owned_dir(directory, self.storage.run_as)
        self.records.mkdir(mode=0o700, exist_ok=True)
        text = self._config_text()
        if not self.config.exists() or self.config.read_text() != text:
            write_atomically(self.config, text, mode=0o600)
            self.storage.chown(self.config)

    def _config_text(self) -> str:
        values = {
            "repo1-path": self.repo,
            "repo1-cipher-type": "aes-256-cbc",
            "lock-path": self.root / "lock",
            "log-path": self.root / "log",
            "spool-path": self.root / "spool",
            "compress-type": "lz4",
            "start-fast": "y",
            "log-level-console": "error",
            "log-level-stderr": "off",
            "log-level-file": "info",
            # How long a backup or check waits for a segment to reach the archive.
            "archive-timeout": "60",
        }
        lines = "".join(f"{key}={value}\n" for key, value in values.items())
        return "# Managed by the control plane: the repository of every local instance.\n[global]\n" + lines

    def cipher_pass(self) -> str:
        """The repository's encryption key: made once (sealed with the control plane's key), then read."""
        if self._cipher is None:
            path = self.root / "cipher.sealed"
            if not path.exists():
                self.root.mkdir(parents=True, exist_ok=True)
                candidate = path.with_name(f".cipher.{os.getpid()}.{secrets.token_hex(4)}")
                write_atomically(candidate, self.storage.seal(secrets.token_urlsafe(48)))
                with contextlib.suppress(FileExistsError):  # another process made it first: theirs
                    os.link(candidate, path)
                candidate.unlink()
            self._cipher = self.storage.unseal(path.read_text().strip())
        return self._cipher

    def environment(self) -> dict[str, str]:
        """What every process that runs pgBackRest needs in its environment (the servers too)."""
        return {CIPHER_ENV: self.cipher_pass()}

    def stanza(self, instance_id: uuid.UUID) -> str:
        return str(instance_id)

    def archive_settings(self, instance_id: uuid.UUID, datadir: Path) -> dict[str, str]:
        """The server settings that push every completed WAL segment into the instance's stanza."""
        command = [
            PGBACKREST,
            f"--config={self.config}",
            f"--stanza={self.stanza(instance_id)}",
            f"--pg1-path={datadir}",
            "archive-push",
        ]
        return {
            "archive_mode": "on",
            "archive_command": " ".join(shlex.quote(str(part)) for part in command) + " %p",
            "archive_timeout": f"{max(1, round(self.archive_timeout_s))}s",
        }

    # ---- running pgBackRest -----------------------------------------------------------------------

    def run(
        self,
        instance_id: uuid.UUID,
        command: str,
        options: Sequence[str] = (),
        *,
        target: PgTarget | None = None,
        timeout: float = 3600,
        stanza: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """pgBackRest `command` on the instance's stanza (or `stanza`), as the server user."""
        if shutil.which(PGBACKREST) is None:
            raise PermanentError(
                "pgBackRest is not installed: run `python3 dev.py up` (it installs it) or "
                "`apt-get install -y pgbackrest`"
            )
        self.prepare()
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LC_ALL": "C",
            **self.environment(),
        }
        if target is not None and target.port is not None:
            env["PGPASSWORD"] = self.storage.unseal(self.admin_password(instance_id))
        run_as = self.storage.run_as
        args = [
            PGBACKREST,
            f"--config={self.config}",
            f"--stanza={stanza or self.stanza(instance_id)}",
            *(target.options() if target is not None else []),
            *options,
            command,
        ]
        return subprocess.run(
            args,
            env=env,
            cwd="/",
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            stdin=subprocess.DEVNULL,
            user=run_as.uid,
            group=run_as.gid,
            extra_groups=[] if run_as.is_switch else None,
        )

    def must(self, result: subprocess.CompletedProcess[str], what: str) -> None:
        if result.returncode != 0:
            raise TemporaryError(f"{what} failed (pgBackRest {result.returncode}): {_said(result)}")

    def ensure_stanza(self, instance_id: uuid.UUID, target: PgTarget) -> None:
        """The stanza exists and matches the cluster: created, or upgraded after a new cluster."""
        # Offline: from the cluster's pg_control (a suspended instance's standby has no primary).
        result = self.run(instance_id, "stanza-create", ["--no-online"], target=target, timeout=120)
        if result.returncode == STANZA_MISMATCH:
            result = self.run(instance_id, "stanza-upgrade", ["--no-online"], target=target, timeout=120)
        self.must(result, f"the stanza of {instance_id}")

    def check(self, instance_id: uuid.UUID, target: PgTarget) -> None:
        """`pgbackrest check`: a WAL segment is switched and must reach the archive."""
        self.must(
            self.run(instance_id, "check", target=target, timeout=180), f"the archive check of {instance_id}"
        )

    def info(self, instance_id: uuid.UUID) -> StanzaInfo:
        """The stanza's backups and archive (none when it does not exist)."""
        result = self.run(instance_id, "info", ["--output=json"], timeout=120)
        self.must(result, f"the backup listing of {instance_id}")
        return parse_info(result.stdout)

    def verify(self, instance_id: uuid.UUID) -> str | None:
        """`pgbackrest verify`: every backup file and WAL segment read and checked; None when sound,
        else what is wrong."""
        result = self.run(instance_id, "verify", timeout=3600)
        return None if result.returncode == 0 else _said(result)

    def delete_stanza(self, instance_id: uuid.UUID) -> None:
        """The stanza and everything in it removed (retention of a deleted instance ran out)."""
        stanza = self.stanza(instance_id)
        if (self.repo / "backup" / stanza).exists() or (self.repo / "archive" / stanza).exists():
            self.run(instance_id, "stop", timeout=60)
            # pgBackRest wants the cluster's path, which need not exist any more (--force).
            datadir = PgTarget(self.storage.datadir(instance_id))
            result = self.run(instance_id, "stanza-delete", ["--force"], target=datadir, timeout=600)
            self.must(result, f"the removal of the stanza of {instance_id}")
        self.forget(instance_id)

    def has_stanza(self, instance_id: uuid.UUID) -> bool:
        return (self.repo / "archive" / self.stanza(instance_id) / "archive.info").exists()

    # ---- each instance's record ------------------------------------------------------------------

    def _record_path(self, instance_id: uuid.UUID) -> Path:
        return self.records / f"{instance_id}.json"

    def record(self, instance_id: uuid.UUID) -> dict[str, Any]:
        try:
            found: dict[str, Any] = json.loads(self._record_path(instance_id).read_text())
        except FileNotFoundError:
            return {}
        return found

    @contextlib.contextmanager
    def updating(self, instance_id: uuid.UUID) -> Iterator[dict[str, Any]]:
        """The instance's record to change, written back when the block ends (one writer at a time)."""
        self.records.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.records / f".{instance_id}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            record = self.record(instance_id)
            before = json.dumps(record, sort_keys=True)
            yield record
            if json.dumps(record, sort_keys=True) != before:
                write_atomically(self._record_path(instance_id), json.dumps(record, sort_keys=True, indent=1))
        finally:
            os.close(fd)

    def forget(self, instance_id: uuid.UUID) -> None:
        self._record_path(instance_id).unlink(missing_ok=True)
        (self.records / f".{instance_id}.lock").unlink(missing_ok=True)

    def admin_password(self, instance_id: uuid.UUID) -> str:
        """The sealed password of the admin role of the instance's cluster: its state's, else the
        one recorded with its stanza (a restore after the instance directory, or the instance, is gone)."""
        sealed = self.storage.load_state(instance_id).get("admin_password") or self.record(instance_id).get(
            "admin_password"
        )
        if not sealed:
            raise PermanentError(f"instance {instance_id} has no admin password on record")
        return str(sealed)

    def remember_admin(self, instance_id: uuid.UUID, sealed: str) -> None:
        with self.updating(instance_id) as record:
            record["admin_password"] = sealed


def _said(result: subprocess.CompletedProcess[str]) -> str:
    text = (result.stderr.strip() or result.stdout.strip()).replace("\n", " ")
    return text[-600:] or f"exit code {result.returncode}"


def _moment(seconds: Any) -> dt.datetime:
    return dt.datetime.fromtimestamp(int(seconds), dt.UTC)


def parse_info(text: str) -> StanzaInfo:
    """`pgbackrest info --output=json` of one stanza, its current database's part."""
    listed = json.loads(text or "[]")
    if not listed:
        return StanzaInfo((), None, None, "missing")
    stanza: Mapping[str, Any] = listed[0]
    databases = stanza.get("db") or []
    db_id = max((int(db["id"]) for db in databases), default=None)
    backups = tuple(
        StanzaBackup(
            label=str(b["label"]),
            type=str(b["type"]),
            started_at=_moment(b["timestamp"]["start"]),
            stopped_at=_moment(b["timestamp"]["stop"]),
            size_bytes=int(b["info"]["size"]),
            repository_bytes=int(b["info"]["repository"]["size"]),
            db_id=int(b["database"]["id"]),
            kind=str((b.get("annotation") or {}).get(KIND_ANNOTATION, "scheduled")),
        )
        for b in stanza.get("backup") or []
        if not b.get("error") and int(b["database"]["id"]) == db_id
    )
    archives = [a for a in stanza.get("archive") or [] if int(a["database"]["id"]) == db_id]
    return StanzaInfo(
        tuple(sorted(backups, key=lambda b: (b.stopped_at, b.label))),
        db_id,
        str(archives[0]["max"]) if archives and archives[0].get("max") else None,
        str((stanza.get("status") or {}).get("message", "")),
    )
