"""The command line starts without importing what it does not use (controlplane/cli/lazy.py):
`--help`, `--version` and `instances list` import no web framework, database driver, settings
model or HTTP client library. What each import costs is measured in bench/cli_startup.py, never
asserted here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from controlplane.cli import build_parser
from controlplane.cli.lazy import LazyHandler
from tests.cli_examples import _parsers
from tests.fake_api import Answer, fake_api
from tests.support import ROOT

HEAVY = (
    "fastapi",
    "starlette",
    "uvicorn",
    "psycopg",
    "psycopg_pool",
    "sqlalchemy",
    "alembic",
    "pydantic",
    "pydantic_settings",
    "httpx",
    "stripe",
    "kubernetes",
    "prometheus_client",
    "cryptography",
    "yaml",
    "jinja2",
)

PROBE = """
import json, sys
from controlplane.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exit:
    code = exit.code
heavy = sorted(m for m in json.loads({heavy!r}) if m in sys.modules)
print(json.dumps({{"code": code, "heavy": heavy}}), file=sys.stderr)
"""


def imported(*argv: str) -> dict[str, object]:
    """The exit code of `controlplane ARGV` in a fresh interpreter, and the heavy modules it imported."""
    script = PROBE.format(heavy=json.dumps(HEAVY))
    result = subprocess.run(
        [sys.executable, "-c", script, *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "HOME": str(ROOT), "XDG_CONFIG_HOME": "/nonexistent"},
        timeout=60,
        check=False,
    )
    found: dict[str, object] = json.loads(result.stderr.strip().splitlines()[-1])
    return found


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["instances", "--help"], ["up", "--help"]])
def test_help_and_version_import_nothing_heavy(argv: list[str]) -> None:
    found = imported(*argv)
    allowed = ["pydantic", "pydantic_settings"] if argv[0] == "up" else []  # the settings' flags
    assert found["code"] == 0 and [m for m in found["heavy"] if m not in allowed] == []  # type: ignore[attr-defined]


def test_listing_instances_imports_nothing_heavy() -> None:
    with fake_api(Answer(200, {"items": [], "next_cursor": None})) as server:
        found = imported("instances", "list", "--url", server.url, "--api-key", "cpk_x")
    assert found == {"code": 0, "heavy": []}
    assert [r.path for r in server.received] == ["/v1/instances?limit=100&live=true"]


def test_every_command_handler_can_be_imported() -> None:
    for path, parser in _parsers(build_parser()):
        handler = parser.get_default("handler")
        if isinstance(handler, LazyHandler):
            assert callable(handler.resolve()), path
