"""The CLI's client of the REST API: where it is and which key to use (flags, environment, the
profile: `config.py`), and its answers turned into results or one-line errors with the exit code of their
problem type (`controlplane.core.exit_codes`); the CA it publishes, in a file for libpq."""

from __future__ import annotations

import argparse
import email.utils
import hashlib
import json
import os
import random
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

from controlplane.cli.common import CommandError
from controlplane.cli.config import (
    UP_PROFILE,
    Profile,
    chosen_profile,
    config_dir,
    config_file,
    local_admin_key,
    local_url,
)
from controlplane.cli.transport import DEFAULT_TIMEOUT_S, ReadTimeout, Response, Transport, TransportError
from controlplane.core import exit_codes, lifecycle
from controlplane.core.retry import RetryPolicy

# The problem types' common prefix (controlplane.api.problems.TYPE_PREFIX).
TYPE_PREFIX = "urn:controlplane:problem:"
# A watch whose stream ended early is resumed after this pause, for as long as this without an answer.
RECONNECT_PAUSE_S = 0.5
RECONNECT_FOR_S = 60.0
# Answers after which a request safe to repeat is sent again, and the watch asks again: too many
# requests, or the API restarting (a rollout) or its database unavailable for a moment.
RETRIED_STATUSES = frozenset({429, 502, 503, 504})
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})
# Attempts of one request at most; the first pause without Retry-After (then doubling, with
# jitter); the longest pause (a longer Retry-After is reported rather than waited for).
MAX_ATTEMPTS = 4
RETRY_BASE_S = 0.5
MAX_RETRY_WAIT_S = 30.0
USER_AGENT = "controlplane-cli"
TERMINAL = lifecycle.INSTANCE.terminal


class ApiError(CommandError):
    """An error answer of the API: its problem type and status, and the exit code of that type."""

    def __init__(self, message: str, kind: str | None, status: int) -> None:
        super().__init__(message, exit_codes.for_problem(kind, status))
        self.kind = kind
        self.status = status


def unreachable(base_url: object, exc: Exception) -> CommandError:
    return CommandError(f"cannot reach the API at {base_url}: {exc}", exit_codes.UNAVAILABLE)


def retry_safe(method: str, headers: Mapping[str, str] | None = None) -> bool:
    """Whether sending the request again cannot do twice what it asks: an idempotent method, or a
    request carrying an Idempotency-Key (the API answers its first outcome again)."""
    keyed = any(name.lower() == "idempotency-key" for name in headers or {})
    return method.upper() in IDEMPOTENT_METHODS or keyed


def retry_after_s(value: str | None, now: datetime) -> float | None:
    """A Retry-After header in seconds from `now` (delta-seconds, or an HTTP date); None without one."""
    if not value:
        return None
    text = value.strip()
    if text.isdigit():
        return float(text)
    try:
        at = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    return max(0.0, (at - now).total_seconds())


def retry_wait(
    status: int, retry_after: float | None, attempt: int, rand: Callable[[], float]
) -> float | None:
    """How long to wait before sending attempt `attempt + 1` again after `status`, or None to stop:
    not a status worth retrying, the last attempt, or a Retry-After longer than we wait."""
    if status not in RETRIED_STATUSES or attempt >= MAX_ATTEMPTS:
        return None
    if retry_after is not None:
        return retry_after if retry_after <= MAX_RETRY_WAIT_S else None
    return RetryPolicy(RETRY_BASE_S, MAX_RETRY_WAIT_S, rand).backoff_s(attempt)


