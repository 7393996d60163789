"""SRE commands on the control plane's database: lifecycle, audit (verify, checkpoints, export,
offline verification), events, stats, stuck. Their parsers; what they do is in `sre_commands.py`."""

from __future__ import annotations

import argparse
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

from controlplane.cli.common import add_list_flags, add_output_flag, add_remote_flags, add_settings_flags
from controlplane.cli.lazy import LazyHandler
from controlplane.core import lifecycle

DB_FLAGS = ("database_url", "data_dir")
# Commands that sign (a checkpoint, an export) decrypt the key with the secret box.
SIGNING_FLAGS = (*DB_FLAGS, "secret_key")


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "lifecycle", help="print the lifecycle tables, their metadata and the failure reasons"
    )
    parser.add_argument(
        "--format", choices=("table", "json", "mermaid"), default="table", help="(default: table)"
    )
    parser.set_defaults(handler=_handler("cmd_lifecycle"))

    parser = commands.add_parser("audit", help="verify, checkpoint and export the audit log")
    audit_commands = parser.add_subparsers(dest="audit_command", metavar="ACTION", required=True)
    verify = audit_commands.add_parser(
        "verify",
        help="replay every event log, check every hash chain and checkpoint; exit 1 on any problem",
    )
    verify.add_argument(
        "--since",
        nargs="?",
        const="latest",
        metavar="CHECKPOINT",
        help="only the events after a checkpoint (its number; alone: the newest), linked to its heads",
    )
    verify.add_argument(
        "--key", type=Path, help="check signatures with this public key (PEM), not the stored one"
    )
    add_settings_flags(verify, DB_FLAGS)
    verify.set_defaults(handler=_handler("cmd_audit_verify"))

    checkpoint = audit_commands.add_parser("checkpoint", help="record a signed checkpoint now")
    add_settings_flags(checkpoint, SIGNING_FLAGS)
    checkpoint.set_defaults(handler=_handler("cmd_audit_checkpoint"))

    public = audit_commands.add_parser("public-key", help="print the checkpoints' public key (PEM)")
    public.add_argument("--output", type=Path, help="write it to this file instead")
    add_settings_flags(public, SIGNING_FLAGS)
    public.set_defaults(handler=_handler("cmd_audit_public_key"))

    exporting = audit_commands.add_parser(
        "export", help="write the events and checkpoints (after recording one) for offline verification"
    )
    exporting.add_argument(
        "--since",
        type=_since,
        default=None,
        metavar="CHECKPOINT|TIME",
        help="from this checkpoint (a number, or the newest at or before an ISO time); default: all",
    )
    exporting.add_argument("--format", choices=("ndjson",), default="ndjson", help="(the only one: ndjson)")
    exporting.add_argument("--output", type=Path, help="write to this file (default: standard output)")
    add_settings_flags(exporting, SIGNING_FLAGS)
    exporting.set_defaults(handler=_handler("cmd_audit_export"))

    offline = audit_commands.add_parser(
        "verify-export", help="verify an export offline with the public key (no database)"
    )
    offline.add_argument("file", type=Path, metavar="FILE", help="what `audit export` wrote")
    offline.add_argument("--key", type=Path, required=True, help="the public key (PEM)")
    offline.set_defaults(handler=_handler("cmd_audit_verify_export"))

    parser = commands.add_parser(
        "events",
        help="the audit log of all instances, filtered, oldest first",
        description="The audit log of all instances, filtered, oldest first. --actor stripe also finds "
        "the moves of the jobs a Stripe event enqueued (stripe:<event id> for one event's).",
        epilog="examples:\n  controlplane events --to-state failed --since 2026-01-31T00:00:00Z\n"
        "  controlplane events --actor stripe --url https://cp.example.com",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--instance", type=uuid.UUID, metavar="ID", help="only this instance's")
    parser.add_argument("--org", type=uuid.UUID, metavar="ID", help="only this organisation's")
    parser.add_argument("--actor", help="actor kind (stripe) or kind:id")
    parser.add_argument("--event", help="only this event (provisioned, suspend, fail, ...)")
    parser.add_argument(
        "--to-state",
        choices=lifecycle.INSTANCE.states,
        metavar="STATE",
        help="only the moves into this state",
    )
    parser.add_argument("--since", type=datetime.fromisoformat, help="ISO time, inclusive")
    parser.add_argument("--until", type=datetime.fromisoformat, help="ISO time, exclusive")
    add_list_flags(parser, limit_default=200)
    add_output_flag(parser)
    add_remote_flags(parser)
    add_settings_flags(parser, DB_FLAGS)
    parser.set_defaults(handler=_handler("cmd_events"))

    parser = commands.add_parser("stats", help="lifecycle statistics")
    stats = parser.add_subparsers(dest="stats_command", metavar="WHAT", required=True)
    dwell = stats.add_parser("dwell", help="time spent in each state: count, p50, p95, max")
    dwell.add_argument(
        "--entity", choices=tuple(lifecycle.LIFECYCLES), default="instance", help="(default: instance)"
    )
    add_output_flag(dwell)
    add_remote_flags(dwell)
    add_settings_flags(dwell, DB_FLAGS)
    dwell.set_defaults(handler=LazyHandler("controlplane.cli.jobs_commands:cmd_dwell"))

    parser = commands.add_parser(
        "stuck",
        help="instances past their state deadline and jobs whose heartbeat went silent",
        description="Instances past their state deadline and jobs whose heartbeat went silent.",
        epilog="example:\n  controlplane stuck --profile prod",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_output_flag(parser)
    add_remote_flags(parser)
    add_settings_flags(parser, (*DB_FLAGS, "heartbeat_interval_s", "reclaim_after_intervals"))
    parser.set_defaults(handler=_handler("cmd_stuck"))


def _since(text: str) -> int | datetime:
    if text.isdigit():
        return int(text)
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a checkpoint number nor an ISO time") from None
    if at.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{text!r} has no time zone (add Z or +00:00)")
    return at


def _handler(name: str) -> LazyHandler:
    return LazyHandler(f"controlplane.cli.sre_commands:{name}")
