"""Customer commands: `controlplane instances ...` talking to the REST API with an API key.

Every instance argument is its name or its id (the API resolves a name in one look-up)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

from controlplane.cli.client import Api, WaitTimeout, config_dir, instance_path
from controlplane.cli.common import (
    CommandError,
    add_output_flag,
    cell_text,
    output_format,
    print_data,
    print_table,
    timestamp,
)
from controlplane.core import exit_codes, lifecycle, plans

TERMINAL = lifecycle.INSTANCE.terminal
LIST_COLUMNS = ("name", "id", "plan", "state", "created_at")
DEFAULT_TIMEOUT = "30m"
PLANS_HELP = f"one of: {', '.join(plans.plan_names())}"
REF = "NAME_OR_ID"
REF_HELP = "the database's name (or its id)"


def parse_duration(text: str) -> float:
    """Seconds from `90`, `90s`, `10m` or `1h`."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration: use e.g. 90s, 10m or 1h")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)]


def _wait_flags(parser: argparse.ArgumentParser, until: str) -> None:
    parser.add_argument("--wait", action="store_true", help=f"follow progress until {until}")
    parser.add_argument(
        "--timeout",
        type=parse_duration,
        default=DEFAULT_TIMEOUT,
        metavar="DURATION",
        help=f"with --wait: give up after this long, exit code {exit_codes.TIMEOUT}"
        f" (default: {DEFAULT_TIMEOUT})",
    )


# `resize --wait` on a suspended instance: the change is recorded, and applied once it resumes.
RECORDED_WHILE_SUSPENDED = exit_codes.RECORDED


def register(commands: Any) -> None:
    instances = commands.add_parser(
        "instances",
        help="create, inspect, resize and delete databases",
        description="Create, inspect, resize and delete databases (by name or id).",
    )
    actions = instances.add_subparsers(dest="instances_command", metavar="ACTION", required=True)

    create = _action(
        actions,
        "create",
        "create a database",
        cmd_create,
        "controlplane instances create orders --plan dev --wait",
    )
    create.add_argument("name", metavar="NAME", help="a DNS label, unique among your live databases")
    create.add_argument("--plan", required=True, choices=plans.plan_names(), metavar="PLAN", help=PLANS_HELP)
    create.add_argument("--region", help="where to run it (default: local)")
    create.add_argument("--deletion-protection", action="store_true", help="refuse deletion until turned off")
    _wait_flags(create, "ready")

    listing = _action(
        actions,
        "list",
        "list databases (failed and deleted ones with --all)",
        cmd_list,
        "controlplane instances list --all -o json",
    )
    listing.add_argument(
        "--state", choices=lifecycle.INSTANCE.states, metavar="STATE", help="only those in this state"
    )
    listing.add_argument("--all", action="store_true", help="failed and deleted databases too")

    show = _action(actions, "show", "show one database", cmd_show, "controlplane instances show orders")
    _ref(show)
    show.add_argument("--uri", action="store_true", help="print only the connection URI (for psql)")

    resize = _action(
        actions,
        "resize",
        "change a database's plan",
        cmd_resize,
        "controlplane instances resize orders --plan small --wait",
    )
    _ref(resize)
    resize.add_argument("--plan", required=True, choices=plans.plan_names(), metavar="PLAN", help=PLANS_HELP)
    _wait_flags(resize, "the new plan is in place")
    resize.add_argument(
        "--wait-for-resume",
        action="store_true",
        help="with --wait on a suspended instance, keep waiting until it resumes and the change is"
        f" applied (without it, --wait says the change is recorded and exits {RECORDED_WHILE_SUSPENDED})",
    )

    delete = _action(
        actions,
        "delete",
        "delete a database (a final backup is taken first)",
        cmd_delete,
        "controlplane instances delete orders --wait",
    )
    _ref(delete)
    delete.add_argument("--skip-final-backup", action="store_true", help="delete without a final backup")
    _wait_flags(delete, "deleted")

    protection = _action(
        actions,
        "protection",
        "turn deletion protection on or off",
        cmd_protection,
        "controlplane instances protection orders on",
    )
    _ref(protection)
    protection.add_argument("setting", choices=("on", "off"), help="on: deletion is refused; off: allowed")

    retry = _action(
        actions,
        "retry",
        "create a failed database again: same name and plan, linked to the failed one",
        cmd_retry,
        "controlplane instances retry orders --wait",
    )
    _ref(retry)
    _wait_flags(retry, "ready")

    wait = _action(
        actions,
        "wait",
        "wait until a database reaches a state",
        cmd_wait,
        "controlplane instances wait orders --for ready --timeout 10m",
    )
    _ref(wait)
    wait.add_argument(
        "--for",
        dest="states",
        required=True,
        metavar="STATE[,STATE]",
        type=_states,
        help=f"the state(s) to wait for: {', '.join(lifecycle.INSTANCE.states)}",
    )
    wait.add_argument(
        "--timeout",
        type=parse_duration,
        default=DEFAULT_TIMEOUT,
        metavar="DURATION",
        help=f"give up after this long, exit code {exit_codes.TIMEOUT} (default: {DEFAULT_TIMEOUT})",
    )

    events = _action(
        actions, "events", "a database's audit log", cmd_events, "controlplane instances events orders"
    )
    _ref(events)

    watch = _action(
        actions,
        "watch",
        "follow a database's state changes (Ctrl-C stops)",
        cmd_watch,
        "controlplane instances watch orders",
    )
    _ref(watch)

    listing = _action(
        actions,
        "backups",
        "a database's backups, newest first",
        cmd_backups,
        "controlplane instances backups orders",
    )
    _ref(listing)

    backup = _action(
        actions,
        "backup",
        "take a backup now (beside the plan's schedule)",
        cmd_backup,
        "controlplane instances backup orders",
    )
    _ref(backup)

    restore = _action(
        actions,
        "restore",
        "bring back a database whose data is lost: from a backup, or empty",
        cmd_restore,
        "controlplane instances restore orders --newest --wait",
    )
    _ref(restore)
    source = restore.add_mutually_exclusive_group(required=True)
    source.add_argument("--backup", metavar="BACKUP_ID", help="a backup listed by `instances backups`")
    source.add_argument("--newest", action="store_true", help="the newest backup held")
    source.add_argument(
        "--empty", action="store_true", help="re-create it empty: accept that its data is lost"
    )
    restore.add_argument("--reason", help="why, for the audit log")
    _wait_flags(restore, "ready")

    ca = commands.add_parser(
        "ca",
        help="the CA certificate the databases' server certificates are checked against",
        description="Print (or save) the CA certificate the databases' server certificates are checked"
        " against.",
        epilog="example:\n  controlplane ca --file ca.pem",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    api_flags(ca, key=False)
    ca.add_argument(
        "--file", "--output-file", dest="file", type=Path, help="write it to this file (default: print it)"
    )
    ca.set_defaults(handler=cmd_ca)


def _states(text: str) -> tuple[str, ...]:
    states = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in states if s not in lifecycle.INSTANCE.states]
    if unknown or not states:
        raise argparse.ArgumentTypeError(
            f"unknown state {', '.join(unknown) or text!r}; states are {', '.join(lifecycle.INSTANCE.states)}"
        )
    return states


