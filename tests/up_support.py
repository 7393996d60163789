"""Helpers of the tests that run `controlplane up` (or `python3 dev.py up`) as a real process tree."""

from __future__ import annotations

import contextlib
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from controlplane.runtime.postgres import free_port
from tests.support import ROOT

CLI = [sys.executable, "-m", "controlplane.cli"]
# The console script pip installed beside the interpreter (pyproject's [project.scripts]).
CONSOLE_SCRIPT = str(Path(sys.executable).parent / "controlplane")
# The last line of the banner `up` prints once everything serves.
BANNER_END = r"Ctrl-C stops everything"


def processes_mentioning(text: str) -> list[int]:
    """Pids of live processes whose command line mentions `text` (e.g. a data directory)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            status = (entry / "status").read_text()
        except OSError:
            continue
        if text in cmdline and "State:\tZ" not in status:
            found.append(int(entry.name))
    return found


def wait_until_gone(text: str, timeout: float = 15) -> list[int]:
    """The processes still mentioning `text` once none is left or `timeout` passed."""
    deadline = time.monotonic() + timeout
    while (left := processes_mentioning(text)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def kill_leftovers(text: str) -> None:
    """Teardown: SIGKILL whatever a failed test left running under `text`."""
    for pid in processes_mentioning(text):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _chunks(proc: subprocess.Popen[bytes], timeout: float) -> Iterator[str]:
    """`proc`'s output as it comes, until its pipe closes, it exits, or `timeout` passes.

    Reads the pipe's file descriptor directly: a buffered reader could hold lines that select()
    no longer reports.
    """
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if not ready:
            if proc.poll() is not None:
                return
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return
        yield chunk.decode(errors="replace")


class Drained(list[str]):
    """A process's output, read as it comes by a thread of its own (so the process never blocks
    on a full pipe, however much it logs while the test does something else), in the pieces read.

    `read_until` with one as `seen` waits for a matching line among those not yet waited for, as
    reading the pipe itself would."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        super().__init__()
        self._changed = threading.Condition()
        self._waited_to = 0  # characters up to the end of the last line waited for
        self._open = True
        self._thread = threading.Thread(target=self._pump, args=(proc,), daemon=True)
        self._thread.start()

    def _pump(self, proc: subprocess.Popen[bytes]) -> None:
        try:
            for piece in _chunks(proc, timeout=24 * 3600):
                with self._changed:
                    self.append(piece)
                    self._changed.notify_all()
        finally:
            with self._changed:
                self._open = False
                self._changed.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> str:
        """The output after the last line waited for, up to the first line matching `pattern`."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                text = "".join(self)[self._waited_to :]
                position = 0
                for line in text.splitlines(keepends=True):
                    position += len(line)
                    if re.search(pattern, line):
                        self._waited_to += position
                        return text[:position]
                left = deadline - time.monotonic()
                if not self._open or left <= 0:
                    raise AssertionError(f"no line matching {pattern!r}; output so far:\n{text}")
                self._changed.wait(left)

    def close(self, timeout: float = 5) -> None:
        """Wait for the end of the output (never past `timeout`: a child that outlived the process
        may hold the pipe open)."""
        self._thread.join(timeout)


def read_until(
    proc: subprocess.Popen[bytes], pattern: str, timeout: float, seen: list[str] | None = None
) -> str:
    """`proc`'s output up to the first line matching `pattern` (fails on timeout or exit);
    `seen` collects everything read, across calls (a `Drained` reads it already: it is waited on)."""
    if isinstance(seen, Drained):
        return seen.wait_for(pattern, timeout)
    text = ""
    for piece in _chunks(proc, timeout):
        text += piece
        if seen is not None:
            seen.append(piece)
        if any(re.search(pattern, line) for line in text.splitlines()):
            return text
    raise AssertionError(f"no line matching {pattern!r}; output so far:\n{text}")


# No rate limits unless a test sets its own: how many polls fit in a window depends on how long
# the machine takes to bring an instance to ready (docs/testing.md).
UNLIMITED = {"api_rate_limit": "0", "api_webhook_rate_limit": "0", "console_sign_in_limit": "0"}


def clean_env(**settings: str) -> dict[str, str]:
    """The test's environment without CONTROLPLANE_* variables, plus `settings` as variables (and
    no rate limits, unless `settings` names them)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("CONTROLPLANE_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update({f"CONTROLPLANE_{key.upper()}": value for key, value in (UNLIMITED | settings).items()})
    return env


@contextlib.contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    """A directory the server user can reach (pytest's tmp_path parents are private)."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(root, 0o755)
    try:
        yield root
    finally:
        kill_leftovers(str(root))
        shutil.rmtree(root, ignore_errors=True)


def up_env(root: Path, **settings: str) -> dict[str, str]:
    """The environment of an `up` under `root`: its API port, a window of instance ports, quick
    passes, and the CLI's CA file under `root`."""
    instance_port = free_port()
    return clean_env(
        api_port=str(free_port()),
        local_port_min=str(instance_port),
        local_port_max=str(instance_port + 20),
        reconcile_interval_s="0.5",
        shutdown_grace_s="2",
        **settings,
    ) | {"XDG_CONFIG_HOME": str(root / "config")}


@contextlib.contextmanager
def running_up(
    data_dir: Path, env: dict[str, str], *, launcher: bool, stop_with: int = signal.SIGTERM
) -> Iterator[tuple[subprocess.Popen[bytes], list[str]]]:
    """`python3 dev.py up` (launcher) or `controlplane up`, in a session of its own (so that only
    it gets the signals the test sends, as from `timeout`, systemd or a plain `kill`), from the
    moment its banner is out; sent `stop_with` after the block unless the block stopped it. Its
    output is read all along (`Drained`): so far, and after it stopped, it is in the list."""
    command = [sys.executable, "dev.py"] if launcher else CLI
    process = subprocess.Popen(
        [*command, "up", "--data-dir", str(data_dir), "--api-port", env["CONTROLPLANE_API_PORT"]],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    output = Drained(process)
    try:
        read_until(process, BANNER_END, timeout=300, seen=output)
        yield process, output
    finally:
        if process.poll() is None:
            process.send_signal(stop_with)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        output.close()
        if process.stdout is not None:
            process.stdout.close()
        print("".join(output))


def run_cli(
    args: list[str],
    env: Mapping[str, str],
    cwd: Path | None = None,
    timeout: float = 180,
    stdin: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """The installed console script `controlplane`, as a person runs it."""
    result = subprocess.run(
        [CONSOLE_SCRIPT, *args],
        capture_output=True,
        text=True,
        env=dict(env),
        cwd=cwd,
        timeout=timeout,
        check=False,
        input=stdin,
    )
    print("$ controlplane", " ".join(args), "\n", result.stdout, result.stderr)
    return result


def postmaster_pid(datadir: Path) -> int:
    return int((datadir / "postmaster.pid").read_text().split()[0])


def org_client(data_dir: Path, env: dict[str, str]) -> httpx.Client:
    """A client with a new organisation's key (made by the CLI, through the running `up`)."""
    made = run_cli(["orgs", "create", "acme", "--data-dir", str(data_dir)], env)
    assert made.returncode == 0, made.stderr
    key = re.search(r"cpk_\S+", made.stdout)
    assert key is not None
    return httpx.Client(
        base_url=f"http://127.0.0.1:{env['CONTROLPLANE_API_PORT']}",
        headers={"Authorization": f"Bearer {key.group(0)}"},
        timeout=10,  # a request blocked for 30 s fails the test
    )


@dataclass
class Served:
    """`controlplane serve` on a port of its own; `restart` stops it (SIGTERM) and starts it again."""

    database_url: str
    data_dir: Path
    port: int = field(default_factory=free_port)
    # Settings of the process beyond the database and the port (CONTROLPLANE_* variables).
    extra_env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CONTROLPLANE_")} | self.extra_env
        command = ["serve", "--database-url", self.database_url, "--api-port", str(self.port)]
        self.process = process = subprocess.Popen(
            [sys.executable, "-m", "controlplane.cli", *command, "--data-dir", str(self.data_dir)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 90  # a loaded machine starts Python slowly
        while True:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()  # not left running into the next tests
                process.wait()
                raise AssertionError("the API did not start")
            time.sleep(0.1)

    def killed(self, timeout: float = 15) -> bool:
        """Whether the process died of SIGKILL (a crash point) within `timeout`."""
        assert self.process is not None
        return self.process.wait(timeout=timeout) == -signal.SIGKILL

    def stop(self) -> int:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.terminate()
        return self.process.wait(timeout=15)
