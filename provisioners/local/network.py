"""Network: the servers' hosts, each instance's port, and the access rules (`pg_hba.conf`).

Hosts: the one the servers listen on, the one the control plane connects to, the one customers are
given. Ports come from the configured range, recorded in `ports.json` under an exclusive flock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from controlplane.core.failures import CAPACITY_EXHAUSTED
from controlplane.core.step_errors import TemporaryError
from controlplane.runtime.files import write_atomically
from controlplane.runtime.postgres import PostgresServer, port_in_use
from controlplane.runtime.settings import Settings

log = logging.getLogger(__name__)

WILDCARD_HOSTS = frozenset({"", "*", "0.0.0.0", "::"})  # noqa: S104 (recognised, not bound)

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


# What the port of an instance's pooler is recorded under, beside its servers' (`member_key`).
POOLER = "pooler"


def member_key(instance_id: uuid.UUID, member: int | str) -> str:
    """The key of a port in `ports.json`: the instance id for its first server (as ever), the id
    and `.<n>` for the other servers of an HA plan, `.pooler` for its pooler."""
    return str(instance_id) if member == 0 else f"{instance_id}.{member}"


def owner_of(key: str) -> tuple[uuid.UUID | None, str]:
    """The instance a port's key names, and what of it holds the port ("0": its first server)."""
    head, _, tail = key.partition(".")
    try:
        return uuid.UUID(head), tail or "0"
    except ValueError:
        return None, tail


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

    def port_of(self, instance_id: uuid.UUID | str) -> int | None:
        return self.table().get(str(instance_id))

    def allocate(self, instance_id: uuid.UUID | str, *, avoid: int | None = None) -> int:
        """The port recorded under `instance_id` (an instance, or `member_key`): the recorded one,
        else the lowest free one of the range."""
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
        """Every port of the instance (its servers' and its pooler's) given back."""
        with self._locked() as table:
            keys = [key for key in table if owner_of(key)[0] == instance_id]
            for key in keys:
                del table[key]
            return bool(keys)


class Network:
    """The servers' hosts (listened on, connected to, advertised to customers) and their ports,
    recorded in `ports.json` under `root`."""

    def __init__(
        self, settings: Settings, root: Path, primary_of: Callable[[uuid.UUID], int] = lambda _: 0
    ) -> None:
        self.primary_of = primary_of
        self.listen_host = settings.provisioner.local_listen_host
        self.connect_host = "127.0.0.1" if self.listen_host in WILDCARD_HOSTS else self.listen_host
        self.advertise_host = socket.gethostname() if self.listen_host in WILDCARD_HOSTS else self.listen_host
        self.ports = PortAllocator(
            root / "ports.json",
            settings.provisioner.local_port_min,
            settings.provisioner.local_port_max,
            self.listen_host,
        )

    def names(self) -> list[str]:
        """The names clients reach the servers by: the advertised host and the one we connect to."""
        return list(dict.fromkeys([self.advertise_host, self.connect_host]))

    def primary_key(self, instance_id: uuid.UUID) -> str:
        return member_key(instance_id, self.primary_of(instance_id))

    def primary_port(self, instance_id: uuid.UUID) -> int | None:
        """The port of the instance's primary server, as recorded (None: it has none yet)."""
        return self.ports.port_of(self.primary_key(instance_id))

    def require_port(self, instance_id: uuid.UUID, member: int | None = None) -> int:
        """The port of the instance's primary server (or of `member`)."""
        key = self.primary_key(instance_id) if member is None else member_key(instance_id, member)
        port = self.ports.port_of(key)
        if port is None:
            raise TemporaryError(f"instance {instance_id} has no port (configure_network runs first)")
        return port

    def port_to_start_on(
        self, instance_id: uuid.UUID, server: PostgresServer, member: int | str | None = None
    ) -> int:
        """The port of the instance's primary (or `member`), moved to a free one if another process
        holds it while this server is not running (the connection details initialize_database
        returns carry the new one)."""
        key = self.primary_key(instance_id) if member is None else member_key(instance_id, member)
        port = self.ports.allocate(key)
        if not server.is_running() and port_in_use(port, self.connect_host):
            log.warning("port %s of %s is taken by another process; moving", port, key)
            port = self.ports.allocate(key, avoid=port)
        return port
