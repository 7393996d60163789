"""Customer commands: `controlplane instances ...` talking to the REST API with an API key."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from controlplane import lifecycle
from controlplane.cli.common import CommandError, print_json, print_table

TERMINAL = lifecycle.INSTANCE.terminal
LIST_COLUMNS = ("id", "name", "plan", "state", "state_version", "created_at")


def register(commands: Any) -> None:
    instances = commands.add_parser("instances", help="create, inspect, resize and delete databases")
    actions = instances.add_subparsers(dest="instances_command", metavar="ACTION", required=True)

    create = _action(actions, "create", "create a database", cmd_create)
    create.add_argument("name")
    create.add_argument("--plan", required=True)
    create.add_argument("--region")
    create.add_argument("--deletion-protection", action="store_true")
    create.add_argument("--wait", action="store_true", help="follow progress until ready")

    listing = _action(actions, "list", "list databases", cmd_list)
    listing.add_argument("--state")

    show = _action(actions, "show", "show one database", cmd_show)
    show.add_argument("id")
    show.add_argument("--uri", action="store_true", help="print only the connection URI (for psql)")

    resize = _action(actions, "resize", "change a database's plan", cmd_resize)
    resize.add_argument("id")
    resize.add_argument("--plan", required=True)
    resize.add_argument("--wait", action="store_true")

    delete = _action(actions, "delete", "delete a database", cmd_delete)
    delete.add_argument("id")
    delete.add_argument("--skip-final-backup", action="store_true")
    delete.add_argument("--wait", action="store_true")

    retry = _action(
        actions,
        "retry",
        "create a failed database again: same name and plan, linked to the failed one",
        cmd_retry,
    )
    retry.add_argument("id", metavar="NAME_OR_ID", help="an id, or the name of a failed database")
    retry.add_argument("--wait", action="store_true", help="follow progress until ready")

    events = _action(actions, "events", "a database's audit log", cmd_events)
    events.add_argument("id")

    watch = _action(actions, "watch", "follow a database's state changes", cmd_watch)
    watch.add_argument("id")

    listing = _action(actions, "backups", "a database's backups, newest first", cmd_backups)
    listing.add_argument("id")

    backup = _action(actions, "backup", "take a backup now (beside the plan's schedule)", cmd_backup)
    backup.add_argument("id")

    restore = _action(
        actions, "restore", "bring back a database whose data is lost: from a backup, or empty", cmd_restore
    )
    restore.add_argument("id")
    source = restore.add_mutually_exclusive_group(required=True)
    source.add_argument("--backup", metavar="BACKUP_ID", help="a backup listed by `instances backups`")
    source.add_argument("--newest", action="store_true", help="the newest backup held")
    source.add_argument(
        "--empty", action="store_true", help="re-create it empty: accept that its data is lost"
    )
    restore.add_argument("--reason", help="why, for the audit log")
    restore.add_argument("--wait", action="store_true", help="follow progress until ready")

    ca = commands.add_parser(
        "ca", help="the CA certificate the databases' server certificates are checked against"
    )
    ca.add_argument("--url", default=None, help="API URL (env CONTROLPLANE_URL)")
    ca.add_argument("--output", type=Path, help="write it to this file (else print it)")
    ca.set_defaults(handler=cmd_ca)


def _action(actions: Any, name: str, help_text: str, handler: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = actions.add_parser(name, help=help_text)
    parser.add_argument("--url", default=None, help="API URL (env CONTROLPLANE_URL)")
    parser.add_argument("--api-key", default=None, help="API key (env CONTROLPLANE_API_KEY)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(handler=handler)
    return parser


class Api:
    """A thin client of the REST API that turns problem+json errors into one-line CommandErrors."""

    def __init__(self, args: argparse.Namespace, *, need_key: bool = True) -> None:
        url = args.url or os.environ.get("CONTROLPLANE_URL") or "http://127.0.0.1:8700"
        key = getattr(args, "api_key", None) or os.environ.get("CONTROLPLANE_API_KEY")
        if not key and need_key:
            raise CommandError("no API key: set CONTROLPLANE_API_KEY or pass --api-key")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.client = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=30)

    def ca_pem(self) -> str:
        try:
            response = self.client.get("/v1/ca.pem")
        except httpx.HTTPError as exc:
            raise CommandError(f"cannot reach the API at {self.client.base_url}: {exc}") from None
        if response.status_code >= 400:
            raise CommandError(problem_line(response))
        return response.text

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self.client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise CommandError(f"cannot reach the API at {self.client.base_url}: {exc}") from None
        if response.status_code >= 400:
            raise CommandError(problem_line(response))
        return response.json() if response.content else None

    def stream_events(self, instance_id: str) -> Iterator[tuple[str, dict[str, Any]]]:
        """The instance's snapshot, then its transitions and steps as they happen (Server-Sent
        Events), as (event name, data)."""
        try:
            with self.client.stream("GET", f"/v1/instances/{instance_id}/watch", timeout=None) as response:
                if response.status_code >= 400:
                    response.read()
                    raise CommandError(problem_line(response))
                name = "message"
                for line in response.iter_lines():
                    if line.startswith("event:"):
                        name = line[6:].strip()
                    elif line.startswith("data:"):
                        yield name, json.loads(line[5:].strip())
                    elif not line:
                        name = "message"
        except httpx.HTTPError as exc:
            raise CommandError(f"lost the watch stream: {exc}") from None


def problem_line(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return f"HTTP {response.status_code}: {response.text.strip()[:200]}"
    detail = body.get("detail") or body.get("title") or response.reason_phrase
    extra = ""
    if body.get("current_state"):
        allowed = ", ".join(body.get("allowed_actions", [])) or "none"
        extra = f" (state {body['current_state']}; allowed: {allowed})"
    return f"HTTP {response.status_code}: {detail}{extra}"


def ca_file(api: Api, pem: str | None = None) -> Path:
    """A CA certificate (`pem`, else the API's) in a file of this user's: CONTROLPLANE_CA_FILE, else
    one per certificate under $XDG_CONFIG_HOME/controlplane; written when missing or different."""
    pem = pem or api.ca_pem()
    configured = os.environ.get("CONTROLPLANE_CA_FILE")
    if configured:
        path = Path(configured).expanduser()
    else:
        base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
        path = base / "controlplane" / f"ca-{hashlib.sha256(pem.encode()).hexdigest()[:16]}.pem"
    if not path.exists() or path.read_text() != pem:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(pem)
    return path


def connection_uri(api: Api, connection: dict[str, Any]) -> str:
    """The URI to give libpq (psql): with `sslrootcert` naming the CA when the server is verified
    (the instance's own CA when its connection names one, else the API's)."""
    uri = str(connection["uri"])
    if connection.get("sslmode") not in ("verify-full", "verify-ca"):
        return uri
    path = ca_file(api, connection.get("ca_certificate"))
    return f"{uri}&sslrootcert={quote(str(path), safe='/')}"


# Shown in their own rows by `instances show` (the rest, field by field).
SHOWN_APART = ("connection", "progress", "failure", "failure_reason", "failure_code", "state_info")


def _duration(seconds: Any) -> str:
    return "" if seconds is None else f"{float(seconds):.2f}s"


def step_summary(step: dict[str, Any]) -> str:
    """One step of a progress as a person reads it: done in 0.52s, running for 3.10s, failed ..."""
    state = step["state"]
    tries = f", attempt {step['attempts']}" if step.get("attempts", 0) > 1 else ""
    if state == "done":
        return f"done in {_duration(step['duration_s'])}{tries}"
    if state == "running":
        usual = f" (usually {_duration(step['expected_s'])})" if step.get("expected_s") is not None else ""
        return f"running for {_duration(step['duration_s'])}{usual}{tries}"
    if state == "failed":
        failure = step.get("failure") or {}
        return f"failed after {_duration(step['duration_s'])}{tries}: {failure.get('message', 'no reason')}"
    return "pending"


def failure_rows(failure: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        ("failure", f"{failure['code']}: {failure['message']}"),
        ("retryable", "yes" if failure["retryable"] else "no"),
        ("hint", failure["hint"]),
    ]


def progress_rows(progress: dict[str, Any]) -> list[tuple[str, str]]:
    attempt = f", attempt {progress['attempt']}" if progress.get("attempt") else ""
    late = "; taking longer than expected" if progress.get("overdue") else ""
    rows = [("progress", f"{progress['operation']}{attempt}{late}")]
    rows += [(f"  {step['label']}", step_summary(step)) for step in progress["steps"]]
    rows += [
        ("expected_by", progress.get("expected_by") or ""),
        ("deadline_at", progress.get("deadline_at") or ""),
    ]
    return rows


def show_instance(instance: dict[str, Any], as_json: bool, api: Api | None = None) -> None:
    if as_json:
        print_json(instance)
        return
    rows: list[tuple[str, Any]] = []
    for key, value in instance.items():
        if key in SHOWN_APART:
            continue
        rows.append((key, value))
        if key == "state" and instance.get("state_info"):
            info = instance["state_info"]
            rows.append(("status", f"{info['label']} ({info['severity']}; billing: {info['billing']})"))
    if instance.get("failure"):
        rows += failure_rows(instance["failure"])
    if instance.get("progress"):
        rows += progress_rows(instance["progress"])
    connection = instance.get("connection")
    if connection:
        rows.append(("uri", connection_uri(api, connection) if api else connection.get("uri")))
    print_table(rows, ("field", "value"))


class Follower:
    """Prints, as they happen, an instance's state changes and steps, with the time since it started."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.started = time.monotonic()
        self.last_state: str | None = None
        # (step, attempt, state) lines printed: each once.
        self.printed: set[tuple[str, int, str]] = set()
        self.warned_overdue = False

    def _print(self, text: str) -> None:
        if not self.as_json:
            print(f"[{time.monotonic() - self.started:6.1f}s] {text}", flush=True)

    def instance(self, instance: dict[str, Any]) -> None:
        if instance["state"] != self.last_state:
            info = instance.get("state_info") or {}
            label = f" ({info['label']})" if info.get("label") else ""
            self._print(f"{instance['state']}{label}")
            self.last_state = instance["state"]
        progress = instance.get("progress")
        if progress:
            for step in progress["steps"]:
                if step["state"] != "pending":  # under way before following started
                    self._step_line(step["name"], step["label"], max(1, step["attempts"]), step)
            self._overdue(progress)

    def step(self, event: dict[str, Any]) -> None:
        state = {"started": "running", "finished": "done", "failed": "failed"}[event["event"]]
        step = {
            "state": state,
            "attempts": event["attempt"],
            "duration_s": event["duration_s"],
            "expected_s": None,
            "failure": event.get("failure"),
        }
        self._step_line(event["step"], event["label"], event["attempt"], step)
        if event.get("progress"):
            self._overdue(event["progress"])

    def _step_line(self, name: str, label: str, attempt: int, step: dict[str, Any]) -> None:
        key = (name, attempt, step["state"])
        ended = {(name, attempt, "done"), (name, attempt, "failed")}
        # Each line once, and never a start after that attempt's end (a late or replayed event).
        if key in self.printed or (step["state"] == "running" and ended & self.printed):
            return
        self.printed.add(key)
        if step["state"] == "running":
            text = f"started (attempt {attempt})" if attempt > 1 else "started"
        else:
            text = step_summary({**step, "attempts": attempt})
        self._print(f"  {label}: {text}")

    def _overdue(self, progress: dict[str, Any]) -> None:
        if progress.get("overdue") and not self.warned_overdue:
            self.warned_overdue = True
            self._print(f"  taking longer than expected (expected by {progress.get('expected_by')})")


def _updates(api: Api, instance_id: str, follower: Follower | None = None) -> Iterator[dict[str, Any]]:
    """The instance as it is now, then as it is after each change its watch stream announces; its
    steps go to `follower` as they happen."""
    yield api.request("GET", f"/v1/instances/{instance_id}")
    for name, data in api.stream_events(instance_id):
        if name == "step":
            if follower is not None:
                follower.step(data)
            continue
        yield api.request("GET", f"/v1/instances/{instance_id}")


def _all_items(api: Api, path: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The items of every page of a cursor-paginated listing."""
    items: list[dict[str, Any]] = []
    cursor = None
    while True:
        query = {**(params or {}), **({"cursor": cursor} if cursor else {})}
        page = api.request("GET", path, params=query or None)
        items += page["items"]
        cursor = page.get("next_cursor")
        if not cursor:
            return items


def follow(api: Api, instance_id: str, until: tuple[str, ...], as_json: bool) -> dict[str, Any]:
    """Print each state change and step until the instance reaches one of `until` (or a terminal state)."""
    follower = Follower(as_json)
    for instance in _updates(api, instance_id, follower):
        follower.instance(instance)
        if instance["state"] in until or instance["state"] in TERMINAL:
            break
    return instance


def ended_failed(instance: dict[str, Any]) -> CommandError:
    """Print why the instance failed and what to do next; the one-line error to exit with."""
    failure = instance.get("failure")
    name = instance.get("name") or instance["id"]
    for label, text in failure_rows(failure) if failure else []:
        print(f"{label}: {text}")
    if "retry" in instance.get("allowed_actions", []):
        print(f"retry: controlplane instances retry {name} --wait")
    elif "delete" in instance.get("allowed_actions", []):
        print(f"remove what is left: controlplane instances delete {instance['id']}")
    code = (failure or {}).get("code", "no reason")
    return CommandError(f"instance {name} ended {instance['state']}: {code}")


def wait_until_ready(api: Api, instance: dict[str, Any], as_json: bool) -> int:
    """Follow a new instance until ready: then its URI, else why it failed and the retry command."""
    final = follow(api, instance["id"], ("ready",), as_json)
    if as_json:
        print_json(final)
        if final["state"] != "ready":
            raise CommandError(f"instance ended {final['state']}")
        return 0
    if final["state"] != "ready":
        raise ended_failed(final)
    if final.get("connection"):
        print(connection_uri(api, final["connection"]))
    return 0


def cmd_create(args: argparse.Namespace) -> int:
    api = Api(args)
    body: dict[str, Any] = {"name": args.name, "plan": args.plan}
    if args.region:
        body["region"] = args.region
    if args.deletion_protection:
        body["deletion_protection"] = True
    instance = api.request("POST", "/v1/instances", json=body)
    if not args.wait:
        show_instance(instance, args.json)
        return 0
    return wait_until_ready(api, instance, args.json)


def failed_to_retry(api: Api, name_or_id: str) -> str:
    """The id to retry: `name_or_id` itself when it is an id, else the newest failed instance of
    that name not yet retried."""
    try:
        return str(uuid.UUID(name_or_id))
    except ValueError:
        pass
    named = _all_items(api, "/v1/instances", {"name": name_or_id, "state": "failed", "limit": 100})
    waiting = [i for i in named if not i.get("replaced_by")]
    if not waiting:
        raise CommandError(f"no failed instance named {name_or_id!r} is waiting for a retry")
    return str(max(waiting, key=lambda i: str(i["created_at"]))["id"])


def cmd_retry(args: argparse.Namespace) -> int:
    api = Api(args)
    failed_id = failed_to_retry(api, args.id)
    # A failed instance is retried at most once (the API refuses a second retry): no key is needed.
    instance = api.request("POST", f"/v1/instances/{failed_id}/retry")
    if args.json and not args.wait:
        print_json(instance)
        return 0
    if not args.json:
        print(f"{instance['name']}: retried as {instance['id']} (replaces {failed_id})")
    if not args.wait:
        return 0
    return wait_until_ready(api, instance, args.json)


def cmd_list(args: argparse.Namespace) -> int:
    params = {"limit": 100, **({"state": args.state} if args.state else {})}
    items = _all_items(Api(args), "/v1/instances", params)
    if args.json:
        print_json(items)
    else:
        print_table([[item.get(c) for c in LIST_COLUMNS] for item in items], LIST_COLUMNS)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    api = Api(args)
    instance = api.request("GET", f"/v1/instances/{args.id}")
    if args.uri:
        if not instance.get("connection"):
            raise CommandError(f"instance {args.id} has no connection yet (state {instance['state']})")
        print(connection_uri(api, instance["connection"]))
        return 0
    show_instance(instance, args.json, api)
    return 0


def cmd_resize(args: argparse.Namespace) -> int:
    api = Api(args)
    instance = api.request("PATCH", f"/v1/instances/{args.id}", json={"plan": args.plan})
    if args.wait:
        generation = int(instance["spec_generation"])
        instance = wait_for_generation(api, args.id, generation, args.json)
        if instance["observed_generation"] < generation or instance["state"] != "ready":
            show_instance(instance, args.json)
            raise CommandError(
                f"resize to {args.plan} did not complete: instance is {instance['state']}"
                f" ({(instance.get('failure') or {}).get('message') or 'no reason recorded'})"
            )
    show_instance(instance, args.json)
    return 0


def wait_for_generation(api: Api, instance_id: str, generation: int, as_json: bool) -> dict[str, Any]:
    updates = _updates(api, instance_id)
    instance = next(updates)
    if instance["observed_generation"] >= generation and instance["state"] == "ready":
        return instance
    for instance in updates:
        if not as_json:
            print(
                f"{instance['state']}"
                + (f" ({instance.get('progress')})" if instance.get("progress") else "")
            )
        done = instance["observed_generation"] >= generation and instance["state"] == "ready"
        given_up = (instance.get("failed_generation") or 0) >= generation
        if done or given_up or instance["state"] in (*TERMINAL, "degraded"):
            break
    return instance


def cmd_delete(args: argparse.Namespace) -> int:
    api = Api(args)
    params = {"skip_final_backup": "true"} if args.skip_final_backup else None
    instance = api.request("DELETE", f"/v1/instances/{args.id}", params=params)
    if args.wait:
        instance = follow(api, args.id, ("deleted",), args.json)
        if instance["state"] != "deleted":
            raise ended_failed(instance)
    if args.json:
        print_json(instance)
    else:
        print(f"{args.id}: {instance['state']}" + (" (deletion requested)" if not args.wait else ""))
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    items = _all_items(Api(args), f"/v1/instances/{args.id}/events")
    if args.json:
        print_json(items)
        return 0
    rows = [
        (e["at"], e.get("from_state") or "", e["to_state"], e["event"], _actor(e), e.get("reason") or "")
        for e in items
    ]
    print_table(rows, ("at", "from", "to", "event", "actor", "reason"))
    return 0


def _actor(event: dict[str, Any]) -> str:
    actor = event.get("actor")
    if isinstance(actor, dict):
        return f"{actor.get('kind')}:{actor.get('id')}"
    return str(actor)


def cmd_watch(args: argparse.Namespace) -> int:
    api = Api(args)
    if not args.json:
        follow(api, args.id, (), as_json=False)
        return 0
    for _name, event in api.stream_events(args.id):
        json.dump(event, sys.stdout)
        sys.stdout.write("\n")
        sys.stdout.flush()
    return 0


def cmd_backups(args: argparse.Namespace) -> int:
    items = _all_items(Api(args), f"/v1/instances/{args.id}/backups")
    if args.json:
        print_json(items)
        return 0
    print_table(
        [(b["id"], b["kind"], b["taken_at"], b["size_bytes"]) for b in items],
        ("id", "kind", "taken_at", "size_bytes"),
    )
    return 0


def cmd_backup(args: argparse.Namespace) -> int:
    requested = Api(args).request("POST", f"/v1/instances/{args.id}/backups")
    if args.json:
        print_json(requested)
    elif requested["created"]:
        job = requested["job_id"]
        print(f"{args.id}: backup requested (job {job}); `instances backups` lists it once taken")
    else:
        print(f"{args.id}: a backup is already under way (job {requested['job_id']})")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    api = Api(args)
    body: dict[str, Any] = {"empty": True} if args.empty else {}
    if args.backup:
        body["backup_id"] = args.backup
    if args.reason:
        body["reason"] = args.reason
    instance = api.request("POST", f"/v1/instances/{args.id}/restore", json=body)
    if not args.wait:
        if args.json:
            print_json(instance)
        else:
            source = "empty" if args.empty else args.backup or "the newest backup"
            print(f"{args.id}: restore requested ({source})")
        return 0
    final = follow(api, args.id, ("ready",), args.json)
    if args.json:
        print_json(final)
    if final["state"] != "ready":
        reason = (final.get("failure") or {}).get("message") or "no reason"
        raise CommandError(f"instance is {final['state']}: {reason}")
    return 0


def cmd_ca(args: argparse.Namespace) -> int:
    pem = Api(args, need_key=False).ca_pem()
    if args.output is None:
        sys.stdout.write(pem)
        return 0
    args.output.write_text(pem)
    print(f"CA certificate written to {args.output} (use it as sslrootcert)")
    return 0
