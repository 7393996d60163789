"""The OpenAPI document passes Redocly's `recommended` rules with no error and no warning: the linter
other people run on an API before they generate a client from it (`@redocly/cli`, pinned, from the
npm registry into a cached folder)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from controlplane.api.app import create_app
from controlplane.runtime.settings import Settings
from tests.npm_tools import npm_tools

REDOCLY = ("@redocly/cli@2.77.0",)

pytestmark = pytest.mark.timeout(600)


def test_redocly_recommended_rules_find_nothing(tmp_path: Path) -> None:
    modules = npm_tools(REDOCLY)
    document = tmp_path / "openapi.json"
    document.write_text(json.dumps(create_app(Settings()).openapi()))
    linted = subprocess.run(
        [str(modules / ".bin" / "redocly"), "lint", "--extends=recommended", "--format=json", str(document)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        check=False,
        env={"PATH": "/usr/bin:/bin", "REDOCLY_TELEMETRY": "off", "REDOCLY_SUPPRESS_UPDATE_NOTICE": "true"},
    )
    report = json.loads(linted.stdout[linted.stdout.index("{") :])
    found = [f"{p['severity']} {p['ruleId']}: {p['message']}" for p in report.get("problems", [])]
    assert found == [] and linted.returncode == 0, "\n".join(found) or linted.stderr
