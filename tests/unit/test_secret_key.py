"""A secret key that is not a Fernet key is refused in one line before anything starts (exit 2),
from CONTROLPLANE_SECRET_KEY or from the data directory's secret.key, never as a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography.fernet import Fernet

from controlplane.cli import main
from controlplane.runtime import settings as settings_module
from controlplane.runtime.secretbox import load_box
from controlplane.runtime.settings import Settings, SettingsError


@pytest.mark.parametrize("bad", ["notakey", "c2hvcnQ=", Fernet.generate_key().decode()[:-2], "x" * 44])
def test_a_malformed_secret_key_is_refused_in_one_line(bad: str) -> None:
    with pytest.raises(SettingsError) as refused:
        settings_module.load({"CONTROLPLANE_SECRET_KEY": bad})
    message = str(refused.value)
    assert message.startswith("CONTROLPLANE_SECRET_KEY must be a Fernet key: 32 bytes in URL-safe base64")
    assert bad not in message and "\n" not in message


def test_a_fernet_key_is_taken() -> None:
    key = Fernet.generate_key().decode()
    loaded = settings_module.load({"CONTROLPLANE_SECRET_KEY": key})
    assert loaded.secret_key is not None and loaded.secret_key.get_secret_value() == key


def test_the_command_line_exits_2_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv("CONTROLPLANE_SECRET_KEY", "not-a-fernet-key")
    assert main(["audit", "public-key", "--data-dir", str(tmp_path)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("controlplane: error: CONTROLPLANE_SECRET_KEY must be a Fernet key")


def test_a_damaged_key_file_in_the_data_directory_is_named(tmp_path: Path) -> None:
    (tmp_path / "secret.key").write_text("damaged\n")
    with pytest.raises(SettingsError, match=r"secret.key must hold a Fernet key"):
        load_box(Settings(data_dir=tmp_path))
