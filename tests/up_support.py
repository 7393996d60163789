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
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "controlplane.cli"]


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


def read_until(
    proc: subprocess.Popen[bytes], pattern: str, timeout: float, seen: list[str] | None = None
) -> str:
    """`proc`'s output up to the first line matching `pattern` (fails on timeout or exit).

    Reads the pipe's file descriptor directly: a buffered reader could hold lines that select()
    no longer reports. `seen` collects everything read, across calls.
    """
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    text = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if not ready:
            if proc.poll() is not None:
                break
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        piece = chunk.decode(errors="replace")
        text += piece
        if seen is not None:
            seen.append(piece)
        for line in text.splitlines():
            if re.search(pattern, line):
                return text
    raise AssertionError(f"no line matching {pattern!r}; output so far:\n{text}")


def drain(proc: subprocess.Popen[bytes], timeout: float = 5) -> str:
    """What `proc` still writes until its pipe closes or `timeout` passes (never blocks longer:
    a child that outlived it may hold the pipe open)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    text = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            text += chunk.decode(errors="replace")
    return text


def clean_env(**settings: str) -> dict[str, str]:
    """The test's environment without CONTROLPLANE_* variables, plus `settings` as variables."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("CONTROLPLANE_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update({f"CONTROLPLANE_{key.upper()}": value for key, value in settings.items()})
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


def run_cli(
    args: list[str], env: Mapping[str, str], cwd: Path | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [*CLI, *args], capture_output=True, text=True, env=dict(env), cwd=cwd, timeout=timeout, check=False
    )
    print("$ controlplane", " ".join(args), "\n", result.stdout, result.stderr)
    return result
