"""The docs follow the code: every setting is documented, every documented command exists."""

from __future__ import annotations

import argparse

from controlplane.api.problems import KINDS
from controlplane.cli import build_parser
from controlplane.core.reference import reason_table
from controlplane.runtime.settings import SETTINGS, reference_table
from tests.support import ROOT

DOCS = ROOT / "docs"


def test_every_setting_is_in_the_configuration_reference() -> None:
    text = (DOCS / "configuration.md").read_text()
    names = [entry.env for entry in SETTINGS.values()]
    missing = [name for name in names if name not in text]
    assert missing == []


def test_the_configuration_reference_is_the_table_the_settings_generate() -> None:
    text = (DOCS / "configuration.md").read_text()
    assert reference_table() in text, "regenerate it: python -m controlplane.runtime.settings"


def test_every_setting_has_its_flag_on_some_command() -> None:
    flags = _options(build_parser())
    assert [entry.flag for entry in SETTINGS.values() if entry.flag not in flags] == []


def _options(parser: argparse.ArgumentParser) -> set[str]:
    """The option strings of a parser and of all its sub-commands."""
    found: set[str] = set()
    for action in parser._actions:
        found |= set(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                found |= _options(command)
    return found


def test_the_failure_reasons_in_the_api_reference_are_the_table_the_code_has() -> None:
    text = (DOCS / "api.md").read_text()
    assert reason_table() in text, "regenerate it: python -m controlplane.core.reference"


def test_every_problem_type_is_in_the_api_reference() -> None:
    text = (DOCS / "api.md").read_text()
    assert [kind for kind in KINDS if f"`{kind}`" not in text] == []


def test_the_stripe_signing_snippet_makes_signatures_stripe_accepts() -> None:
    """docs/api.md, "Sending a test event": its `stripe_signature` is what Stripe's library (which the
    webhook route verifies with) accepts."""
    import json
    import re
    import time

    import stripe

    text = (DOCS / "api.md").read_text()
    section = text[text.index("### Sending a test event") :]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    definition = re.search(r"def stripe_signature\(.*?\n\n", code.group(1), re.S)
    assert definition is not None
    namespace: dict[str, object] = {}
    exec("import hashlib, hmac\n" + definition.group(0), namespace)
    sign = namespace["stripe_signature"]
    body = json.dumps({"id": "evt_doc", "type": "customer.subscription.updated"}).encode()
    now = int(time.time())
    header = sign("whsec_test_secret", body, now)  # type: ignore[operator]
    stripe.WebhookSignature.verify_header(body.decode(), header, "whsec_test_secret", tolerance=300)
    assert "stripe_signature(secret, body, now)" in code.group(1)
