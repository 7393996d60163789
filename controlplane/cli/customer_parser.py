"""The customer commands' argument parser: the `instances` and `ca` commands, and what every command
talking to the API with a key shares (its flags, an action's sub-parser, durations)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from controlplane.cli.common import add_list_flags, add_output_flag
from controlplane.cli.lazy import LazyHandler
from controlplane.core import exit_codes, lifecycle, plans

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
        _handler("cmd_create"),
        "controlplane instances create orders --plan dev --wait",
    )
    create.add_argument("name", metavar="NAME", help="a DNS label, unique among your live databases")
    create.add_argument("--plan", required=True, choices=plans.plan_names(), metavar="PLAN", help=PLANS_HELP)
    create.add_argument("--region", help="where to run it (default: local)")
    create.add_argument("--deletion-protection", action="store_true", help="refuse deletion until turned off")
    create.add_argument(
        "--restore-from",
        metavar="SOURCE",
        help="fill it from another database's backups (by name or id; a deleted one too, while kept)",
    )
    create.add_argument(
        "--at",
        metavar="TIME",
        help="with --restore-from: the moment to restore (RFC 3339, e.g. 2026-01-31T12:00:00Z), inside the"
        " window `instances backups SOURCE` shows; default: the latest",
    )
    create.add_argument(
        "--from-backup", metavar="BACKUP_ID", help="with --restore-from: start from this backup of it"
    )
    _wait_flags(create, "ready")

    listing = _action(
        actions,
        "list",
        "list databases (failed and deleted ones with --all)",
        _handler("cmd_list"),
        "controlplane instances list --all --columns name,state,plan --limit 20",
    )
    listing.add_argument(
        "--state", choices=lifecycle.INSTANCE.states, metavar="STATE", help="only those in this state"
    )
    listing.add_argument("--all", action="store_true", help="failed and deleted databases too")
    add_list_flags(listing)

    show = _action(
        actions, "show", "show one database", _handler("cmd_show"), "controlplane instances show orders"
    )
    _ref(show)
    show.add_argument("--uri", action="store_true", help="print only the connection URI (for psql)")

    resize = _action(
        actions,
        "resize",
        "change a database's plan",
        _handler("cmd_resize"),
        "controlplane instances resize orders --plan small --wait",
    )
    _ref(resize)
    resize.add_argument("--plan", required=True, choices=plans.plan_names(), metavar="PLAN", help=PLANS_HELP)
    _wait_flags(resize, "the new plan is in place")
    resize.add_argument(
        "--wait-for-resume",
        action="store_true",
        help="with --wait on a suspended instance, keep waiting until it resumes and the change is"
        f" applied (without it, --wait says the change is recorded and exits {exit_codes.RECORDED})",
    )

    delete = _action(
        actions,
        "delete",
        "delete a database (a final backup is taken first)",
        _handler("cmd_delete"),
        "controlplane instances delete orders --wait",
    )
    _ref(delete)
    delete.add_argument("--skip-final-backup", action="store_true", help="delete without a final backup")
    _wait_flags(delete, "deleted")

    protection = _action(
        actions,
        "protection",
        "turn deletion protection on or off",
        _handler("cmd_protection"),
        "controlplane instances protection orders on",
    )
    _ref(protection)
    protection.add_argument("setting", choices=("on", "off"), help="on: deletion is refused; off: allowed")

    retry = _action(
        actions,
        "retry",
        "create a failed database again: same name and plan, linked to the failed one",
        _handler("cmd_retry"),
        "controlplane instances retry orders --wait",
    )
    _ref(retry)
    _wait_flags(retry, "ready")

    wait = _action(
        actions,
        "wait",
        "wait until a database reaches a state",
        _handler("cmd_wait"),
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
        actions,
        "events",
        "a database's audit log",
        _handler("cmd_events"),
        "controlplane instances events orders",
    )
    _ref(events)
    add_list_flags(events)

    watch = _action(
        actions,
        "watch",
        "follow a database's state changes (Ctrl-C stops)",
        _handler("cmd_watch"),
        "controlplane instances watch orders",
    )
    _ref(watch)

    charts = _action(
        actions,
        "metrics",
        "a database's metrics (connections, transactions, rows, cache, size) as sparklines",
        _handler("cmd_metrics"),
        "controlplane instances metrics orders --step 60",
    )
    _ref(charts)
    charts.add_argument("--from", dest="since", metavar="TIME", help="start (RFC 3339); default an hour ago")
    charts.add_argument("--to", dest="until", metavar="TIME", help="end (RFC 3339); default now")
    charts.add_argument("--step", type=int, metavar="SECONDS", help="seconds between points")

    listing = _action(
        actions,
        "backups",
        "the moments a database can be restored to, its archive's health, and its backups",
        _handler("cmd_backups"),
        "controlplane instances backups orders",
    )
    _ref(listing)
    add_list_flags(listing)

    backup = _action(
        actions,
        "backup",
        "take a backup now (beside the plan's schedule)",
        _handler("cmd_backup"),
        "controlplane instances backup orders",
    )
    _ref(backup)

    restore = _action(
        actions,
        "restore",
        "bring back a database whose data is lost: from a backup, or empty",
        _handler("cmd_restore"),
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

    switchover = _action(
        actions,
        "switchover",
        "move an HA database's primary to a standby (SRE: the admin key; writes pause for seconds)",
        _handler("cmd_switchover"),
        "controlplane instances switchover orders --reason maintenance",
    )
    switchover.add_argument("ref", metavar="NAME", help="the database's name (or id)")
    switchover.add_argument("--reason", required=True, help="why (recorded in the audit log)")

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
    ca.set_defaults(handler=_handler("cmd_ca"))


def _handler(name: str) -> LazyHandler:
    """A command of `instances.py` (which imports the HTTP client), imported when it runs."""
    return LazyHandler(f"controlplane.cli.instances:{name}")


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
