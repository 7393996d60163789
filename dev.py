#!/usr/bin/env python3
"""Bootstrap: creates the virtualenv, installs the project, then runs it, its tests or its benchmarks."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
USAGE = """usage: python3 dev.py up|test|chaos|bench|check|shell [args...]

  up     start the whole control plane (embedded PostgreSQL, API, worker, reconciler)
  test   run the test suite, then ruff, mypy and the import contracts
  chaos  the chaos soak: the control plane under load while its processes are killed
         (--minutes N, --seed S; writes chaos-report.md and .json)
  bench  run the benchmarks (own environment; writes bench/results/)
  check  ruff, mypy and the import contracts only
  shell  run a command inside the virtual environment, e.g. dev.py shell controlplane --help
"""


def venv_bin(name: str) -> str:
    return str(VENV / "bin" / name)


def has_system_postgres() -> bool:
    if shutil.which("postgres") and shutil.which("initdb"):
        return True
    return any(Path("/usr/lib/postgresql").glob("*/bin/postgres"))


# The pinned versions of every package installed (tests/unit/test_constraints.py checks them
# against pyproject.toml).
CONSTRAINTS = ROOT / "constraints.txt"


# What each command needs installed: running the product needs only its runtime (and the embedded
# server's fallback binaries when the system has none); the tests and the checks need the dev extra.
RUNTIME: frozenset[str] = frozenset()
DEV = frozenset({"dev"})
NEEDS = {"up": RUNTIME, "chaos": RUNTIME, "bench": RUNTIME, "shell": RUNTIME, "test": DEV, "check": DEV}
STAMP = VENV / ".installed"


def lock_digest() -> str:
    """What the installed versions depend on: pyproject.toml and constraints.txt."""
    return hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + CONSTRAINTS.read_bytes()).hexdigest()


def to_install(stamp: str | None, digest: str, needed: frozenset[str]) -> frozenset[str] | None:
    """The extras to install into the one venv, or None when what it holds will do.

    The stamp records the lock digest and the extras installed with it. Nothing is installed when
    the lock is the same and the extras needed are among those installed (`up` after `test` finds
    the dev extra there and installs nothing); otherwise the extras needed and those installed
    before, so that `test` after `up` adds the dev extra, and a changed lock keeps every extra the
    venv had, at its new versions."""
    try:
        recorded = json.loads(stamp) if stamp else {}
        installed = frozenset(recorded.get("extras", [])) if isinstance(recorded, dict) else frozenset()
        same_lock = isinstance(recorded, dict) and recorded.get("lock") == digest
    except ValueError:  # a stamp of an older dev.py: install again
        installed, same_lock = frozenset(), False
    if same_lock and needed <= installed:
        return None
    return needed | installed


def ensure_venv(command: str) -> None:
    """Create .venv and install the project at the versions of constraints.txt, with the extras
    `command` needs (NEEDS), once per change of either."""
    if not (VENV / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    needed = NEEDS[command] | (frozenset() if has_system_postgres() else frozenset({"embedded-fallback"}))
    digest = lock_digest()
    extras = to_install(STAMP.read_text() if STAMP.exists() else None, digest, needed)
    if extras is None:
        return
    pip = [venv_bin("python"), "-m", "pip", "install", "--quiet", "-c", str(CONSTRAINTS)]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    target = f"{ROOT}[{','.join(sorted(extras))}]" if extras else str(ROOT)
    print(f"+ installing {target} into {VENV}", flush=True)
    subprocess.run([*pip, "-e", target], check=True)
    STAMP.write_text(json.dumps({"lock": digest, "extras": sorted(extras)}))


# Debian packages, each found by a file it installs (or a command on the PATH): installed when
# missing (one apt-get as root, else one line saying how). pgBackRest: every local instance archives
# its WAL and keeps its backups with it; PgBouncer: every local instance's stable, pooled endpoint
# (`up`, the tests, the chaos soak and the bench all run local instances). For the tests only:
# Chromium: the console's browser tests drive it; libfaketime: the clock-skew tests LD_PRELOAD
# it into a worker; npm: the OpenAPI lint and the
# generated TypeScript client's test install their tools with it (tests/npm_tools.py); promtool:
# the alert rules' unit tests (tests/integration/test_deploy.py) run it.
CHROMIUM = Path("/usr/bin/chromium")
BROWSER_PACKAGES = ("chromium", "fonts-liberation")
LIBFAKETIME = "usr/lib/*/faketime/libfaketime.so.1"
# Debian ships promtool only in the Prometheus server's package (about 100 MB installed, with a
# few small JavaScript packages of its web UI); its recommendations (the node exporter and its
# collectors) are left out. On a host run by systemd the package also enables its own server
# (port 9090): `systemctl disable --now prometheus` if that host should not run one.
PROMTOOL = Path("/usr/bin/promtool")
PROMTOOL_PACKAGES = ("prometheus",)
LEAN = ("--no-install-recommends",)
PGBACKREST = Path("/usr/bin/pgbackrest")
PGBOUNCER = Path("/usr/sbin/pgbouncer")
# What each command needs: (package names, the file or command that says they are installed).
RUNTIME_PACKAGES = ((("pgbackrest",), str(PGBACKREST)), (("pgbouncer",), str(PGBOUNCER)))
TEST_PACKAGES = (
    *RUNTIME_PACKAGES,
    (BROWSER_PACKAGES, str(CHROMIUM)),
    (("libfaketime",), "/" + LIBFAKETIME),
    (("npm",), "npm"),  # the OpenAPI lint and the TypeScript client's test install with it
)


def debian_install(
    missing: tuple[str, ...], is_root: bool, why: str, options: tuple[str, ...] = ()
) -> list[list[str]] | str | None:
    """Nothing when no package is missing, the apt-get commands that install them when we are
    root, else the one line that says how (`why` says what needs them)."""
    if not missing:
        return None
    install = ["apt-get", "install", "-y", *options, *missing]
    if not is_root:
        return f"{why}: run `sudo {' '.join(install)}` (or run this as root)"
    return [["apt-get", "update"], install]


def browser_install(chromium_present: bool, is_root: bool) -> list[list[str]] | str | None:
    """What `test` does for the browser tests' Chromium."""
    missing = () if chromium_present else BROWSER_PACKAGES
    return debian_install(missing, is_root, f"{CHROMIUM} is missing and the console's browser tests need it")


