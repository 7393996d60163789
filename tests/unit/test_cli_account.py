"""The organisation's commands refuse a bad time in one line, before calling the API."""

from __future__ import annotations

import pytest

from controlplane.cli import main


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--from", "yesterday"], "--from must be an RFC 3339 time"),
        (["--from", "2026-05-01T00:00:00"], "--from must carry a time zone"),
        (["--to", "2026-13-01T00:00:00Z"], "--to must be an RFC 3339 time"),
    ],
)
def test_usage_refuses_a_bad_time_in_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["usage", "--api-key", "k", "--url", "http://127.0.0.1:9", *args])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1 and message in err
