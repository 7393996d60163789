"""Child processes of the bench: started in their own process group, all stopped on the way out."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


class DriverError(RuntimeError):
    """A driver process failed or printed no result."""


class Processes:
    """Every process the bench starts, so that all of them can be stopped, whatever happens."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._live: list[subprocess.Popen[str]] = []
        self._count = 0
        self._logs: dict[int, tuple[str, Path]] = {}

    def start(
        self,
        argv: Sequence[str],
        *,
        name: str,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen[str]:
        """Start `argv` in a new session; its stdout is piped, its stderr goes to a log file."""
        self._count += 1
        log = self.log_dir / f"{self._count:03d}-{name}.log"
        with log.open("w") as stderr:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env=dict(env) if env is not None else None,
                cwd=cwd or ROOT,
                start_new_session=True,
            )
        self._logs[proc.pid] = (name, log)
        self._live.append(proc)
        return proc

    def wait_json(self, proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
        """Wait for a driver and return the JSON object on its last stdout line."""
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop(proc, grace_s=0)
            raise DriverError(f"{self.describe(proc)} did not finish within {timeout:.0f} s") from None
        # Interrupted (Ctrl-C, SIGTERM): the process stays registered, for stop_all().
        self._forget(proc)
        lines = [line for line in out.splitlines() if line.strip()]
        if proc.returncode != 0 or not lines:
            raise DriverError(f"{self.describe(proc)} exited with {proc.returncode}: {self.log_tail(proc)}")
        result: dict[str, Any] = json.loads(lines[-1])
        return result

    def describe(self, proc: subprocess.Popen[str]) -> str:
        name, log = self._logs.get(proc.pid, ("process", Path("?")))
        return f"{name} (pid {proc.pid}, log {log})"

    def log_tail(self, proc: subprocess.Popen[str]) -> str:
        entry = self._logs.get(proc.pid)
        return tail(entry[1]) if entry else "(no log)"

    def run_json(
        self,
        argv: Sequence[str],
        *,
        name: str,
        timeout: float,
        env: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        return self.wait_json(self.start(argv, name=name, env=env), timeout)

    def kill(self, proc: subprocess.Popen[str], sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group of `proc` (a driver and anything it started)."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)

    def stop(self, proc: subprocess.Popen[str], grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s`; waits for the process."""
        if proc.poll() is None:
            self.kill(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.kill(proc)
                proc.wait(timeout=10)
        # Members of the group may outlive their leader: make sure none is left.
        self.kill_group(proc.pid)
        self._forget(proc)

    @staticmethod
    def kill_group(pgid: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)

    def _forget(self, proc: subprocess.Popen[str]) -> None:
        if proc in self._live:
            self._live.remove(proc)
        if proc.stdout is not None and proc.poll() is not None:
            proc.stdout.close()

    def stop_all(self) -> None:
        for proc in list(self._live):
            self.stop(proc, grace_s=2.0)


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_for(predicate: Any, timeout: float, interval: float = 0.05, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
