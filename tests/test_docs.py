"""The docs follow the code: every setting is documented, every documented command exists."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from controlplane.settings import Settings, env_name

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_every_setting_is_in_the_configuration_reference() -> None:
    text = (DOCS / "configuration.md").read_text()
    names = [env_name(f.name) for f in fields(Settings) if f.name != "extra"]
    missing = [name for name in names if name not in text]
    assert missing == []
