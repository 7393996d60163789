"""The CLI as a client of the API: answers worth another try are retried (Retry-After honoured,
bounded, only for requests safe to repeat), `instances create` carries one Idempotency-Key across
its tries, and a 403 says which key was used and what to do. Against a scripted server on loopback;
waits are recorded, never slept."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from controlplane.cli import client, config, main
from controlplane.cli.client import Api, ApiError
from controlplane.core import exit_codes
from tests.fake_api import Answer, fake_api

PROBLEM = {"type": "urn:controlplane:problem:unavailable", "title": "Unavailable", "detail": "try later"}
PAGE: dict[str, object] = {"items": [], "next_cursor": None}
INSTANCE = {"id": "5b1e0c52-8d4f-4c7e-9a51-0d2f6b3f9e10", "name": "orders", "plan": "dev", "state": "pending"}


@pytest.fixture(autouse=True)
def own_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """No CONTROLPLANE_* variable, and a config directory of the test's own."""
    for name in [n for n in os.environ if n.startswith("CONTROLPLANE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.chdir(tmp_path)
    yield tmp_path


def api(url: str, waits: list[float], **kwargs: object) -> Api:
    args = argparse.Namespace(url=url, api_key="cpk_test", profile=None)
    return Api(args, sleep=waits.append, rand=lambda: 0.5, **kwargs)  # type: ignore[arg-type]


def test_retry_after_in_seconds_or_as_a_date() -> None:
    now = datetime(2026, 1, 31, 12, 0, 0, tzinfo=UTC)
    assert client.retry_after_s("7", now) == 7.0
    assert client.retry_after_s("Sat, 31 Jan 2026 12:00:20 GMT", now) == 20.0
    assert client.retry_after_s("Sat, 31 Jan 2026 11:00:00 GMT", now) == 0.0
    assert client.retry_after_s(None, now) is None and client.retry_after_s("soon", now) is None


def test_which_answers_are_retried_and_after_how_long() -> None:
    half = lambda: 0.5  # noqa: E731
    assert client.retry_wait(503, 2.0, 1, half) == 2.0
    assert client.retry_wait(429, None, 1, half) == 0.375  # half the step, plus half of the other half
    assert client.retry_wait(502, None, 2, half) == 0.75
    assert client.retry_wait(504, 31.0, 1, half) is None  # longer than we wait: reported instead
    assert client.retry_wait(503, 1.0, client.MAX_ATTEMPTS, half) is None
    assert client.retry_wait(500, 1.0, 1, half) is None and client.retry_wait(409, 1.0, 1, half) is None
    assert client.retry_safe("GET") and client.retry_safe("DELETE") and client.retry_safe("PUT")
    assert not client.retry_safe("POST") and not client.retry_safe("PATCH")
    assert client.retry_safe("POST", {"Idempotency-Key": "k"})


def test_a_read_is_retried_after_retry_after_until_it_is_answered() -> None:
    script = [Answer(503, PROBLEM, {"Retry-After": "2"}), Answer(502, PROBLEM), Answer(200, PAGE)]
    waits: list[float] = []
    with fake_api(*script) as server:
        assert api(server.url, waits).request("GET", "/v1/instances") == PAGE
    assert waits == [2.0, 0.75] and len(server.received) == 3


def test_retries_are_bounded_and_end_in_the_last_answer() -> None:
    waits: list[float] = []
    with fake_api(Answer(429, PROBLEM, {"Retry-After": "1"})) as server, pytest.raises(ApiError) as failed:
        api(server.url, waits).request("GET", "/v1/instances")
    assert failed.value.code == exit_codes.UNAVAILABLE and "HTTP 429" in str(failed.value)
    assert len(server.received) == client.MAX_ATTEMPTS and waits == [1.0] * (client.MAX_ATTEMPTS - 1)


def test_a_request_not_safe_to_repeat_is_sent_once() -> None:
    waits: list[float] = []
    script = (Answer(503, PROBLEM, {"Retry-After": "0"}), Answer(202, INSTANCE))
    with fake_api(*script) as server, pytest.raises(ApiError):
        api(server.url, waits).request("PATCH", "/v1/instances/orders", json={"plan": "small"})
    assert len(server.received) == 1 and waits == []


def test_instances_create_sends_one_idempotency_key_across_its_tries(
    capsys: pytest.CaptureFixture[str],
) -> None:
    script = [Answer(503, PROBLEM, {"Retry-After": "0"}), Answer(502, PROBLEM, {"Retry-After": "0"})]
    with fake_api(*script, Answer(202, INSTANCE)) as server:
        argv = ["instances", "create", "orders", "--plan", "dev", "--url", server.url, "--api-key", "k"]
        assert main([*argv, "-o", "json"]) == 0
        assert main([*argv, "-o", "json"]) == 0
    keys = [r.headers.get("idempotency-key") for r in server.received]
    assert len(keys) == 4 and keys[0] and keys[0] == keys[1] == keys[2] != keys[3]
    assert all(r.body == {"name": "orders", "plan": "dev"} for r in server.received)


FORBIDDEN_ADMIN = {"type": "urn:controlplane:problem:forbidden", "detail": "this route needs an admin key"}


def test_an_admin_command_with_an_organisation_key_says_where_the_key_came_from_and_what_to_do(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with fake_api(Answer(403, FORBIDDEN_ADMIN)) as server:
        key_file = tmp_path / "acme.key"
        key_file.write_text("cpk_org\n")
        config.save_profile("acme", server.url, key_file, admin=False)
        assert main(["orgs", "list"]) == exit_codes.UNAUTHORIZED
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("controlplane: error: HTTP 403: this route needs an admin key")
    assert "the profile 'acme'" in line and "admin_profile" in line and "local-admin" in line
    assert server.received[0].headers["authorization"] == "Bearer cpk_org"


def test_admin_commands_use_the_admin_profile_and_its_url(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with fake_api(Answer(200, {"items": []})) as admin_api, fake_api(Answer(200, PAGE)) as org_api:
        (tmp_path / "admin.key").write_text("cpk_admin\n")
        (tmp_path / "org.key").write_text("cpk_org\n")
        config.save_profile("acme", org_api.url, tmp_path / "org.key", admin=False)
        config.save_profile(config.UP_PROFILE, admin_api.url, tmp_path / "admin.key", admin=True)
        assert main(["orgs", "list"]) == 0
        assert main(["instances", "list"]) == 0
    assert [(r.path, r.headers["authorization"]) for r in admin_api.received] == [
        ("/v1/orgs", "Bearer cpk_admin")
    ]
    assert org_api.received[0].headers["authorization"] == "Bearer cpk_org"
    saved = config.load_config()
    assert (saved["default_profile"], saved["admin_profile"]) == ("acme", "local-admin")


def test_an_explicit_profile_wins_over_the_admin_profile(tmp_path: Path) -> None:
    (tmp_path / "k").write_text("cpk_x\n")
    config.save_profile("prod", "https://cp.example.com", tmp_path / "k", admin=True)
    config.save_profile("local-admin", "http://127.0.0.1:8700", tmp_path / "k", admin=True)
    assert config.load_config()["admin_profile"] == "prod"  # the first admin profile stays the one
    chosen = config.chosen_profile(argparse.Namespace(profile="local-admin"), admin=True)
    assert chosen is not None and chosen.url == "http://127.0.0.1:8700"
    chosen = config.chosen_profile(argparse.Namespace(profile=None), admin=True)
    assert chosen is not None and chosen.name == "prod"


def test_login_checks_the_key_at_controlplane_url_before_a_saved_profiles_stale_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # The default profile remembers an API that has moved (an earlier `up` on another port); the
    # shell names the current one: login checks and keeps the key there, as every command reads it.
    with fake_api(Answer(200, PAGE)) as moved, fake_api(Answer(200, PAGE)) as current:
        (tmp_path / "old.key").write_text("cpk_old\n")
        config.save_profile("default", moved.url, tmp_path / "old.key", admin=False)
        monkeypatch.setenv("CONTROLPLANE_URL", current.url)
        monkeypatch.setattr("sys.stdin", __import__("io").StringIO("cpk_new\n"))
        assert main(["login"]) == 0
    assert moved.received == []
    assert current.received[0].headers["authorization"] == "Bearer cpk_new"
    assert config.load_config()["profiles"]["default"]["url"] == current.url
    assert f"key for {current.url}" in capsys.readouterr().out
