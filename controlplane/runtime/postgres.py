"""A PostgreSQL server on this machine: finds binaries, initdb, start, stop, as a non-root user."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

SERVER_USER_CANDIDATES = ("postgres", "controlplane")


class PostgresError(RuntimeError):
    """The PostgreSQL server could not be found, initialised, started or stopped."""


def find_bindir(preferred: Path | None = None) -> Path:
    """`preferred` (CONTROLPLANE_PG_BINDIR) when it holds a server, else the system's server
    binaries, otherwise those of the `pgserver` PyPI package."""
    candidates: list[Path] = [preferred] if preferred else []
    on_path = shutil.which("postgres")
    if on_path:
        candidates.append(Path(on_path).resolve().parent)
    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
    try:
        import pgserver

        candidates.append(Path(pgserver.__file__).parent / "pginstall" / "bin")
    except ImportError:
        pass
    for bindir in candidates:
        if (bindir / "postgres").exists() and (bindir / "initdb").exists():
            return bindir
    raise PostgresError(
        "no PostgreSQL server binaries found: install PostgreSQL (initdb, postgres, pg_ctl) "
        "or the 'pgserver' package (pip install 'controlplane[embedded-fallback]')"
    )


@dataclass(frozen=True)
class RunAs:
    """The OS user server processes run as (None: the current user)."""

    uid: int | None = None
    gid: int | None = None
    name: str | None = None

    @property
    def is_switch(self) -> bool:
        return self.uid is not None


def server_user() -> RunAs:
    """PostgreSQL refuses to run as root: pick (or create) a non-root user when we are root."""
    if os.geteuid() != 0:
        return RunAs()
    for name in SERVER_USER_CANDIDATES:
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            continue
        return RunAs(entry.pw_uid, entry.pw_gid, name)
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "controlplane"],
        check=True,
        capture_output=True,
    )
    entry = pwd.getpwnam("controlplane")
    return RunAs(entry.pw_uid, entry.pw_gid, "controlplane")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0


def make_owned_dir(path: Path, run_as: RunAs, mode: int = 0o700) -> None:
    """Create `path` for the server user, checking the user can reach it."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, mode)
    if run_as.is_switch:
        assert run_as.uid is not None and run_as.gid is not None
        os.chown(path, run_as.uid, run_as.gid)
        for parent in path.resolve().parents:
            if not os.stat(parent).st_mode & 0o001:
                raise PostgresError(
                    f"{parent} is not searchable by the server user {run_as.name!r}; "
                    f"choose a data directory outside it (CONTROLPLANE_DATA_DIR) or chmod o+x it"
                )


