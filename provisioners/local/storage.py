"""Storage: where each instance's files live on this machine, its state file, and who owns them.

`data_dir/instances/<id>/` holds the data directory (`pgdata/`, built by the server's initdb), its
log and `state.json` (the provisioner's own record, its secrets sealed with the control plane's
key); the archive and backups, which outlive it, are in the pgBackRest repository (`repository`).
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import os
import secrets
import tempfile
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from controlplane.runtime.files import write_atomically
from controlplane.runtime.postgres import RunAs, server_user
from controlplane.runtime.secretbox import SecretBox, load_box
from controlplane.runtime.settings import Settings

# The longest Unix socket path the kernel takes is 107 bytes; PostgreSQL adds the port's file name.
SOCKET_PATH_MAX = 100


class Storage:
    """The instances' directories under data_dir, their state files, and their owner (the server user)."""

    def __init__(
        self, settings: Settings, *, run_as: RunAs | None = None, box: SecretBox | None = None
    ) -> None:
        self.settings = settings
        self.data_dir = Path(settings.data_dir).resolve()
        self.root = self.data_dir / "instances"
        self._run_as = run_as
        self._box = box

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

    def instance_dir(self, instance_id: uuid.UUID) -> Path:
        return self.root / str(instance_id)

    def datadir(self, instance_id: uuid.UUID) -> Path:
        """The data directory of the instance's primary server."""
        return self.member_datadir(instance_id, self.primary_member(instance_id))

    def member_datadir(self, instance_id: uuid.UUID, member: int) -> Path:
        """The data directory of one of the instance's servers: `pgdata` the first one's (every
        instance has it), `pgdata-<n>` the standbys' an HA plan adds."""
        return self.instance_dir(instance_id) / ("pgdata" if member == 0 else f"pgdata-{member}")

    def primary_member(self, instance_id: uuid.UUID) -> int:
        """Which of the instance's servers is its primary (0 until a failover or switchover)."""
        return int(self.load_state(instance_id).get("primary", 0))

    def socket_dir(self, instance_id: uuid.UUID) -> Path:
        """The private directory of the server's one Unix socket: under the data directory when the
        socket's path fits the system's limit (about 100 bytes), else under the temporary directory."""
        name = instance_id.hex[:16]
        inside = self.data_dir / "run" / name
        if len(str(inside)) + len("/.s.PGSQL.65535.lock") <= SOCKET_PATH_MAX:
            return inside
        digest = hashlib.sha256(str(self.data_dir).encode()).hexdigest()[:8]
        return Path(tempfile.gettempdir()) / f"cp-run-{digest}" / name

    def _state_path(self, instance_id: uuid.UUID) -> Path:
        return self.instance_dir(instance_id) / "state.json"

    def load_state(self, instance_id: uuid.UUID) -> dict[str, Any]:
        try:
            state: dict[str, Any] = json.loads(self._state_path(instance_id).read_text())
        except FileNotFoundError:
            return {}
        return state

    def save_state(self, instance_id: uuid.UUID, state: Mapping[str, Any]) -> None:
        write_atomically(self._state_path(instance_id), json.dumps(dict(state), sort_keys=True, indent=1))

    def seal(self, secret: str) -> str:
        return base64.b64encode(self.box.encrypt(secret)).decode()

    def unseal(self, sealed: str) -> str:
        return self.box.decrypt(base64.b64decode(sealed))

    def chown(self, path: Path) -> None:
        """`path` owned by the server user (when the servers run as another one)."""
        if self.run_as.is_switch:
            assert self.run_as.uid is not None and self.run_as.gid is not None
            os.chown(path, self.run_as.uid, self.run_as.gid)

    def _prepare_root(self) -> None:
        for directory in (self.data_dir, self.root):
            directory.mkdir(parents=True, exist_ok=True)
            if self.run_as.is_switch:
                mode = os.stat(directory).st_mode
                os.chmod(directory, mode | 0o111)  # noqa: S103 (the server user must traverse it)

    def prepare_instance(self, instance_id: uuid.UUID, state: dict[str, Any]) -> dict[str, Any]:
        """The instance's directory, and its state with an admin password (generated once)."""
        self._prepare_root()
        directory = self.instance_dir(instance_id)
        directory.mkdir(mode=0o711, exist_ok=True)
        os.chmod(directory, 0o711)  # noqa: S103 (the server user traverses; state.json stays 0600)
        if "admin_password" not in state:
            state = {
                "instance_id": str(instance_id),
                "admin_password": self.seal(secrets.token_urlsafe(32)),
                **state,
            }
            self.save_state(instance_id, state)
        return state

    def set_aside(self, instance_id: uuid.UUID) -> None:
        """Whatever is left of a data directory is moved aside, never removed (it may hold data)."""
        datadir = self.datadir(instance_id)
        if datadir.exists():
            stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
            os.replace(datadir, datadir.with_name(f"pgdata.replaced-{stamp}"))
