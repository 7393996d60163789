"""The console's browser tests: the control plane as its separate roles (API, worker, reconciler) over
one database and data directory, and Debian's Chromium driven by Playwright."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from controlplane.runtime.postgres import free_port
from controlplane.runtime.settings import Settings
from tests.provisioning_support import QUICK_RETRIES, WORKER_SETTINGS, real_instances, settings_env
from tests.support import ROOT

CLI = [sys.executable, "-m", "controlplane.cli"]
CHROMIUM = Path(shutil.which("chromium") or "/usr/bin/chromium")
# Chromium as the browser tests launch it (Playwright adds --headless and a fresh profile of its own).
CHROMIUM_ARGS = [
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
# Screenshots of every screen, kept by CI as the run's artifacts (gitignored).
ARTIFACTS = ROOT / "test-artifacts" / "console"
WEBHOOK_SECRET = "whsec_console_browser_tests"
# The settings every role of the stack shares (from the test's Settings), as variables.
SHARED = (*WORKER_SETTINGS, "retry_base_delay_s", "retry_max_delay_s")


def chromium_args() -> list[str]:
    """As root, Chromium runs only without its sandbox."""
    return [*CHROMIUM_ARGS, *(["--no-sandbox"] if os.geteuid() == 0 else [])]


class Stack:
    """`controlplane serve`, `worker` and `reconcile` as processes, as a deployment runs them (and
    as `up` runs them in one); the worker can be started again with faults injected."""

    def __init__(self, settings: Settings, logs: Path) -> None:
        self.logs = logs
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = settings_env(settings, SHARED) | {
            "CONTROLPLANE_API_PORT": str(self.port),
            "CONTROLPLANE_STRIPE_WEBHOOK_SECRET": WEBHOOK_SECRET,
            "CONTROLPLANE_RECONCILE_INTERVAL_S": "0.5",
            "CONTROLPLANE_SHUTDOWN_GRACE_S": "1",
            "CONTROLPLANE_LOG_FORMAT": "text",
            # No limits: the module's sign-ins and requests come from one address, as many a
            # minute as the machine allows (the limits have their own tests).
            "CONTROLPLANE_API_RATE_LIMIT": "0",
            "CONTROLPLANE_CONSOLE_SIGN_IN_LIMIT": "0",
            "PYTHONUNBUFFERED": "1",
        }
        self.env = env
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def _start(self, role: str, name: str, **extra: str) -> None:
        with (self.logs / f"{name}.log").open("ab") as log:
            self.procs[name] = subprocess.Popen(
                [*CLI, role],
                cwd=ROOT,
                env=self.env | extra,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def start(self) -> None:
        """The API first (it makes the secret key and, asked for it, the CA the others share)."""
        self.start_api()
        assert httpx.get(f"{self.url}/v1/ca.pem", timeout=10).status_code == 200
        self.start_worker()
        self._start("reconcile", "reconciler")

    def start_api(self) -> None:
        self._start("serve", "api")
        deadline = time.monotonic() + 60
        while not self._ready():
            if self.procs["api"].poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the API did not start:\n{self.log_text()}")
            time.sleep(0.1)

    def restart_api(self) -> None:
        """Stop the API (its watch streams end with it) and start it again."""
        self._stop(self.procs.pop("api"))
        self.start_api()

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def start_worker(self, faults: str = "") -> None:
        """A worker; with `faults` (CONTROLPLANE_FAULTS), its provisioner fails where they say."""
        self._start(
            "worker", "worker", CONTROLPLANE_FAULTS=faults, CONTROLPLANE_WORKER_ID=f"worker-{faults or 'ok'}"
        )

    def stop_worker(self) -> None:
        self._stop(self.procs.pop("worker"))

    def _stop(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def stop(self) -> None:
        for proc in self.procs.values():
            self._stop(proc)

    def log_text(self) -> str:
        return "".join(
            f"--- {p.name}\n{p.read_text(errors='replace')}" for p in sorted(self.logs.glob("*.log"))
        )


@contextlib.contextmanager
def running_stack(settings: Settings, logs: Path) -> Iterator[Stack]:
    stack = Stack(settings, logs)
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


def screenshot(page: Any, name: str) -> Path:
    """A full-page screenshot under test-artifacts/console/ (the path is printed for the report)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path.relative_to(ROOT)}")
    return path


@contextlib.contextmanager
def stack_on_a_copy(
    test_server: Any, template_url: str, pg_root: Path, logs: Path, prefix: str
) -> Iterator[tuple[Stack, str]]:
    """The roles as processes over a database of their own (a copy of the migrated template), with
    real instance servers under `pg_root`; the stack and its database's URL. Prints its logs' tail."""
    name = f"{prefix}_{os.getpid()}"
    test_server.drop_database(name)
    url = test_server.create_database(name, template=template_url.rsplit("/", 1)[1])
    try:
        with (
            real_instances(pg_root, url, **QUICK_RETRIES, job_max_attempts=2) as settings,
            running_stack(settings, logs) as running,
        ):
            yield running, url
            print(running.log_text()[-20000:])
    finally:
        test_server.drop_database(name)