class Api:
    """A thin client of the REST API that turns problem+json answers into one-line ApiErrors.

    URL: --url, else CONTROLPLANE_URL, else the profile's, else http://127.0.0.1:8700. Key:
    --api-key, else CONTROLPLANE_API_KEY, else the profile's; with `admin`, at last the admin key
    that `up` saved in the local data directory. The profile: --profile, else CONTROLPLANE_PROFILE,
    else (`admin`) the config file's admin_profile, else its default_profile (`config.py`).

    An answer 429, 502, 503 or 504 to a request that is safe to send again (`retry_safe`) is sent
    again, after its Retry-After or a backoff with jitter, MAX_ATTEMPTS times at most; `sleep` and
    `rand` are injected by tests.
    """

    def __init__(
        self,
        args: argparse.Namespace,
        *,
        need_key: bool = True,
        admin: bool = False,
        timeout: float = DEFAULT_TIMEOUT_S,
        sleep: Callable[[float], None] = time.sleep,
        rand: Callable[[], float] = random.random,
    ) -> None:
        profile = chosen_profile(args, admin=admin)
        self.base_url = (
            getattr(args, "url", None)
            or os.environ.get("CONTROLPLANE_URL")
            or (profile.url if profile else None)
            or local_url()
        ).rstrip("/")
        key, self.key_source = _key(args, profile, admin)
        if not key and need_key:
            raise CommandError(
                "no API key: run `controlplane login`, set CONTROLPLANE_API_KEY or pass --api-key",
                exit_codes.UNAUTHORIZED,
            )
        self.admin = admin
        self.sleep = sleep
        self.rand = rand
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            self.transport = Transport(self.base_url, {**headers, "User-Agent": USER_AGENT}, timeout)
        except TransportError as exc:
            raise CommandError(f"--url or CONTROLPLANE_URL: {exc}", exit_codes.USAGE) from None

    def response(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
    ) -> Response:
        safe = retry_safe(method, headers)
        attempt = 1
        while True:
            try:
                response = self.transport.request(
                    method, path, params=params, json_body=json, headers=headers, safe=safe
                )
            except TransportError as exc:
                raise unreachable(self.base_url, exc) from None
            if response.status < 400:
                return response
            after = retry_after_s(response.headers.get("retry-after"), datetime.now(UTC))
            wait = retry_wait(response.status, after, attempt, self.rand) if safe else None
            if wait is None:
                raise api_error(response, self.forbidden_hint() if response.status == 403 else "")
            self.sleep(wait)
            attempt += 1

    def forbidden_hint(self) -> str:
        """What to do about a 403: the other kind of key, and where this one came from."""
        if self.admin:
            return (
                f"; the key used came from {self.key_source}. Admin commands need an admin key:"
                f" the profile named by admin_profile in {config_file()} (`up` writes"
                f" {UP_PROFILE}; `controlplane login --profile NAME` with an admin key sets it),"
                " --profile, --api-key or CONTROLPLANE_API_KEY"
            )
        return (
            f"; the key used came from {self.key_source}. This command needs an organisation's key:"
            " `controlplane login` with it (kept as default_profile), --profile, --api-key or"
            " CONTROLPLANE_API_KEY"
        )

    def ca_pem(self) -> str:
        return self.response("GET", "/v1/ca.pem").text

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        """The answer's JSON (None when empty); `kwargs` as `response` takes them."""
        response = self.response(method, path, **kwargs)
        return response.json() if response.content else None

    def all_items(
        self, path: str, params: dict[str, Any] | None = None, *, limit: int | None = None
    ) -> list[dict[str, Any]]:
        """The items of every page of a cursor-paginated listing (the first `limit` of them)."""
        items: list[dict[str, Any]] = []
        cursor = None
        while True:
            query = {**(params or {}), **({"cursor": cursor} if cursor else {})}
            page = self.request("GET", path, params=query or None)
            items += page["items"]
            cursor = page.get("next_cursor")
            if limit is not None and len(items) >= limit:
                return items[:limit]
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
                with self.transport.stream("GET", path, headers=headers, read_timeout=read_for) as stream:
                    if stream.status >= 400:
                        answer = stream.read()
                        if answer.status not in RETRIED_STATUSES:
                            raise api_error(answer)
                        why = problem_line(answer)
                    else:
                        unanswered_since = None
                        name, event_id = "message", None
                        for line in stream.lines():
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
            except ReadTimeout:
                if deadline is not None and time.monotonic() >= deadline:
                    raise WaitTimeout() from None
                why = "no answer"
            except TransportError as exc:
                why = str(exc)
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout()
            unanswered_since = unanswered_since or time.monotonic()
            if time.monotonic() - unanswered_since > RECONNECT_FOR_S:
                raise CommandError(f"lost the watch stream: {why}", exit_codes.UNAVAILABLE)
            self.sleep(RECONNECT_PAUSE_S)


def _key(args: argparse.Namespace, profile: Profile | None, admin: bool) -> tuple[str | None, str]:
    """The key to send and where it came from (said when the API refuses it)."""
    if getattr(args, "api_key", None):
        return args.api_key, "--api-key"
    if os.environ.get("CONTROLPLANE_API_KEY"):
        return os.environ["CONTROLPLANE_API_KEY"], "CONTROLPLANE_API_KEY"
    key = profile.key() if profile else None
    if key and profile:
        return key, f"the profile {profile.name!r}"
    if admin:
        where = getattr(args, "data_dir", None) or os.environ.get("CONTROLPLANE_DATA_DIR") or ".controlplane"
        local = local_admin_key(where)
        if local:
            return local, f"the admin key `up` saved in {where}"
    return None, "nowhere"


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


def problem_line(response: Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return f"HTTP {response.status}: {response.text.strip()[:200]}"
    if not isinstance(body, dict):
        return f"HTTP {response.status}: {str(body)[:200]}"
    detail = body.get("detail") or body.get("title") or response.reason
    extra = ""
    if body.get("current_state"):
        allowed = ", ".join(body.get("allowed_actions") or []) or "none"
        extra = f" (state {body['current_state']}; allowed: {allowed})"
    return f"HTTP {response.status}: {detail}{extra}"


def api_error(response: Response, hint: str = "") -> ApiError:
    try:
        kind = problem_kind(response.json())
    except ValueError:
        kind = None
    return ApiError(problem_line(response) + hint, kind, response.status)


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