def _ref(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ref", metavar=REF, help=REF_HELP)


def api_flags(parser: argparse.ArgumentParser, *, key: bool = True) -> None:
    """Where the API is and which key to use; each falls back to its variable, then the profile."""
    parser.add_argument(
        "--profile", default=None, help="a profile of the config file (env CONTROLPLANE_PROFILE)"
    )
    parser.add_argument(
        "--url",
        default=None,
        help="API URL (env CONTROLPLANE_URL; default: the profile's, else http://127.0.0.1:8700)",
    )
    if key:
        parser.add_argument(
            "--api-key", default=None, help="API key (env CONTROLPLANE_API_KEY; default: the profile's)"
        )


def _action(actions: Any, name: str, help_text: str, handler: Any, example: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = actions.add_parser(
        name,
        help=help_text,
        description=help_text[0].upper() + help_text[1:] + ".",
        epilog=f"example:\n  {example}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    api_flags(parser)
    add_output_flag(parser)
    parser.set_defaults(handler=handler)
    return parser


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


def show_instance(instance: dict[str, Any], fmt: str, api: Api | None = None) -> None:
    if fmt != "table":
        print_data(instance, fmt)
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
    # The values whole (a URI is copied from here): only very long ones are cut.
    print_table(rows, ("field", "value"), max_cell=400)


class Follower:
    """Prints, as they happen, an instance's state changes and steps, with the time since it started."""

    def __init__(self, as_json: bool) -> None:
        # Machine-readable output follows: the lines are not printed.
        self.quiet = as_json
        self.started = time.monotonic()
        self.last_state: str | None = None
        # (step, attempt, state) lines printed: each once.
        self.printed: set[tuple[str, int, str]] = set()
        self.warned_overdue = False

    def _print(self, text: str) -> None:
        if not self.quiet:
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
            expected = progress.get("expected_by")
            self._print(f"  taking longer than expected (expected by {expected and cell_text(expected)})")


def _deadline(args: argparse.Namespace) -> float:
    return time.monotonic() + float(args.timeout)


def _updates(
    api: Api, ref: str, follower: Follower | None = None, deadline: float | None = None
) -> Iterator[dict[str, Any]]:
    """The instance as it is now, then as it is after each change its watch stream announces; its
    steps go to `follower` as they happen. WaitTimeout at `deadline`."""
    path = f"/v1/instances/{instance_path(ref)}"
    yield api.request("GET", path)
    for name, data in api.stream_events(ref, deadline=deadline):
        if name == "step":
            if follower is not None:
                follower.step(data)
            continue
        yield api.request("GET", path)


def follow(
    api: Api, ref: str, until: tuple[str, ...], quiet: bool, deadline: float | None = None
) -> dict[str, Any]:
    """Print each state change and step until the instance reaches one of `until` (or a terminal
    state); WaitTimeout (exit code 5) at `deadline`, saying where it is."""
    follower = Follower(quiet)
    instance: dict[str, Any] = {}
    try:
        for instance in _updates(api, ref, follower, deadline):
            follower.instance(instance)
            if instance["state"] in until or instance["state"] in TERMINAL:
                break
    except WaitTimeout:
        where = f" (it is {instance['state']})" if instance else ""
        name = instance.get("name") or ref
        raise WaitTimeout(f"timed out waiting for {name} to be {' or '.join(until)}{where}") from None
    return instance


def ended_failed(instance: dict[str, Any], quiet: bool = False) -> CommandError:
    """Print why the instance failed and what to do next; the one-line error to exit with."""
    failure = instance.get("failure")
    name = instance.get("name") or instance["id"]
    if not quiet:
        for label, text in failure_rows(failure) if failure else []:
            print(f"{label}: {text}")
        if "retry" in instance.get("allowed_actions", []):
            print(f"retry: controlplane instances retry {name} --wait")
        elif "delete" in instance.get("allowed_actions", []):
            print(f"remove what is left: controlplane instances delete {instance['id']}")
    code = (failure or {}).get("code", "no reason")
    return CommandError(f"instance {name} ended {instance['state']}: {code}", exit_codes.FAILED)


def wait_until_ready(api: Api, instance: dict[str, Any], fmt: str, deadline: float) -> int:
    """Follow a new instance until ready: then its id, name and URI, else why it failed and the
    retry command."""
    quiet = fmt != "table"
    final = follow(api, instance["id"], ("ready",), quiet, deadline)
    if quiet:
        print_data(final, fmt)
    if final["state"] != "ready":
        raise ended_failed(final, quiet)
    if not quiet:
        print(f"{final['name']} ({final['id']}) is ready")
        if final.get("connection"):
            print(connection_uri(api, final["connection"]))
    return 0


def cmd_create(args: argparse.Namespace) -> int:
    api = Api(args)
    fmt = output_format(args)
    body: dict[str, Any] = {"name": args.name, "plan": args.plan}
    if args.region:
        body["region"] = args.region
    if args.deletion_protection:
        body["deletion_protection"] = True
    instance = api.request("POST", "/v1/instances", json=body)
    if not args.wait:
        show_instance(instance, fmt)
        return 0
    if fmt == "table":
        print(f"{instance['name']}: created as {instance['id']}")
    return wait_until_ready(api, instance, fmt, _deadline(args))


def cmd_retry(args: argparse.Namespace) -> int:
    api = Api(args)
    fmt = output_format(args)
    # A failed instance is retried at most once (the API refuses a second retry): no key is needed.
    instance = api.request("POST", f"/v1/instances/{instance_path(args.ref)}/retry")
    if fmt != "table" and not args.wait:
        print_data(instance, fmt)
        return 0
    if fmt == "table":
        print(f"{instance['name']}: retried as {instance['id']} (replaces {instance.get('replaces')})")
    if not args.wait:
        return 0
    return wait_until_ready(api, instance, fmt, _deadline(args))


def cmd_list(args: argparse.Namespace) -> int:
    params: dict[str, Any] = {"limit": 100}
    if args.state:
        params["state"] = args.state
    elif not args.all:
        params["live"] = "true"
    items = Api(args).all_items("/v1/instances", params)
    fmt = output_format(args)
    if fmt != "table":
        print_data(items, fmt)
    else:
        print_table(
            [[item.get(c) for c in LIST_COLUMNS] for item in items], LIST_COLUMNS, state_column="state"
        )
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    api = Api(args)
    instance = api.request("GET", f"/v1/instances/{instance_path(args.ref)}")
    if args.uri:
        if not instance.get("connection"):
            raise CommandError(
                f"instance {args.ref} has no connection yet (state {instance['state']})", exit_codes.CONFLICT
            )
        print(connection_uri(api, instance["connection"]))
        return 0
    show_instance(instance, output_format(args), api)
    return 0


def cmd_resize(args: argparse.Namespace) -> int:
    api = Api(args)
    fmt = output_format(args)
    instance = api.request("PATCH", f"/v1/instances/{instance_path(args.ref)}", json={"plan": args.plan})
    if args.wait or args.wait_for_resume:
        generation = int(instance["spec_generation"])
        instance = wait_for_generation(
            api,
            instance["id"],
            generation,
            fmt != "table",
            _deadline(args),
            plan=args.plan,
            through_suspension=args.wait_for_resume,
        )
        if instance["state"] == "suspended":
            show_instance(instance, fmt)
            return RECORDED_WHILE_SUSPENDED
        if instance["observed_generation"] < generation or instance["state"] != "ready":
            show_instance(instance, fmt)
            raise CommandError(
                f"resize to {args.plan} did not complete: instance is {instance['state']}"
                f" ({(instance.get('failure') or {}).get('message') or 'no reason recorded'})",
                exit_codes.FAILED,
            )
    show_instance(instance, fmt)
    return 0


def wait_for_generation(
    api: Api,
    instance_id: str,
    generation: int,
    quiet: bool,
    deadline: float,
    *,
    plan: str,
    through_suspension: bool,
) -> dict[str, Any]:
    """The instance once spec `generation` is applied, given up, or can no longer be; or, unless
    `through_suspension`, as soon as it is suspended (said at once on stderr: the change waits
    for the instance to resume). WaitTimeout at `deadline`."""
    told = False
    instance: dict[str, Any] = {}
    try:
        for n, instance in enumerate(_updates(api, instance_id, deadline=deadline)):
            if n and not quiet:
                print(f"[{timestamp_now()}] {instance['state']}", flush=True)
            done = instance["observed_generation"] >= generation and instance["state"] == "ready"
            given_up = (instance.get("failed_generation") or 0) >= generation
            if done or given_up or instance["state"] in (*TERMINAL, "degraded"):
                return instance
            if instance["state"] == "suspended" and not told:
                told = True
                line = _suspended_line(instance, plan, generation, through_suspension)
                print(line, file=sys.stderr, flush=True)
                if not through_suspension:
                    return instance
    except WaitTimeout:
        where = f" (it is {instance['state']})" if instance else ""
        raise WaitTimeout(
            f"timed out waiting for the resize of {instance.get('name', instance_id)}{where}"
        ) from None
    return instance


def timestamp_now() -> str:
    from datetime import UTC, datetime

    return timestamp(datetime.now(UTC))


def _suspended_line(instance: dict[str, Any], plan: str, generation: int, waiting: bool) -> str:
    held = "suspended by a billing hold" if instance.get("billing_hold") else "suspended"
    until = "once the hold ends and it resumes" if instance.get("billing_hold") else "once it resumes"
    then = "waiting for that (--wait-for-resume)" if waiting else "pass --wait-for-resume to wait for that"
    return (
        f"controlplane: resize to {plan} is recorded (spec generation {generation});"
        f" {instance['id']} is {held}: the change is applied {until}; {then}"
    )


def cmd_delete(args: argparse.Namespace) -> int:
    api = Api(args)
    fmt = output_format(args)
    params = {"skip_final_backup": "true"} if args.skip_final_backup else None
    instance = api.request("DELETE", f"/v1/instances/{instance_path(args.ref)}", params=params)
    if args.wait:
        # By id from here on: once deleted, the name may mean another instance.
        instance = follow(api, instance["id"], ("deleted",), fmt != "table", _deadline(args))
        if instance["state"] != "deleted" and instance.get("archived_at") is None:
            raise ended_failed(instance, fmt != "table")
    if fmt != "table":
        print_data(instance, fmt)
    else:
        requested = " (deletion requested)" if not args.wait else ""
        print(f"{instance['name']} ({instance['id']}): {instance['state']}{requested}")
    return 0


def cmd_protection(args: argparse.Namespace) -> int:
    on = args.setting == "on"
    instance = Api(args).request(
        "PATCH", f"/v1/instances/{instance_path(args.ref)}", json={"deletion_protection": on}
    )
    fmt = output_format(args)
    if fmt != "table":
        print_data(instance, fmt)
    else:
        print(f"{instance['name']}: deletion protection {'on' if instance['deletion_protection'] else 'off'}")
    return 0


def cmd_wait(args: argparse.Namespace) -> int:
    """Like `aws rds wait`: exit 0 once in one of the states, 5 at the timeout, 8 if it ended in a
    terminal state it was not asked to wait for."""
    api = Api(args)
    fmt = output_format(args)
    first = api.request("GET", f"/v1/instances/{instance_path(args.ref)}")
    final = follow(api, first["id"], args.states, fmt != "table", _deadline(args))
    if fmt != "table":
        print_data(final, fmt)
    if final["state"] not in args.states:
        raise ended_failed(final, fmt != "table")
    if fmt == "table":
        print(f"{final['name']} ({final['id']}) is {final['state']}")
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    items = Api(args).all_items(f"/v1/instances/{instance_path(args.ref)}/events")
    fmt = output_format(args)
    if fmt != "table":
        print_data(items, fmt)
        return 0
    rows = [
        (e["at"], e.get("from_state") or "", e["to_state"], e["event"], _actor(e), e.get("reason") or "")
        for e in items
    ]
    print_table(rows, ("at", "from", "to", "event", "actor", "reason"), state_column="to")
    return 0


def _actor(event: dict[str, Any]) -> str:
    actor = event.get("actor")
    if isinstance(actor, dict):
        return f"{actor.get('kind')}:{actor.get('id')}"
    return str(actor)


def cmd_watch(args: argparse.Namespace) -> int:
    api = Api(args)
    if output_format(args) == "table":
        follow(api, args.ref, (), quiet=False)
        return 0
    # One JSON document a line: each event's data (the snapshot, a transition, a step).
    for _name, event in api.stream_events(args.ref):
        json.dump(event, sys.stdout)
        sys.stdout.write("\n")
        sys.stdout.flush()
    return 0


def cmd_backups(args: argparse.Namespace) -> int:
    items = Api(args).all_items(f"/v1/instances/{instance_path(args.ref)}/backups")
    fmt = output_format(args)
    if fmt != "table":
        print_data(items, fmt)
        return 0
    print_table(
        [(b["id"], b["kind"], b["taken_at"], b["size_bytes"]) for b in items],
        ("id", "kind", "taken_at", "size_bytes"),
    )
    return 0


def cmd_backup(args: argparse.Namespace) -> int:
    requested = Api(args).request("POST", f"/v1/instances/{instance_path(args.ref)}/backups")
    fmt = output_format(args)
    if fmt != "table":
        print_data(requested, fmt)
    elif requested["created"]:
        job = requested["job_id"]
        print(f"{args.ref}: backup requested (job {job}); `instances backups` lists it once taken")
    else:
        print(f"{args.ref}: a backup is already under way (job {requested['job_id']})")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    api = Api(args)
    fmt = output_format(args)
    body: dict[str, Any] = {"empty": True} if args.empty else {}
    if args.backup:
        body["backup_id"] = args.backup
    if args.reason:
        body["reason"] = args.reason
    instance = api.request("POST", f"/v1/instances/{instance_path(args.ref)}/restore", json=body)
    if not args.wait:
        if fmt != "table":
            print_data(instance, fmt)
        else:
            source = "empty" if args.empty else args.backup or "the newest backup"
            print(f"{instance['name']}: restore requested ({source})")
        return 0
    final = follow(api, instance["id"], ("ready",), fmt != "table", _deadline(args))
    if fmt != "table":
        print_data(final, fmt)
    if final["state"] != "ready":
        reason = (final.get("failure") or {}).get("message") or "no reason"
        raise CommandError(f"instance is {final['state']}: {reason}", exit_codes.FAILED)
    return 0


def cmd_ca(args: argparse.Namespace) -> int:
    pem = Api(args, need_key=False).ca_pem()
    if args.file is None:
        sys.stdout.write(pem)
        return 0
    args.file.write_text(pem)
    print(f"CA certificate written to {args.file} (use it as sslrootcert)")
    return 0
