"""The CLI's help, version, output and completion (no server needed)."""

from __future__ import annotations

import argparse
import io
import json
import re
from contextlib import redirect_stdout
from datetime import UTC, datetime

import pytest

from controlplane.cli import build_parser, common, main
from controlplane.cli.customer_parser import parse_duration
from controlplane.cli.shell import complete
from controlplane.core import plans


def leaves(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                if not name.startswith("__"):
                    found += leaves(child, (*path, name))
            return found
    return [(path, parser)]


def test_every_customer_and_sre_command_has_a_description_and_an_example() -> None:
    for path, parser in leaves(build_parser()):
        if path[0] in ("instances", "orgs", "keys", "events", "stuck", "login", "completion"):
            text = parser.format_help()
            assert parser.description, path
            assert "example" in text, path


def test_help_shows_defaults_as_typed_and_lists_the_plans() -> None:
    for path, parser in leaves(build_parser()):
        text = parser.format_help()
        assert "PosixPath(" not in text and "SecretStr(" not in text and "None)" not in text, path
        if any(a.dest == "plan" for a in parser._actions):
            assert ", ".join(plans.plan_names()) in text, path
    serve = dict(leaves(build_parser()))[("serve",)].format_help()
    assert "default: .controlplane" in " ".join(serve.split())


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert re.fullmatch(r"controlplane \d+\.\d+\.\d+\S*\n", capsys.readouterr().out)


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["instances", "create", "x", "--plan", "huge"])
    assert exited.value.code == 2
    assert "invalid choice: 'huge'" in capsys.readouterr().err


def test_one_timestamp_format_and_cut_cells_end_in_an_ellipsis(monkeypatch: pytest.MonkeyPatch) -> None:
    assert common.cell_text("2026-01-31T12:00:00.123456+00:00") == "2026-01-31T12:00:00Z"
    assert common.cell_text(datetime(2026, 1, 31, 13, 0, tzinfo=UTC)) == "2026-01-31T13:00:00Z"
    assert common.cell_text("2026-01-31 14:00:00+01:00") == "2026-01-31T13:00:00Z"
    out = io.StringIO()
    with redirect_stdout(out):
        common.print_table([("x" * 60, "ready")], ("reason", "state"), state_column="state")
    line = out.getvalue().splitlines()[1]
    assert line.startswith("x" * 47 + "…") and "\x1b[" not in line


def test_colour_only_on_a_terminal_and_never_with_no_color(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    assert common.colour_enabled()
    monkeypatch.setenv("NO_COLOR", "1")
    assert not common.colour_enabled()


def test_yaml_and_json_carry_the_same_data(capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    value = {"at": datetime(2026, 1, 31, tzinfo=UTC), "n": [1, 2]}
    common.print_data(value, "json")
    as_json = json.loads(capsys.readouterr().out)
    common.print_data(value, "yaml")
    assert yaml.safe_load(capsys.readouterr().out) == as_json == {"at": "2026-01-31T00:00:00Z", "n": [1, 2]}


def test_durations() -> None:
    assert [parse_duration(t) for t in ("90", "90s", "10m", "1h", "1.5m")] == [90, 90, 600, 3600, 90]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_duration("soon")


def test_completion_offers_commands_flags_plans_and_states() -> None:
    parser = build_parser()
    assert complete(parser, ["inst"]) == ["instances"]
    assert "resize" in complete(parser, ["instances", ""])
    assert complete(parser, ["instances", "create", "orders", "--plan", ""]) == list(plans.plan_names())
    assert "--timeout" in complete(parser, ["instances", "create", "orders", "--"])
    assert complete(parser, ["instances", "wait", "orders", "--for", "rea"]) == ["ready"]
    assert complete(parser, ["completion", ""]) == ["bash", "zsh", "fish"]


def test_help_hides_the_completion_helper_and_every_settings_flag_says_what_it_is() -> None:
    top = build_parser().format_help()
    assert "__complete" not in top and "==SUPPRESS==" not in top
    up = dict(leaves(build_parser()))[("up",)]
    text = " ".join(up.format_help().split())
    assert "SETTING_" not in text
    assert "--faults FAULTS Fault injection for tests" in text
    assert "--api-port PORT Port of the API (env CONTROLPLANE_API_PORT; default: 8700)" in text
    assert "--data-dir PATH" in text and "--reconcile-interval-s SECONDS" in text
    for action in up._actions:
        if action.option_strings and action.option_strings[0] != "-h":
            assert action.help and not action.help.startswith("(env"), action.option_strings


def test_a_role_started_with_faults_says_so_first(capsys: pytest.CaptureFixture[str]) -> None:
    from controlplane.cli.server_commands import fault_warnings
    from controlplane.runtime.settings import Settings

    assert fault_warnings(Settings()) == []
    (line,) = fault_warnings(Settings(faults="apply_plan:fail"))
    assert "fault injection is on" in line and "apply_plan:fail" in line


def test_every_argument_says_what_it_is() -> None:
    for path, parser in leaves(build_parser()):
        for action in parser._actions:
            if action.dest != "help" and path != ("__complete",):
                assert action.help, (path, action.option_strings or action.dest)
