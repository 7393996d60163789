"""End to end: `python3 dev.py up` on a fresh data directory, driven through the CLI as a person would."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

import psycopg
import yaml

from controlplane.core import exit_codes
from tests.up_support import run_cli, running_up, scratch_dir, up_env, wait_until_gone


def test_up_create_connect_delete_and_stop() -> None:
    with scratch_dir("cp-up-") as root:
        up_dir, env = root / "data", up_env(root)
        api_port = env["CONTROLPLANE_API_PORT"]
        # Through the launcher, as the README says; a Ctrl-C sent to it alone is passed on.
        with running_up(up_dir, env, launcher=True, stop_with=signal.SIGINT) as (up, output):
            walk_through(up_dir, env, api_port, "".join(output))
        log = "".join(output)
        assert up.returncode == 0, log[-4000:]
        assert "embedded PostgreSQL stopped" in log
        assert wait_until_gone(str(up_dir)) == []


def walk_through(up_dir: Path, env: dict[str, str], api_port: str, banner: str) -> None:
    """What a person does after `up`, as the README's quick start says, by name with the installed
    console script: an organisation, a login, a database used over TLS, its protection, a wait that
    times out, completion, output formats, its removal; then the SRE commands through the admin API."""
    assert f"http://127.0.0.1:{api_port}" in banner
    assert re.search(r"admin key .*\n\s+cpk_", banner)
    assert (up_dir / "admin.key").stat().st_mode & 0o777 == 0o600
    api = f"http://127.0.0.1:{api_port}"
    customer_env = dict(env)

    def cli(
        *args: str, code: int = 0, stdin: str | None = None, as_admin: bool = False
    ) -> subprocess.CompletedProcess[str]:
        # The organisation commands with the admin key (the profile holds the organisation's).
        admin_key = {"CONTROLPLANE_API_KEY": (up_dir / "admin.key").read_text().strip()}
        run_env = customer_env | admin_key if as_admin else customer_env
        result = run_cli(list(args), run_env, stdin=stdin)
        assert result.returncode == code, result.stderr
        if code and code != exit_codes.USAGE:  # argparse's usage errors print the usage first
            # A refusal is one line on stderr.
            assert result.stderr.count("\n") == 1 and result.stderr.startswith("controlplane: error: ")
        return result

    made = cli("orgs", "create", "acme", "--data-dir", str(up_dir), "--url", api)
    key = re.search(r"cpk_\S+", made.stdout)
    assert key is not None
    # login reads the key from standard input (here) or the terminal without echo; never prints it.
    logged = cli("login", "--profile", "acme", "--url", api, stdin=key.group(0) + "\n")
    assert key.group(0) not in logged.stdout + logged.stderr
    assert "organisation key" in logged.stdout
    config = Path(env["XDG_CONFIG_HOME"]) / "controlplane"
    assert key.group(0) not in (config / "config.toml").read_text()
    assert (config / "keys" / "acme").stat().st_mode & 0o777 == 0o600
    customer_env["CONTROLPLANE_PROFILE"] = "acme"
    # Organisations and keys through the API: a second acme is refused (4), keys listed never shown.
    refused = cli("orgs", "create", "acme", "--data-dir", str(up_dir), "--url", api, code=4, as_admin=True)
    assert "already exists" in refused.stderr
    assert "acme" in cli("orgs", "list", "--data-dir", str(up_dir), "--url", api, as_admin=True).stdout
    extra = cli("keys", "create", "--name", "ci", "-o", "json")
    listed = cli("keys", "list").stdout
    assert "ci" in listed and extra.stdout and json.loads(extra.stdout)["key"] not in listed
    assert "revoked" in cli("keys", "revoke", json.loads(extra.stdout)["id"]).stdout

    created = cli("instances", "create", "orders", "--plan", "dev", "--wait", "--timeout", "5m")
    uri = created.stdout.strip().splitlines()[-1]
    assert uri.startswith("postgresql://")
    assert re.search(r"orders \([0-9a-f-]{36}\) is ready", created.stdout)
    # TLS, the server's certificate checked against the control plane's CA (from the API).
    ca = cli("ca").stdout
    assert ca.startswith("-----BEGIN CERTIFICATE-----")
    assert "?sslmode=verify-full&sslrootcert=" in uri
    assert Path(uri.rpartition("sslrootcert=")[2]).read_text() == ca
    with psycopg.connect(
        cli("instances", "show", "orders", "--uri").stdout.strip(), connect_timeout=10
    ) as conn:
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY)")
        conn.execute("INSERT INTO orders VALUES (1)")
        assert conn.execute("SELECT count(*) FROM orders").fetchone() == (1,)
        assert conn.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone() == (True,)

    table = cli("instances", "list").stdout
    assert table.splitlines()[0].split() == ["name", "id", "plan", "state", "created_at"]
    assert re.search(r"^orders\s+[0-9a-f-]{36}\s+dev\s+ready\s+\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$", table, re.M)
    assert "\x1b[" not in table  # no colour off a terminal
    (instance,) = json.loads(cli("instances", "list", "-o", "json").stdout)
    assert (instance["name"], instance["state"]) == ("orders", "ready")
    assert yaml.safe_load(cli("instances", "show", "orders", "-o", "yaml").stdout)["id"] == instance["id"]

    # Exit codes scripts can use: not found 3, usage 2, conflict 4, timeout 5.
    assert "no instance named 'nope'" in cli("instances", "show", "nope", code=3).stderr
    cli("instances", "create", "x", "--plan", "huge", code=2)
    waited = cli("instances", "wait", "orders", "--for", "suspended", "--timeout", "1s", code=5)
    assert "timed out waiting for orders to be suspended (it is ready)" in waited.stderr
    assert "is ready" in cli("instances", "wait", "orders", "--for", "ready").stdout
    assert "deletion protection on" in cli("instances", "protection", "orders", "on").stdout
    assert "has deletion protection on" in cli("instances", "delete", "orders", code=4).stderr
    cli("instances", "protection", "orders", "off")

    # Completion: the script, and what it offers (commands, plans, the databases' names).
    assert "complete -o default -F _controlplane controlplane" in cli("completion", "bash").stdout
    assert "compdef _controlplane controlplane" in cli("completion", "zsh").stdout
    assert "complete -c controlplane" in cli("completion", "fish").stdout
    assert cli("__complete", "inst").stdout.split() == ["instances"]
    assert cli("__complete", "instances", "resize", "orders", "--plan", "").stdout.split() == [
        "dev",
        "small",
        "medium",
    ]
    assert cli("__complete", "instances", "show", "or").stdout.split() == ["orders"]

    deleted = cli("instances", "delete", "orders", "--wait")
    assert f"orders ({instance['id']}): deleted" in deleted.stdout
    assert cli("instances", "list").stdout.strip().splitlines()[1:] == []
    assert instance["id"] in cli("instances", "list", "--all").stdout
    events = cli("instances", "events", instance["id"])
    for step in ("create", "start_provisioning", "provisioned", "deprovision", "deprovisioned"):
        assert step in events.stdout

    # The SRE commands against the running control plane through the admin API.
    admin_env = env | {
        "CONTROLPLANE_URL": api,
        "CONTROLPLANE_API_KEY": (up_dir / "admin.key").read_text().strip(),
    }
    sre = run_cli(["events", "--instance", instance["id"], "-o", "json"], admin_env)
    assert sre.returncode == 0 and [e["to_state"] for e in json.loads(sre.stdout)][-1] == "deleted"
    jobs = run_cli(["jobs", "list", "--instance", instance["id"], "-o", "json"], admin_env)
    assert jobs.returncode == 0 and {j["kind"] for j in json.loads(jobs.stdout)} >= {
        "provision",
        "deprovision",
    }
    job_id = json.loads(jobs.stdout)[0]["id"]
    history = run_cli(["jobs", "events", job_id], admin_env)
    assert history.returncode == 0 and "enqueue" in history.stdout
    stuck = run_cli(["stuck"], admin_env)
    assert stuck.returncode == 0 and "instances past their deadline: 0" in stuck.stdout
    dwell = run_cli(["stats", "dwell", "-o", "json"], admin_env)
    assert dwell.returncode == 0 and json.loads(dwell.stdout)["entity"] == "instance"
