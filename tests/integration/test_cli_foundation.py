"""The foundation commands: `controlplane lifecycle` and `controlplane migrate`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from controlplane.cli import main
from controlplane.core import lifecycle, reference
from controlplane.db import connection as db
from controlplane.runtime.settings import Settings

CONSOLE_SCRIPT = Path(sys.executable).parent / "controlplane"


def expected_json(table: lifecycle.Lifecycle) -> dict[str, object]:
    return {
        "states": list(table.states),
        "initial": table.initial,
        "terminal": sorted(table.terminal),
        "transitions": [
            {"from": src, "event": event, "to": dst} for (src, event), dst in table.transitions.items()
        ],
    }


def tables_only(table: dict[str, Any]) -> dict[str, object]:
    """A published table without its metadata."""
    moves = [{k: m[k] for k in ("from", "event", "to")} for m in table["transitions"]]
    return {**{k: table[k] for k in ("states", "initial", "terminal")}, "transitions": moves}


def test_lifecycle_json_equals_the_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lifecycle", "--format", "json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert list(printed)[:2] == ["instance", "job"]
    assert {name: tables_only(printed[name]) for name in ("instance", "job")} == {
        "instance": expected_json(lifecycle.INSTANCE),
        "job": expected_json(lifecycle.JOB),
    }
    # The metadata as the API publishes it, with the deadlines of the settings in force.
    assert printed == json.loads(json.dumps(reference.lifecycle_document(Settings().reconciler.deadline_s)))
    instance, job = printed["instance"], printed["job"]
    assert (instance["initial"], instance["terminal"]) == ("pending", ["deleted", "failed"])
    assert (job["initial"], job["terminal"]) == ("queued", ["abandoned", "completed"])
    assert (len(instance["states"]), len(instance["transitions"])) == (9, 18)
    assert (len(job["states"]), len(job["transitions"])) == (7, 11)
    for entity, table in lifecycle.LIFECYCLES.items():
        edges = {(t["from"], t["event"]): t["to"] for t in printed[entity]["transitions"]}
        assert edges == dict(table.transitions)


def test_lifecycle_mermaid_has_both_diagrams_with_every_edge(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lifecycle", "--format", "mermaid"]) == 0
    out = capsys.readouterr().out
    assert out.count("stateDiagram-v2") == 2
    instance_part, job_part = out.split("%% job lifecycle")
    assert instance_part.lstrip().startswith("%% instance lifecycle")
    for part, table in ((instance_part, lifecycle.INSTANCE), (job_part, lifecycle.JOB)):
        lines = {line.strip() for line in part.splitlines()}
        for (src, event), dst in table.transitions.items():
            assert f"{src} --> {dst}: {event}" in lines
        assert f"[*] --> {table.initial}: {table.creation_event}" in lines
        for state in table.terminal:
            assert f"{state} --> [*]" in lines
        edge_lines = [line for line in lines if "-->" in line and "[*]" not in line]
        assert len(edge_lines) == len(table.transitions)


def test_lifecycle_table_format_lists_every_edge(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lifecycle"]) == 0
    out = capsys.readouterr().out
    assert "instance: initial pending; terminal deleted, failed" in out
    assert "job: initial queued; terminal abandoned, completed" in out
    assert out.count("-->") == 18 + 11


def test_migrate_brings_an_empty_database_to_head(empty_database: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONTROLPLANE_")}

    def migrate() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(CONSOLE_SCRIPT), "migrate", "--database-url", empty_database],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )

    result = migrate()
    assert result.returncode == 0, result.stderr
    head = db.head_revision()
    assert result.stdout.strip() == f"database migrated to revision {head}"
    with psycopg.connect(empty_database) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [(head,)]
        assert conn.execute("SELECT count(*) FROM lifecycle_transitions").fetchone() == (29,)

    # Running it again is a no-op.
    again = migrate()
    assert again.returncode == 0, again.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--heal-backoff-base-s", "60", "--heal-backoff-max-s", "30"],
            "CONTROLPLANE_HEAL_BACKOFF_BASE_S must be at least 0 and at most CONTROLPLANE_HEAL_BACKOFF_MAX_S"
            " (30.0), not '60.0'",
        ),
        (["--worker-concurrency", "0"], "CONTROLPLANE_WORKER_CONCURRENCY must be at least 1, not '0'"),
    ],
)
def test_settings_out_of_range_are_refused_in_one_line_before_anything_starts(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    command = "reconcile" if "--heal-backoff-base-s" in flags else "worker"
    url = "postgresql://nobody@127.0.0.1:1/unreachable"
    assert main([command, "--database-url", url, "--data-dir", str(tmp_path), *flags]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"controlplane: error: {message}"]