def promtool_install(promtool_present: bool, is_root: bool) -> list[list[str]] | str | None:
    """What `test` does for the alert rules' promtool (without the package's recommendations)."""
    missing = () if promtool_present else PROMTOOL_PACKAGES
    return debian_install(missing, is_root, f"{PROMTOOL} is missing and the alert rules' tests need it", LEAN)


def missing_packages(
    needed: tuple[tuple[tuple[str, ...], str], ...], present: Callable[[str], bool]
) -> tuple[str, ...]:
    """The packages of `needed` whose file (a path, a glob from /, or a command) `present` does not
    find."""
    return tuple(name for packages, found_by in needed if not present(found_by) for name in packages)


def _present(found_by: str) -> bool:
    if not found_by.startswith("/"):
        return shutil.which(found_by) is not None
    return any(Path("/").glob(found_by.lstrip("/"))) if "*" in found_by else Path(found_by).exists()


def ensure_debian_packages(command: str) -> None:
    needed = TEST_PACKAGES if command == "test" else RUNTIME_PACKAGES
    is_root = os.geteuid() == 0
    plans = [
        debian_install(
            missing_packages(needed, _present), is_root, "Debian packages the control plane needs are missing"
        )
    ]
    if command == "test":
        plans.append(promtool_install(PROMTOOL.exists(), is_root))
    done: list[list[str]] = []
    for plan in plans:
        if isinstance(plan, str):
            print(plan, file=sys.stderr)
            continue
        for command_line in plan or []:
            if command_line in done:  # one `apt-get update` is enough
                continue
            print("+", " ".join(command_line), flush=True)
            subprocess.run(command_line, check=True, env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
            done.append(command_line)


# Signals that stop the child: passed on to it, and we wait for it to finish (SIGTERM is what
# `timeout`, systemd and a plain `kill` send; SIGINT is Ctrl-C).
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def run(argv: list[str]) -> int:
    """Run `argv` in the venv; stopping it is the child's to do (it stops cleanly), not ours."""
    env = dict(os.environ, PATH=f"{VENV / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    with subprocess.Popen(argv, cwd=ROOT, env=env) as child:

        def forward(signum: int, _frame: object) -> None:
            # A terminal's Ctrl-C reaches the child too; a signal sent to us alone is passed on.
            if child.poll() is None:
                child.send_signal(signum)

        previous = {signum: signal.signal(signum, forward) for signum in FORWARDED}
        try:
            return child.wait()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def checks() -> int:
    code = run([venv_bin("ruff"), "check", "."])
    code = code or run([venv_bin("mypy")])
    # The layering (pyproject.toml, [tool.importlinter]): the pure core, provisioners, the API.
    return code or run([venv_bin("lint-imports")])


def main() -> int:
    if sys.version_info < (3, 11):  # noqa: UP036 (this script may be started by an older Python)
        print("controlplane needs Python 3.11 or newer", file=sys.stderr)
        return 2
    if len(sys.argv) < 2 or sys.argv[1] not in {"up", "test", "chaos", "bench", "check", "shell"}:
        print(USAGE, file=sys.stderr)
        return 2
    command, rest = sys.argv[1], sys.argv[2:]
    ensure_venv(command)
    if command in {"up", "test", "chaos", "bench"}:
        ensure_debian_packages(command)
    if command == "up":
        return run([venv_bin("controlplane"), "up", *rest])
    if command == "test":
        code = run([venv_bin("python"), "-m", "pytest", *rest])
        return code or checks()
    if command == "check":
        return checks()
    if command == "chaos":
        return run([venv_bin("python"), "-m", "controlplane.chaos", *rest])
    if command == "bench":
        return run([venv_bin("python"), "-m", "bench", *rest])
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
