"""What the CLI prints: lists joined, durations in words, unset values as `none`, one header case,
the password hidden in `instances show`'s table, `--columns` and `--limit` on lists."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.cli import common, main
from controlplane.cli.render import masked, window_rows
from controlplane.core import exit_codes
from tests.fake_api import Answer, fake_api

URI = "postgresql://app:s3cret@127.0.0.1:5433/app?sslmode=require"
INSTANCE = {
    "id": "5b1e0c52-8d4f-4c7e-9a51-0d2f6b3f9e10",
    "name": "orders",
    "plan": "dev",
    "state": "ready",
    "state_info": {"label": "Ready", "severity": "healthy", "billing": "billed"},
    "allowed_actions": ["resize", "delete", "backup"],
    "time_in_state_s": 90061.5,
    "deadline_at": None,
    "created_at": "2026-01-31T12:00:00Z",
    "connection": {
        "host": "127.0.0.1",
        "port": 5433,
        "dbname": "app",
        "user": "app",
        "password": "s3cret",
        "uri": URI,
    },
}


@pytest.fixture(autouse=True)
def own_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in [n for n in os.environ if n.startswith("CONTROLPLANE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    yield


def run(server_url: str, *argv: str) -> int:
    return main([*argv, "--url", server_url, "--api-key", "cpk_test"])


def test_values_as_a_person_reads_them() -> None:
    assert common.cell_text(["resize", "delete"]) == "resize, delete"
    assert common.cell_text(604800.0) == "604800" and common.cell_text(0.25) == "0.25"
    assert common.field_text("grace_period_s", 604800.0) == "7 d (604800 s)"
    assert common.field_text("time_in_state_s", 90061.5) == "1 d 1 h (90061.5 s)"
    assert common.field_text("time_in_state_s", 0.222) == "0.222 s"
    assert common.field_text("status", None) == "none" and common.field_text("allowed_actions", []) == "none"
    assert [common.duration_text(s) for s in (42, 303, 12_300, 2.5)] == [
        "42 s",
        "5 min 3 s",
        "3 h 25 min",
        "2.5 s",
    ]


def test_the_password_is_hidden_in_the_table_and_whole_with_uri_or_json(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert masked(URI) == "postgresql://app:****@127.0.0.1:5433/app?sslmode=require"
    with fake_api(Answer(200, INSTANCE)) as server:
        assert run(server.url, "instances", "show", "orders") == 0
        table = capsys.readouterr().out
        assert run(server.url, "instances", "show", "orders", "--uri") == 0
        assert capsys.readouterr().out.strip() == URI
        assert run(server.url, "instances", "show", "orders", "-o", "json") == 0
        assert json.loads(capsys.readouterr().out)["connection"]["uri"] == URI
    assert "s3cret" not in table and "app:****@127.0.0.1" in table
    lines = {line.split()[0]: line.split(None, 1)[1] for line in table.splitlines()[1:]}
    assert lines["allowed_actions"] == "resize, delete, backup"
    assert lines["time_in_state_s"] == "1 d 1 h (90061.5 s)" and lines["deadline_at"] == "none"
    assert table.splitlines()[0].split() == ["field", "value"]


def test_billing_shows_no_empty_row_and_the_grace_period_in_days(capsys: pytest.CaptureFixture[str]) -> None:
    state = {"hold": False, "status": None, "past_due_since": None, "suspends_at": None,
             "grace_period_s": 604800.0, "deprovision_after_days": None}  # fmt: skip
    with fake_api(Answer(200, state)) as server:
        assert run(server.url, "billing") == 0
    rows = [line.split(None, 1) for line in capsys.readouterr().out.splitlines()[1:]]
    assert all(len(row) == 2 for row in rows)
    assert dict(rows)["grace_period_s"] == "7 d (604800 s)" and dict(rows)["status"] == "none"


PAGE = {"items": [{**INSTANCE, "name": f"db{i}", "id": f"id-{i}"} for i in range(3)], "next_cursor": "next"}


def test_columns_and_limit(capsys: pytest.CaptureFixture[str]) -> None:
    with fake_api(Answer(200, PAGE)) as server:
        assert run(server.url, "instances", "list", "--columns", "name,allowed_actions", "--limit", "2") == 0
        table = capsys.readouterr().out.splitlines()
        assert (
            run(server.url, "instances", "list", "--columns", "state,name", "-o", "json", "--limit", "1") == 0
        )
        picked = json.loads(capsys.readouterr().out)
    with fake_api(Answer(200, PAGE), Answer(200, {"items": [], "next_cursor": None})) as every:
        assert run(every.url, "instances", "list", "--columns", "name,colour") == exit_codes.USAGE
        refused = capsys.readouterr().err
    assert [r.path for r in every.received] == [
        "/v1/instances?limit=100&live=true",
        "/v1/instances?limit=100&live=true&cursor=next",
    ]
    assert table == [
        "name  allowed_actions",
        "db0   resize, delete, backup",
        "db1   resize, delete, backup",
    ]
    assert picked == [{"state": "ready", "name": "db0"}]
    assert "no column colour; the columns are name, id, plan, state, created_at" in refused
    assert len(refused.splitlines()) == 1
    # --limit asked for a page of that size and stopped there (the page said there was more).
    assert [r.path for r in server.received] == [
        "/v1/instances?limit=2&live=true",
        "/v1/instances?limit=1&live=true",
    ]


def test_every_table_header_is_lower_case() -> None:
    from controlplane.cli import jobs_commands, sre_commands

    for listing in (jobs_commands.JOBS, jobs_commands.JOB_EVENTS, sre_commands.EVENTS):
        assert all(column == column.lower() for column in listing.columns)
    for module in (jobs_commands, sre_commands):
        source = Path(module.__file__ or "").read_text()
        assert '("ID"' not in source and '"STATE"' not in source


def test_usage_names_the_databases_and_shows_storage_in_gb_hours(capsys: pytest.CaptureFixture[str]) -> None:
    line = {"plan": "dev", "billing": "billed", "seconds": 7200.0, "storage_gb_seconds": 3 * 3600.0}
    report = {
        "from": "2026-01-01T00:00:00Z",
        "to": "2026-02-01T00:00:00Z",
        "as_of": "2026-01-31T00:00:00Z",
        "items": [{"instance_id": "id-1", **line}],
        "totals": [line],
    }
    names = {"items": [{**INSTANCE, "id": "id-1", "name": "orders"}], "next_cursor": None}
    with fake_api(Answer(200, report), Answer(200, names)) as server:
        assert run(server.url, "usage", "--from", "2026-01-01T00:00:00Z") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["instance", "plan", "billing", "time", "storage"]
    assert out[2].split()[:3] == ["orders", "dev", "billed"] and "id-1" not in out[2]
    assert out[2].endswith("3.00 GB-h") and out[-1].endswith("3.00 GB-h")
    assert server.received[1].path == "/v1/instances?limit=100&include=archived"


def test_the_window_before_the_archive_passes_the_first_backup_is_not_shown_backwards() -> None:
    first = {"earliest": "2026-12-02T08:38:32Z", "archive": {"healthy": True}}
    behind = dict(window_rows(first | {"latest": "2026-12-02T08:38:31.548386Z"}))
    assert behind["restorable from"] == "2026-12-02T08:38:32Z"
    assert behind["restorable until"].startswith("not yet")
    caught_up = dict(window_rows(first | {"latest": "2026-12-02T08:39:01Z"}))
    assert caught_up["restorable until"] == "2026-12-02T08:39:01Z"
    assert dict(window_rows({}))["restorable from"] == "nothing yet (no backup held)"
