"""End to end: `controlplane up` on a fresh data directory, driven through the CLI as a person would."""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from controlplane.postgres import free_port

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


def read_until(proc: subprocess.Popen[bytes], pattern: str, timeout: float) -> str:
    """`proc`'s output up to the first line matching `pattern` (fails on timeout or exit).

    Reads the pipe's file descriptor directly: a buffered reader could hold lines that select()
    no longer reports.
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
        text += chunk.decode(errors="replace")
        for line in text.splitlines():
            if re.search(pattern, line):
                return text
    raise AssertionError(f"no line matching {pattern!r}; output so far:\n{text}")


@pytest.fixture
def up_dir() -> Iterator[Path]:
    """A data directory the server user can reach (pytest's tmp_path parents are private)."""
    root = Path(tempfile.mkdtemp(prefix="cp-up-"))
    os.chmod(root, 0o755)
    yield root / "data"
    shutil.rmtree(root, ignore_errors=True)


def test_up_create_connect_delete_and_stop(up_dir: Path) -> None:
    api_port = free_port()
    instance_port = free_port()
    env = {key: value for key, value in os.environ.items() if not key.startswith("CONTROLPLANE_")} | {
        "CONTROLPLANE_LOCAL_PORT_MIN": str(instance_port),
        "CONTROLPLANE_LOCAL_PORT_MAX": str(instance_port + 20),
        "CONTROLPLANE_RECONCILE_INTERVAL_S": "0.5",
        "PYTHONUNBUFFERED": "1",
    }
    up = subprocess.Popen(
        [*CLI, "up", "--data-dir", str(up_dir), "--api-port", str(api_port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        banner = read_until(up, r"Ctrl-C stops everything", timeout=300)
        print(banner)
        assert f"http://127.0.0.1:{api_port}" in banner
        assert re.search(r"admin key .*\n\s+cpk_", banner)
        assert (up_dir / "admin.key").stat().st_mode & 0o777 == 0o600

        def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
            result = subprocess.run(
                [*CLI, *args], capture_output=True, text=True, env=customer_env, timeout=180
            )
            print("$ controlplane", " ".join(args), "\n", result.stdout, result.stderr)
            if check:
                assert result.returncode == 0, result.stderr
            return result

        customer_env = env | {"CONTROLPLANE_URL": f"http://127.0.0.1:{api_port}"}
        made = cli("orgs", "create", "acme", "--data-dir", str(up_dir))
        key = re.search(r"cpk_\S+", made.stdout)
        assert key is not None
        customer_env["CONTROLPLANE_API_KEY"] = key.group(0)

        created = cli("instances", "create", "orders", "--plan", "dev", "--wait")
        uri = created.stdout.strip().splitlines()[-1]
        assert uri.startswith("postgresql://")
        assert "ready" in created.stdout
        with psycopg.connect(uri, connect_timeout=10) as conn:
            conn.execute("CREATE TABLE orders (id int PRIMARY KEY)")
            conn.execute("INSERT INTO orders VALUES (1)")
            assert conn.execute("SELECT count(*) FROM orders").fetchone() == (1,)

        listed = cli("instances", "list", "--json")
        (instance,) = json.loads(listed.stdout)
        refused = cli("instances", "show", "not-an-id", check=False)
        assert refused.returncode == 1 and refused.stderr.count("\n") == 1
        assert refused.stderr.startswith("controlplane: error: HTTP 422")

        assert cli("instances", "show", instance["id"], "--uri").stdout.strip() == uri
        deleted = cli("instances", "delete", instance["id"], "--wait")
        assert "deleted" in deleted.stdout
        events = cli("instances", "events", instance["id"])
        for step in ("create", "start_provisioning", "provisioned", "deprovision", "deprovisioned"):
            assert step in events.stdout
    finally:
        up.send_signal(signal.SIGINT)
        try:
            output, _ = up.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
            output, _ = up.communicate()
        rest = output.decode(errors="replace")
        print(rest)
    assert up.returncode == 0, rest
    assert "embedded PostgreSQL stopped" in rest
    assert processes_mentioning(str(up_dir)) == []
