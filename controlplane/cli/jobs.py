"""The `controlplane jobs` commands: list jobs, steer them (pause, resume, retry, abandon), dwell times.
Their parsers; what they do is in `jobs_commands.py`."""

from __future__ import annotations

import argparse
import uuid
from typing import Any

from controlplane.cli.common import add_list_flags, add_output_flag, add_remote_flags, add_settings_flags
from controlplane.cli.lazy import LazyHandler
from controlplane.core import lifecycle

DB_FLAGS = ("database_url", "data_dir")


def register(commands: Any) -> None:
    parser = commands.add_parser("jobs", help="inspect and steer jobs")
    actions = parser.add_subparsers(dest="jobs_command", metavar="ACTION", required=True)

    listing = actions.add_parser("list", help="jobs, newest first")
    listing.add_argument(
        "--state",
        choices=lifecycle.JOB.states,
        metavar="STATE",
        help=f"only those in this state: {', '.join(lifecycle.JOB.states)} (failed: waiting for their"
        " next attempt; abandoned: given up)",
    )
    listing.add_argument("--kind", help="only this kind (provision, update, backup, ...)")
    listing.add_argument("--instance", type=uuid.UUID, help="only this instance's jobs")
    add_list_flags(listing, limit_default=50)
    add_output_flag(listing)
    add_remote_flags(listing)
    add_settings_flags(listing, DB_FLAGS)
    listing.set_defaults(handler=_handler("cmd_list"))

    history = actions.add_parser(
        "events",
        help="a job's event history, oldest first",
        description="A job's event history, oldest first: each state change with its actor and reason.",
        epilog="example:\n  controlplane jobs events 5b1e0c52-8d4f-4c7e-9a51-0d2f6b3f9e10 --url https://cp.example.com",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    history.add_argument("job_id", metavar="ID", type=uuid.UUID, help="the job's id (`jobs list`)")
    add_list_flags(history)
    add_output_flag(history)
    add_remote_flags(history)
    add_settings_flags(history, DB_FLAGS)
    history.set_defaults(handler=_handler("cmd_events"))

    stats = actions.add_parser("dwell", help="time spent in each state: count, p50, p95, max")
    stats.add_argument("--entity", choices=tuple(lifecycle.LIFECYCLES), default="job", help="(default: job)")
    add_output_flag(stats)
    add_remote_flags(stats)
    add_settings_flags(stats, DB_FLAGS)
    stats.set_defaults(handler=_handler("cmd_dwell"))

    for action in lifecycle.JOB_OPERATOR_ACTIONS:
        steer = actions.add_parser(action, help=f"{action} a job (as an operator, with a reason)")
        steer.add_argument("job_id", metavar="ID", type=uuid.UUID, help="the job's id (`jobs list`)")
        steer.add_argument("--reason", required=True, help="why (recorded in the job's events)")
        steer.add_argument("--operator", default=None, help="who (default: the current OS user)")
        add_output_flag(steer)
        add_remote_flags(steer)
        if action == "abandon":
            steer.add_argument(
                "--force", action="store_true", help="abandon even if the kind's hook cannot run here"
            )
        add_settings_flags(steer, DB_FLAGS)
        steer.set_defaults(handler=_handler("cmd_steer"), action=action)


def _handler(name: str) -> LazyHandler:
    return LazyHandler(f"controlplane.cli.jobs_commands:{name}")
