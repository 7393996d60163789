"""`up` as a real process tree: it outlives a kill -9 of its own PostgreSQL, holds its data directory
against a second `up`, stops everything on the launcher's SIGTERM, refuses a busy port in one line,
and the client commands never start a database server of their own."""

from __future__ import annotations

import json
import os
import signal
import socket

import psycopg
import pytest

from controlplane.core import exit_codes
from controlplane.runtime.postgres import free_port
from tests.support import eventually_sync
from tests.up_support import (
    clean_env,
    org_client,
    postmaster_pid,
    processes_mentioning,
    read_until,
    run_cli,
    running_up,
    scratch_dir,
    up_env,
    wait_until_gone,
)


def one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    assert "Traceback" not in text
    return lines[0]


def test_up_restarts_its_killed_postgres_and_requests_fail_fast_meanwhile() -> None:
    with scratch_dir("cp-sup-") as root:
        data_dir, env = root / "data", up_env(root)
        with (
            running_up(data_dir, env, launcher=False) as (up, output),
            org_client(data_dir, env) as client,
        ):
            assert client.get("/v1/instances").status_code == 200

            # kill -9 of the embedded postmaster: a 503 problem at once, the outage in /readyz.
            embedded = data_dir / "db" / "pg"
            os.kill(postmaster_pid(embedded), signal.SIGKILL)
            outage = client.get("/readyz")
            assert outage.status_code == 503, outage.text
            assert outage.headers["content-type"] == "application/problem+json"
            refused = client.get("/v1/instances")
            assert refused.status_code == 503
            assert refused.headers["content-type"] == "application/problem+json"
            assert int(refused.headers["retry-after"]) >= 1

            # `up` restarts its server by itself; the pools reconnect; service returns.
            read_until(up, r"embedded PostgreSQL is back", timeout=60, seen=output)
            eventually_sync(lambda: client.get("/readyz").status_code == 200, "/readyz is 200 again", 30)
            eventually_sync(
                lambda: client.get("/v1/instances").status_code == 200, "the API serves again", 30
            )
            assert client.post("/v1/instances", json={"name": "after", "plan": "dev"}).status_code == 202

            # And it still stops promptly (the 30 s bound is the context manager's wait).
            up.send_signal(signal.SIGINT)
            up.wait(timeout=30)
        log = "".join(output)
        assert "embedded PostgreSQL (port" in log and "is not running; restarting it" in log
        assert "the database is available again" in log
        assert up.returncode == 0
        assert wait_until_gone(str(data_dir)) == []


def test_a_second_up_is_refused_and_sigterm_to_the_launcher_stops_everything() -> None:
    with scratch_dir("cp-lock-") as root:
        data_dir, env = root / "data", up_env(root)
        with (
            running_up(data_dir, env, launcher=True) as (launcher, output),
            org_client(data_dir, env) as client,
        ):
            created = client.post("/v1/instances", json={"name": "orders", "plan": "dev"}).json()
            instance_dir = data_dir / "instances" / created["id"] / "pgdata"
            eventually_sync(
                lambda: client.get(f"/v1/instances/{created['id']}").json()["state"] == "ready",
                "the instance is ready",
                120,
            )
            servers = (postmaster_pid(data_dir / "db" / "pg"), postmaster_pid(instance_dir))

            # A second `up` on the same data directory: one line naming the holder, exit 6 (busy),
            # nothing of the first one touched.
            second_env = env | {"CONTROLPLANE_API_PORT": str(free_port())}
            second = run_cli(["up", "--data-dir", str(data_dir)], second_env, timeout=60)
            assert second.returncode == exit_codes.UNAVAILABLE
            line = one_line(second.stdout + second.stderr)
            holder = int((data_dir / "up.lock").read_text())
            assert f"pid {holder}" in line and holder != launcher.pid, line
            assert client.get("/readyz").status_code == 200
            assert (postmaster_pid(data_dir / "db" / "pg"), postmaster_pid(instance_dir)) == servers

            # SIGTERM to the launcher alone: passed on, and `up` stops everything.
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(timeout=30)
        assert launcher.returncode == 0
        log = "".join(output)
        assert "stopped 1 instance server(s)" in log and "embedded PostgreSQL stopped" in log
        assert wait_until_gone(str(data_dir)) == []

        # A client command while `up` is stopped says so in one line and starts nothing.
        stuck = run_cli(["stuck", "--data-dir", str(data_dir)], env)
        assert stuck.returncode == exit_codes.UNAVAILABLE
        assert "not running" in one_line(stuck.stderr)
        assert processes_mentioning(str(data_dir)) == []
        port = int(json.loads((data_dir / "db" / "embedded.json").read_text())["port"])
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(f"host=127.0.0.1 port={port} connect_timeout=2")


def test_a_busy_api_port_is_refused_in_one_line_before_anything_starts() -> None:
    with scratch_dir("cp-port-") as root, socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        data_dir = root / "data"
        result = run_cli(
            ["up", "--data-dir", str(data_dir), "--api-port", str(port)], clean_env(), timeout=60
        )
        assert result.returncode != 0
        line = one_line(result.stdout + result.stderr)
        assert str(port) in line and "--api-port" in line
        assert "controlplane is up" not in result.stdout
        assert processes_mentioning(str(root)) == []
        assert not (data_dir / "db").exists()  # refused before the embedded server was made


def test_a_client_command_in_an_empty_directory_starts_no_server() -> None:
    with scratch_dir("cp-empty-") as root:
        result = run_cli(["stuck"], clean_env(), cwd=root, timeout=60)
        assert result.returncode == exit_codes.UNAVAILABLE
        line = one_line(result.stderr)
        assert "CONTROLPLANE_DATABASE_URL" in line
        assert processes_mentioning(str(root)) == []
        assert list(root.iterdir()) == []
