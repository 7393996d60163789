"""End to end: `python3 dev.py up` on a fresh data directory, driven through the CLI as a person would."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from controlplane.postgres import free_port
from tests.up_support import CLI, ROOT, drain, processes_mentioning, read_until


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
        "XDG_CONFIG_HOME": str(up_dir.parent / "config"),
    }
    # Through the launcher, as the README says; a Ctrl-C sent to it alone is passed on.
    up = subprocess.Popen(
        [sys.executable, "dev.py", "up", "--data-dir", str(up_dir), "--api-port", str(api_port)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
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
        # TLS, the server's certificate checked against the control plane's CA (from the API).
        ca = cli("ca").stdout
        assert ca.startswith("-----BEGIN CERTIFICATE-----")
        assert "?sslmode=verify-full&sslrootcert=" in uri
        assert Path(uri.rpartition("sslrootcert=")[2]).read_text() == ca
        with psycopg.connect(uri, connect_timeout=10) as conn:
            conn.execute("CREATE TABLE orders (id int PRIMARY KEY)")
            conn.execute("INSERT INTO orders VALUES (1)")
            assert conn.execute("SELECT count(*) FROM orders").fetchone() == (1,)
            assert conn.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone() == (
                True,
            )

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
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
        rest = drain(up)
        print(rest)
    assert up.returncode == 0, rest
    assert "embedded PostgreSQL stopped" in rest
    assert processes_mentioning(str(up_dir)) == []
