"""The CLI's client of the REST API: where it is and which key to use (flags, environment, the
profile), and its answers turned into results or one-line errors with the exit code of their
problem type (`controlplane.core.exit_codes`); the CA it publishes, in a file for libpq."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from controlplane.cli.common import CommandError
from controlplane.core import exit_codes, lifecycle

DEFAULT_URL = "http://127.0.0.1:8700"
PROFILE_ENV = "CONTROLPLANE_PROFILE"
# The problem types' common prefix (controlplane.api.problems.TYPE_PREFIX).
TYPE_PREFIX = "urn:controlplane:problem:"
# A watch whose stream ended early is resumed after this pause, for as long as this without an answer.
RECONNECT_PAUSE_S = 0.5
RECONNECT_FOR_S = 60.0
# Answers after which the watch asks again (the API restarting, or its database for a moment).
RETRIED_STATUSES = frozenset({502, 503, 504})
TERMINAL = lifecycle.INSTANCE.terminal


def config_dir() -> Path:
    """$XDG_CONFIG_HOME/controlplane (~/.config/controlplane when unset)."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "controlplane"


def config_file() -> Path:
    return config_dir() / "config.toml"


@dataclass(frozen=True)
class Profile:
    """A named place to talk to: the API's URL and where its key is kept (a file of mode 0600, or
    the name of an environment variable); the key itself is never in the config file."""

    name: str
    url: str | None = None
    key_file: str | None = None
    key_env: str | None = None

    def key(self) -> str | None:
        if self.key_env:
            return os.environ.get(self.key_env) or None
        if self.key_file:
            path = Path(self.key_file).expanduser()
            if not path.exists():
                raise CommandError(
                    f"profile {self.name}: its key file {path} is missing (run `controlplane login"
                    f" --profile {self.name}`)",
                    exit_codes.UNAUTHORIZED,
                )
            return path.read_text().strip() or None
        return None


def load_config() -> dict[str, Any]:
    path = config_file()
    if not path.exists():
        return {}
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise CommandError(f"{path} is not valid TOML: {exc}", exit_codes.USAGE) from None


