"""End to end: `python3 dev.py up` on a fresh data directory, driven through the CLI as a person would."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

import psycopg

from tests.up_support import run_cli, running_up, scratch_dir, up_env, wait_until_gone


def test_up_create_connect_delete_and_stop() -> None:
    with scratch_dir("cp-up-") as root:
        up_dir, env = root / "data", up_env(root)
        api_port = env["CONTROLPLANE_API_PORT"]
        # Through the launcher, as the README says; a Ctrl-C sent to it alone is passed on.
        with running_up(up_dir, env, launcher=True, stop_with=signal.SIGINT) as (up, output):
            walk_through(up_dir, env, api_port, "".join(output))
        rest = output[-1]
        assert up.returncode == 0, rest
        assert "embedded PostgreSQL stopped" in rest
        assert wait_until_gone(str(up_dir)) == []


def walk_through(up_dir: Path, env: dict[str, str], api_port: str, banner: str) -> None:
    """What a person does after `up`: an organisation, a database used over TLS, its removal."""
    assert f"http://127.0.0.1:{api_port}" in banner
    assert re.search(r"admin key .*\n\s+cpk_", banner)
    assert (up_dir / "admin.key").stat().st_mode & 0o777 == 0o600
    customer_env = env | {"CONTROLPLANE_URL": f"http://127.0.0.1:{api_port}"}

    def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = run_cli(list(args), customer_env)
        if check:
            assert result.returncode == 0, result.stderr
        return result

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
        assert conn.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone() == (True,)

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
