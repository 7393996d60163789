"""deploy/kind_check.py, as far as it runs without a cluster: its dry run validates every manifest."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.support import ROOT

SCRIPT = ROOT / "deploy" / "kind_check.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kind_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_dry_run_lists_the_lifecycle_and_validates_everything() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--object-store", "backups", "--pod-monitor"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert (
        "create -> ready -> write -> resize -> suspend -> write refused -> resume -> backup -> delete" in out
    )
    assert "CloudNativePG 1.30.0" in out and "every manifest is valid" in out
    assert (
        "instance: 10 manifests valid (Backup, Cluster, NetworkPolicy, PodMonitor, ScheduledBackup, Secret)"
        in out
    )


def test_placeholders_are_filled_consistently() -> None:
    script = load_script()
    docs = script.rendered_kustomization()
    secrets = {d["metadata"]["name"]: d["stringData"] for d in docs if d["kind"] == "Secret"}
    assert not any("REPLACE_ME" in value for data in secrets.values() for value in data.values())
    url = urlsplit(secrets["controlplane-secrets"]["CONTROLPLANE_DATABASE_URL"])
    assert url.password == secrets["controlplane-db-owner"]["password"]


def test_an_invalid_manifest_fails_the_dry_run(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    script = load_script()

    def broken(options: Any, plan: str) -> list[dict[str, Any]]:
        docs: list[dict[str, Any]] = script.cnpg.all_manifests(
            script.uuid.uuid4(), script.InstanceSpec(plan), options, fence=1
        )
        docs[2]["spec"]["instancess"] = 3
        return docs

    monkeypatch.setattr(script, "instance_manifests", broken)
    assert script.main(["--dry-run"]) == 1
    assert "'instancess' was unexpected" in capsys.readouterr().err