def _toml_string(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def save_config(config: dict[str, Any]) -> Path:
    """Write the config file (top-level strings, then one [profiles.NAME] table per profile)."""
    lines = [f"{k} = {_toml_string(str(v))}" for k, v in config.items() if not isinstance(v, dict)]
    for name, values in sorted(config.get("profiles", {}).items()):
        lines += ["", f"[profiles.{_toml_string(name)}]"]
        lines += [f"{k} = {_toml_string(str(v))}" for k, v in values.items() if v is not None]
    path = config_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def chosen_profile_name(args: argparse.Namespace, config: dict[str, Any]) -> str | None:
    """--profile, else CONTROLPLANE_PROFILE, else the config file's default_profile."""
    name = getattr(args, "profile", None) or os.environ.get(PROFILE_ENV) or config.get("default_profile")
    return str(name) if name else None


def chosen_profile(args: argparse.Namespace) -> Profile | None:
    config = load_config()
    name = chosen_profile_name(args, config)
    if name is None:
        return None
    values = config.get("profiles", {}).get(name)
    if values is None:
        if getattr(args, "profile", None) or os.environ.get(PROFILE_ENV):
            raise CommandError(
                f"no profile {name!r} in {config_file()}"
                f" (create it with `controlplane login --profile {name}`)",
                exit_codes.USAGE,
            )
        return None
    return Profile(name, values.get("url"), values.get("key_file"), values.get("key_env"))


def local_url() -> str:
    """The URL a local `up` or `serve` is at: CONTROLPLANE_PUBLIC_URL, else CONTROLPLANE_API_HOST
    and CONTROLPLANE_API_PORT, else http://127.0.0.1:8700."""
    public = os.environ.get("CONTROLPLANE_PUBLIC_URL")
    if public:
        return public
    host = os.environ.get("CONTROLPLANE_API_HOST") or "127.0.0.1"
    port = os.environ.get("CONTROLPLANE_API_PORT") or "8700"
    return DEFAULT_URL if (host, port) == ("127.0.0.1", "8700") else f"http://{host}:{port}"


def local_admin_key(data_dir: str | None = None) -> str | None:
    """The admin key `up` saved in its data directory (--data-dir, else CONTROLPLANE_DATA_DIR, else
    .controlplane)."""
    path = Path(data_dir or os.environ.get("CONTROLPLANE_DATA_DIR") or ".controlplane") / "admin.key"
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


class ApiError(CommandError):
    """An error answer of the API: its problem type and status, and the exit code of that type."""

    def __init__(self, message: str, kind: str | None, status: int) -> None:
        super().__init__(message, exit_codes.for_problem(kind, status))
        self.kind = kind
        self.status = status


def unreachable(base_url: object, exc: Exception) -> CommandError:
    return CommandError(f"cannot reach the API at {base_url}: {exc}", exit_codes.UNAVAILABLE)


class Api:
    """A thin client of the REST API that turns problem+json answers into one-line ApiErrors.

    URL: --url, else CONTROLPLANE_URL, else the profile's, else http://127.0.0.1:8700. Key:
    --api-key, else CONTROLPLANE_API_KEY, else the profile's; with `admin`, at last the admin key
    that `up` saved in the local data directory.
    """

    def __init__(self, args: argparse.Namespace, *, need_key: bool = True, admin: bool = False) -> None:
        profile = chosen_profile(args)
        url = (
            getattr(args, "url", None)
            or os.environ.get("CONTROLPLANE_URL")
            or (profile.url if profile else None)
            or local_url()
        )
        key = (
            getattr(args, "api_key", None)
            or os.environ.get("CONTROLPLANE_API_KEY")
            or (profile.key() if profile else None)
            or (local_admin_key(getattr(args, "data_dir", None)) if admin else None)
        )
        if not key and need_key:
            raise CommandError(
                "no API key: run `controlplane login`, set CONTROLPLANE_API_KEY or pass --api-key",
                exit_codes.UNAUTHORIZED,
            )
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.client = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=30)

    def response(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise unreachable(self.client.base_url, exc) from None
        if response.status_code >= 400:
            raise api_error(response)
        return response

    def ca_pem(self) -> str:
        return self.response("GET", "/v1/ca.pem").text

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.response(method, path, **kwargs)
        return response.json() if response.content else None

    def all_items(self, path: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """The items of every page of a cursor-paginated listing."""
        items: list[dict[str, Any]] = []
        cursor = None
        while True:
            query = {**(params or {}), **({"cursor": cursor} if cursor else {})}
            page = self.request("GET", path, params=query or None)
            items += page["items"]
            cursor = page.get("next_cursor")
            if not cursor:
                return items

    def stream_events(
        self, ref: str, *, deadline: float | None = None
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """The instance's snapshot, then its transitions and steps as they happen (Server-Sent
        Events), as (event name, data), until a terminal state; WaitTimeout at `deadline` (a
        time.monotonic() value).

        A stream the server ends before (it restarts, a rollout moves it) is taken up again with
        Last-Event-ID, here or at another replica, and goes on after the last event seen; it is
        given up when no API answered for RECONNECT_FOR_S."""
        path = f"/v1/instances/{instance_path(ref)}/watch"
        last_id: str | None = None
        unanswered_since: float | None = None
        why = "the stream ended"
        while True:
            read_for = None if deadline is None else max(0.05, deadline - time.monotonic())
            headers = {"Last-Event-ID": last_id} if last_id else {}
            try:
                with self.client.stream(
                    "GET", path, headers=headers, timeout=httpx.Timeout(30.0, read=read_for)
                ) as response:
                    if response.status_code >= 400:
                        response.read()
                        if response.status_code not in RETRIED_STATUSES:
                            raise api_error(response)
                        why = problem_line(response)
                    else:
                        unanswered_since = None
                        name, event_id = "message", None
                        for line in response.iter_lines():
                            if line.startswith("event:"):
                                name = line[6:].strip()
                            elif line.startswith("id:"):
                                event_id = line[3:].strip()
                            elif line.startswith("data:"):
                                event = json.loads(line[5:].strip())
                                last_id = event_id or last_id
                                yield name, event
                                if name != "step" and event.get("state") in TERMINAL:
                                    return
                            elif not line:
                                name, event_id = "message", None
                            if deadline is not None and time.monotonic() >= deadline:
                                raise WaitTimeout()
            except httpx.ReadTimeout:
                if deadline is not None and time.monotonic() >= deadline:
                    raise WaitTimeout() from None
                why = "no answer"
            except httpx.HTTPError as exc:
                why = str(exc) or type(exc).__name__
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout()
            unanswered_since = unanswered_since or time.monotonic()
            if time.monotonic() - unanswered_since > RECONNECT_FOR_S:
                raise CommandError(f"lost the watch stream: {why}", exit_codes.UNAVAILABLE)
            time.sleep(RECONNECT_PAUSE_S)


class WaitTimeout(CommandError):
    """A wait reached its --timeout."""

    def __init__(self, message: str = "timed out") -> None:
        super().__init__(message, exit_codes.TIMEOUT)


def instance_path(ref: str) -> str:
    """An instance's id or name as a path segment."""
    return quote(ref, safe="")


def problem_kind(body: Any) -> str | None:
    kind = body.get("type") if isinstance(body, dict) else None
    return kind.removeprefix(TYPE_PREFIX) if isinstance(kind, str) else None


def problem_line(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return f"HTTP {response.status_code}: {response.text.strip()[:200]}"
    if not isinstance(body, dict):
        return f"HTTP {response.status_code}: {str(body)[:200]}"
    detail = body.get("detail") or body.get("title") or response.reason_phrase
    extra = ""
    if body.get("current_state"):
        allowed = ", ".join(body.get("allowed_actions") or []) or "none"
        extra = f" (state {body['current_state']}; allowed: {allowed})"
    return f"HTTP {response.status_code}: {detail}{extra}"


def api_error(response: httpx.Response) -> ApiError:
    try:
        kind = problem_kind(response.json())
    except ValueError:
        kind = None
    return ApiError(problem_line(response), kind, response.status_code)


def ca_file(api: Api, pem: str | None = None) -> Path:
    """A CA certificate (`pem`, else the API's) in a file of this user's: CONTROLPLANE_CA_FILE, else
    one per certificate under $XDG_CONFIG_HOME/controlplane; written when missing or different."""
    pem = pem or api.ca_pem()
    configured = os.environ.get("CONTROLPLANE_CA_FILE")
    if configured:
        path = Path(configured).expanduser()
    else:
        path = config_dir() / f"ca-{hashlib.sha256(pem.encode()).hexdigest()[:16]}.pem"
    if not path.exists() or path.read_text() != pem:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(pem)
    return path


def connection_uri(api: Api, connection: dict[str, Any]) -> str:
    """The URI to give libpq (psql): with `sslrootcert` naming the CA file saved here when the server
    is verified (the instance's own CA when its connection names one, else the API's), in place of
    the bare file name the API's URI gives."""
    uri = str(connection["uri"])
    if connection.get("sslmode") not in ("verify-full", "verify-ca"):
        return uri
    path = ca_file(api, connection.get("ca_certificate"))
    base, _, query = uri.partition("?")
    kept = [part for part in query.split("&") if part and not part.startswith("sslrootcert=")]
    return f"{base}?{'&'.join([*kept, 'sslrootcert=' + quote(str(path), safe='/')])}"
