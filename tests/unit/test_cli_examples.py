"""Every command example people copy (README.md's, each command's --help epilogue's) parses with
the real parser, and no command has two arguments writing one destination (`webhooks create URL`
and the global `--url` once did). tests/e2e/test_cli_examples.py runs them against `up`."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from controlplane.cli import build_parser
from tests.cli_examples import Example, _parsers, all_examples, help_examples, readme_examples

# What a placeholder stands for when an example is only parsed.
SAMPLE_ID = "5b1e0c52-8d4f-4c7e-9a51-0d2f6b3f9e10"


def test_the_examples_are_found() -> None:
    readme, helps = readme_examples(), help_examples()
    assert len(readme) >= 25 and len(helps) >= 30
    assert any(e.argv[:2] == ("webhooks", "create") for e in readme)
    assert any(e.argv[:2] == ("instances", "show") and "--uri" in e.argv for e in readme)


@pytest.mark.parametrize("example", all_examples(), ids=lambda e: " ".join(e.argv)[:60])
def test_every_example_parses(example: Example) -> None:
    argv = example.filled(dict.fromkeys(example.placeholders(), SAMPLE_ID))
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            args = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{example.where} does not parse: {errors.getvalue().strip()}")
    assert callable(args.handler)


def test_webhooks_create_takes_the_endpoint_apart_from_the_api_url() -> None:
    argv = ["webhooks", "create", "https://example.com/hooks", "--events", "instance.ready"]
    args = build_parser().parse_args(argv)
    assert (args.endpoint_url, args.url) == ("https://example.com/hooks", None)
    args = build_parser().parse_args([*argv, "--url", "http://127.0.0.1:8700"])
    assert (args.endpoint_url, args.url) == ("https://example.com/hooks", "http://127.0.0.1:8700")


def test_no_command_has_two_arguments_with_one_destination() -> None:
    shared = []
    for path, parser in _parsers(build_parser()):
        seen: dict[str, argparse.Action] = {}
        for action in parser._actions:
            if action.dest in (argparse.SUPPRESS, "help"):
                continue
            if action.dest in seen:
                shared.append((" ".join(path), action.dest))
            seen[action.dest] = action
    assert shared == []
