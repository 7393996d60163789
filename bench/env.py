"""The bench's own environment: the peers' virtualenv (bench/.venv) and the load-generator tool."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
PEERS_VENV = BENCH_DIR / ".venv"
# The peers are installed here only, never as dependencies of the project. Every Python
# variant, ours and theirs, runs on uvloop, the loop the control plane's processes use.
PEER_REQUIREMENTS = ("procrastinate==3.10.0", "pgqueuer[asyncpg]==1.6.0", "psycopg[binary]", "uvloop==0.23.0")
PROFILER_REQUIREMENTS = ("py-spy",)


def peers_python() -> str:
    return str(PEERS_VENV / "bin" / "python")


def ensure_peers_venv(log: object = print) -> str:
    """Create bench/.venv and install the peers once per requirement change; return its python."""
    requirements = (*PEER_REQUIREMENTS, *PROFILER_REQUIREMENTS)
    stamp = PEERS_VENV / ".installed"
    digest = hashlib.sha256("\n".join(requirements).encode()).hexdigest()
    if stamp.exists() and stamp.read_text() == digest and Path(peers_python()).exists():
        return peers_python()
    assert callable(log)
    log(f"setting up {PEERS_VENV.relative_to(ROOT)} with {', '.join(requirements)}")
    base = getattr(sys, "_base_executable", sys.executable)
    if not Path(peers_python()).exists():
        subprocess.run([base, "-m", "venv", str(PEERS_VENV)], check=True)
    pip = [peers_python(), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, *requirements], check=True)
    stamp.write_text(digest)
    return peers_python()


def ensure_wrk(log: object = print) -> str | None:
    """The HTTP load generator `wrk`, installed with apt-get when missing; None when it cannot be."""
    found = shutil.which("wrk")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return None
    assert callable(log)
    log("installing wrk (apt-get)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "wrk"]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": env, "check": False}
    if subprocess.run(install, **quiet).returncode != 0:  # type: ignore[call-overload]
        subprocess.run(["apt-get", "update", "-q"], **quiet)  # type: ignore[call-overload]
        subprocess.run(install, **quiet)  # type: ignore[call-overload]
    return shutil.which("wrk")


def py_spy() -> str | None:
    """py-spy from the bench venv (for --profile)."""
    candidate = PEERS_VENV / "bin" / "py-spy"
    return str(candidate) if candidate.exists() else shutil.which("py-spy")
