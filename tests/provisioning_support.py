"""Shared helpers of the provisioner and operations tests: settings for real instance servers, their
customers' credentials, and worker subprocesses over them."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import psycopg
from pydantic import SecretStr

from controlplane.runtime.secretbox import load_box
from controlplane.runtime.settings import SETTINGS, Settings, env_name
from provisioners.base import ConnectionInfo


def setting_value(settings: Settings, name: str) -> Any:
    """The value of a setting by its flat name (`worker_concurrency` is settings.worker.concurrency)."""
    entry = SETTINGS[name]
    return getattr(settings if entry.group is None else getattr(settings, entry.group), entry.name)


def pg_bindir() -> Path | None:
    """The server binaries this run was pointed at (CONTROLPLANE_PG_BINDIR), for every server it starts."""
    value = os.environ.get("CONTROLPLANE_PG_BINDIR")
    return Path(value) if value else None


def instance_settings(pg_root: Path, database_url: str | None = None, **overrides: Any) -> Settings:
    """Settings whose data_dir the server user can traverse, with a port window of its own."""
    data_dir = Path(tempfile.mkdtemp(prefix="inst-", dir=pg_root))
    os.chmod(data_dir, 0o755)
    low = random.randrange(30000, 32000)
    values: dict[str, Any] = {
        "database_url": database_url,
        "data_dir": data_dir,
        "local_port_min": low,
        "local_port_max": low + 40,
        "heartbeat_interval_s": 0.2,
        "pg_bindir": pg_bindir(),
        **overrides,
    }
    return Settings(**values)


# Retries and polls short enough for tests that wait on a real worker.
QUICK_RETRIES: dict[str, Any] = {"retry_base_delay_s": 0.05, "retry_max_delay_s": 0.2, "poll_interval_s": 0.1}


@contextlib.contextmanager
def real_instances(pg_root: Path, database_url: str | None = None, **overrides: Any) -> Iterator[Settings]:
    """instance_settings for the block; every instance server left running under them is stopped after."""
    settings = instance_settings(pg_root, database_url, **overrides)
    try:
        yield settings
    finally:
        stop_all_servers(settings.data_dir)


def connect(info: ConnectionInfo, **kwargs: Any) -> psycopg.Connection[Any]:
    return psycopg.connect(**info.libpq(), autocommit=True, connect_timeout=5, **kwargs)


def stop_all_servers(data_dir: Path) -> None:
    """Stop every instance server a test left running under `data_dir` (teardown)."""
    from controlplane.runtime.postgres import server_user
    from provisioners.local import InstanceServer, postmaster_pids_for

    instances = Path(data_dir).resolve() / "instances"
    if not instances.exists():
        return
    for entry in instances.iterdir():
        pooler = entry / "pooler" / "pgbouncer.pid"  # an HA instance's pooler
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pooler.read_text().strip()), signal.SIGKILL)
        for datadir in entry.glob("pgdata*"):  # its servers: the first, and an HA plan's standbys
            if not datadir.is_dir() or ".partial" in datadir.name:
                continue
            if datadir.exists():
                server = InstanceServer(
                    datadir=datadir, port=0, run_as=server_user(), preferred_bindir=pg_bindir()
                )
                if server.is_running():
                    server.stop("immediate")
            for pid in postmaster_pids_for(datadir):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGQUIT)


def credentials(settings: Settings, row: Mapping[str, Any]) -> ConnectionInfo:
    """A customer's connection details: the recorded connection and the decrypted password."""
    return ConnectionInfo.from_public(row["connection"], load_box(settings).decrypt(bytes(row["secret"])))


# The settings a worker subprocess takes from its test's Settings.
WORKER_SETTINGS = (
    "database_url",
    "data_dir",
    "pg_bindir",
    "local_port_min",
    "local_port_max",
    "heartbeat_interval_s",
    "poll_interval_s",
    "provisioner",
    "local_archive_timeout_s",
)


def settings_env(settings: Settings, names: tuple[str, ...]) -> dict[str, str]:
    """The test's environment without CONTROLPLANE_* variables, plus the settings `names` as variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONTROLPLANE_")}
    for name in names:
        value = setting_value(settings, name)
        if value is not None:
            env[env_name(name)] = str(value.get_secret_value() if isinstance(value, SecretStr) else value)
    return env


def worker_env(settings: Settings, faults: str, worker_id: str) -> dict[str, str]:
    """The environment of a worker subprocess (controlplane settings from variables, faults)."""
    env = settings_env(settings, WORKER_SETTINGS)
    env["CONTROLPLANE_FAULTS"] = faults
    env["CONTROLPLANE_WORKER_ID"] = worker_id
    return env


# A worker subprocess running the instance operations, configured by worker_env: `controlplane worker`.
WORKER_SCRIPT = "import sys\nfrom controlplane.cli import main\nsys.exit(main(['worker']))\n"