@dataclass
class PostgresServer:
    """One PostgreSQL cluster in its own data directory, listening on one port."""

    datadir: Path
    port: int
    host: str = "127.0.0.1"
    run_as: RunAs = RunAs()
    bindir: Path | None = None
    # Where to look for the binaries first (CONTROLPLANE_PG_BINDIR), when `bindir` is not given.
    preferred_bindir: Path | None = None
    # Added to the environment of the server and its tools (what its archive command needs).
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def logfile(self) -> Path:
        return self.datadir.parent / f"{self.datadir.name}.log"

    def bin(self, name: str) -> str:
        if self.bindir is None:
            self.bindir = find_bindir(self.preferred_bindir)
        return str(self.bindir / name)

    def _run(self, args: list[str], *, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, LC_ALL="C", LANG="C", **self.env)
        env.pop("PGDATA", None)
        return subprocess.run(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            env=env,
            cwd="/",
            check=False,
            user=self.run_as.uid,
            group=self.run_as.gid,
            extra_groups=[] if self.run_as.is_switch else None,
        )

    @property
    def initialised(self) -> bool:
        return (self.datadir / "PG_VERSION").exists()

    def initdb(self, superuser: str, password: str, settings: Mapping[str, str]) -> None:
        """Create the cluster with SCRAM authentication; idempotent when it already exists."""
        if self.initialised:
            return
        make_owned_dir(self.datadir, self.run_as)
        pwfile = self.datadir.parent / f".{self.datadir.name}.pw"
        pwfile.write_text(password)
        if self.run_as.is_switch:
            assert self.run_as.uid is not None and self.run_as.gid is not None
            os.chown(pwfile, self.run_as.uid, self.run_as.gid)
        os.chmod(pwfile, 0o600)
        try:
            result = self._run(
                [
                    self.bin("initdb"),
                    "-D",
                    str(self.datadir),
                    "-U",
                    superuser,
                    f"--pwfile={pwfile}",
                    "--auth=scram-sha-256",
                    "--encoding=UTF8",
                    "--no-instructions",
                ]
            )
        finally:
            pwfile.unlink(missing_ok=True)
        if result.returncode != 0:
            raise PostgresError(f"initdb failed in {self.datadir}: {result.stdout.strip()}")
        self.write_settings(settings)

    def write_settings(self, settings: Mapping[str, str]) -> None:
        """Write the cluster's managed settings (postgresql.auto.conf is left to ALTER SYSTEM)."""
        managed = self.datadir / "controlplane.conf"
        lines = [f"{key} = '{value}'" for key, value in sorted(settings.items())]
        managed.write_text("\n".join(lines) + "\n")
        conf = self.datadir / "postgresql.conf"
        include = "include_if_exists = 'controlplane.conf'\n"
        if include not in conf.read_text():
            with conf.open("a") as handle:
                handle.write(include)
        if self.run_as.is_switch:
            assert self.run_as.uid is not None and self.run_as.gid is not None
            os.chown(managed, self.run_as.uid, self.run_as.gid)

    def pid(self) -> int | None:
        """The postmaster's pid when it is alive (see `postmaster_pid`)."""
        return postmaster_pid(self.datadir)

    def is_running(self) -> bool:
        return self.pid() is not None

    def start(self, timeout: float = 60) -> None:
        """Start the server (idempotent) and wait until it accepts connections."""
        self._start(f"-p {self.port} -c listen_addresses={self.host} -k {self.socket_dir()}", timeout)

    def start_and_stop_privately(self, timeout: float = 60) -> None:
        """Start the server and stop it again (what a start records in pg_control), with no TCP
        listener and its only socket in a directory only the server's user may enter: no client
        connects meanwhile."""
        if self.is_running():
            raise PostgresError(f"PostgreSQL in {self.datadir} is running; it cannot start privately")
        directory = Path(tempfile.mkdtemp(prefix="cp-private-"))
        try:
            self.start_private(directory, timeout)
        finally:
            try:
                self.stop("fast")
            finally:
                shutil.rmtree(directory, ignore_errors=True)

    def start_private(
        self, directory: Path, timeout: float = 60, settings: Mapping[str, str] | None = None
    ) -> None:
        """Start the server with no TCP listener, its only socket in `directory` (made for the
        server's user alone): only that user, or root, can connect. `settings` override the
        configuration files' for this run."""
        make_owned_dir(directory, self.run_as)
        extra = "".join(f" -c {name}={value}" for name, value in (settings or {}).items())
        self._start(f"-p {self.port} -c listen_addresses='' -k {directory}{extra}", timeout)

    def _start(self, options: str, timeout: float) -> None:
        if not self.initialised:
            raise PostgresError(f"{self.datadir} holds no PostgreSQL cluster")
        if self.is_running():
            return
        result = self._run(
            [
                self.bin("pg_ctl"),
                "-D",
                str(self.datadir),
                "-l",
                str(self.logfile_for_server()),
                "-o",
                options,
                "-w",
                "-t",
                str(int(timeout)),
                "start",
            ],
            timeout=timeout + 10,
        )
        if result.returncode != 0:
            tail = self.log_tail()
            raise PostgresError(
                f"PostgreSQL in {self.datadir} did not start on port {self.port}: "
                f"{result.stdout.strip()} {tail}"
            )

    def socket_dir(self) -> Path:
        return self.datadir

    def logfile_for_server(self) -> Path:
        log = self.logfile
        if not log.exists():
            log.touch()
        if self.run_as.is_switch:
            assert self.run_as.uid is not None and self.run_as.gid is not None
            os.chown(log, self.run_as.uid, self.run_as.gid)
        return log

    def log_tail(self, lines: int = 5) -> str:
        try:
            return " | ".join(self.logfile.read_text().strip().splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, mode: str = "fast", timeout: float = 60) -> None:
        if not self.is_running():
            return
        result = self._run(
            [self.bin("pg_ctl"), "-D", str(self.datadir), "-m", mode, "-w", "-t", str(int(timeout)), "stop"],
            timeout=timeout + 10,
        )
        if result.returncode != 0 and self.is_running():
            raise PostgresError(f"PostgreSQL in {self.datadir} did not stop: {result.stdout.strip()}")

    def restart(self, mode: str = "fast") -> None:
        self.stop(mode)
        self.start()

    def configured(self, name: str) -> str:
        """The value setting `name` has in the configuration files (the server stopped or not)."""
        result = self._run([self.bin("postgres"), "-D", str(self.datadir), "-C", name], timeout=30)
        if result.returncode != 0:
            raise PostgresError(f"could not read {name} of {self.datadir}: {result.stdout.strip()}")
        return result.stdout.strip()

    def control_data(self) -> dict[str, str]:
        """What pg_control records (pg_controldata's fields by name), e.g. the settings of the last
        primary run that a hot standby must match: `max_connections setting`."""
        result = self._run([self.bin("pg_controldata"), "-D", str(self.datadir)], timeout=30)
        if result.returncode != 0:
            raise PostgresError(f"could not read pg_control of {self.datadir}: {result.stdout.strip()}")
        fields = (line.partition(":") for line in result.stdout.splitlines())
        return {name.strip(): value.strip() for name, sep, value in fields if sep}

    def reload(self) -> None:
        self._run([self.bin("pg_ctl"), "-D", str(self.datadir), "reload"])

    def run_tool(self, name: str, args: list[str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
        """Run a client tool (pg_dump, psql) from the same installation, as the server user."""
        return self._run([self.bin(name), *args], timeout=timeout)

    def wait_until_down(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self.is_running() and time.monotonic() < deadline:
            time.sleep(0.05)


def postmaster_pid(datadir: Path) -> int | None:
    """The pid of the postmaster running on `datadir`, from its postmaster.pid, or None. A file
    left by a killed server names a pid the system may have given another process since: where
    /proc says, only a live process whose working directory is `datadir` (a postmaster's is) counts."""
    try:
        pid = int((datadir / "postmaster.pid").read_text().splitlines()[0])
    except (OSError, ValueError, IndexError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pid
    if _is_zombie(pid):
        return None
    try:
        cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
    except PermissionError:
        return pid  # another user's process: the signal probe above is all there is
    except OSError:
        # No /proc here: the live pid is all there is. Gone since the probe: not running.
        return None if Path("/proc/self").exists() else pid
    return pid if cwd == datadir.resolve() else None


def _is_zombie(pid: int) -> bool:
    """A process that died and was not reaped yet (a killed postmaster whose parent is slow)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] == ["Z"]


def url(user: str, password: str, host: str, port: int, dbname: str) -> str:
    from urllib.parse import quote

    return f"postgresql://{quote(user)}:{quote(password, safe='')}@{host}:{port}/{quote(dbname)}"
