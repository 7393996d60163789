"""The `controlplane jobs` commands: list jobs, steer them (pause, resume, retry, abandon), dwell times."""

from __future__ import annotations

import argparse
import getpass
import uuid
from typing import Any, TypeVar

from controlplane import dwell, lifecycle, queue
from controlplane import settings as settings_module
from controlplane.cli.common import (
    CommandError,
    add_settings_flags,
    print_json,
    print_table,
    run_with_db,
    settings_from,
)
from controlplane.db import AsyncConn
from controlplane.registry import JobRegistry, load_registry

DB_FLAGS = ("database_url", "data_dir")
# The instance job kinds: their abandonment hooks fail or degrade the instance (no provisioner needed).
DEFAULT_REGISTRY = "controlplane.operations:registry"
T = TypeVar("T")


def register(commands: Any) -> None:
    parser = commands.add_parser("jobs", help="inspect and steer jobs")
    actions = parser.add_subparsers(dest="jobs_command", metavar="ACTION", required=True)

    listing = actions.add_parser("list", help="jobs, newest first")
    listing.add_argument("--state", choices=lifecycle.JOB.states)
    listing.add_argument("--kind")
    listing.add_argument("--instance", type=uuid.UUID, help="only this instance's jobs")
    listing.add_argument("--limit", type=int, default=50)
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_settings_flags(listing, DB_FLAGS)
    listing.set_defaults(handler=cmd_list)

    stats = actions.add_parser("dwell", help="time spent in each state: count, p50, p95, max")
    stats.add_argument("--entity", choices=tuple(lifecycle.LIFECYCLES), default="job")
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_settings_flags(stats, DB_FLAGS)
    stats.set_defaults(handler=cmd_dwell)

    for action in queue.OPERATOR_ACTIONS:
        steer = actions.add_parser(action, help=f"{action} a job (as an operator, with a reason)")
        steer.add_argument("job_id", metavar="ID", type=uuid.UUID)
        steer.add_argument("--reason", required=True, help="why (recorded in the job's events)")
        steer.add_argument("--operator", default=None, help="who (default: the current OS user)")
        steer.add_argument("--json", action="store_true", help="print the job as JSON")
        if action == "abandon":
            steer.add_argument(
                "--registry",
                default=None,
                help="job kinds as module:attribute, for the abandonment hook "
                f"(env {settings_module.env_name('job_registry')}, default {DEFAULT_REGISTRY})",
            )
            steer.add_argument(
                "--force", action="store_true", help="abandon even if the kind's hook cannot run here"
            )
        add_settings_flags(steer, DB_FLAGS)
        steer.set_defaults(handler=cmd_steer, action=action)


def _seconds(value: float) -> str:
    return f"{value:.3f}"


def cmd_list(args: argparse.Namespace) -> int:
    rows = run_with_db(
        args,
        lambda conn: queue.list_jobs(
            conn, state=args.state, kind=args.kind, instance_id=args.instance, limit=args.limit
        ),
    )
    if args.json:
        print_json(rows)
        return 0
    print_table(
        [
            (
                r["id"],
                r["kind"],
                r["state"],
                f"{r['attempt']}/{r['max_attempts']}",
                r["priority"],
                r["run_at"].isoformat(timespec="seconds"),
                r["claimed_by"],
                r["fence"],
                (r["last_error"] or "")[:60],
            )
            for r in rows
        ],
        ("ID", "KIND", "STATE", "ATTEMPT", "PRIO", "RUN_AT", "CLAIMED_BY", "FENCE", "LAST_ERROR"),
    )
    return 0


def cmd_dwell(args: argparse.Namespace) -> int:
    stats = run_with_db(args, lambda conn: dwell.dwell_stats(conn, args.entity))
    if args.json:
        print_json({"entity": args.entity, "states": [s.as_dict() for s in stats]})
        return 0
    print_table(
        [
            (s.state, s.count, s.current, _seconds(s.p50_s), _seconds(s.p95_s), _seconds(s.max_s))
            for s in stats
        ],
        ("STATE", "STAYS", "NOW_IN", "P50_S", "P95_S", "MAX_S"),
    )
    return 0


def cmd_steer(args: argparse.Namespace) -> int:
    operator = args.operator or getpass.getuser()
    registry: JobRegistry | None = None
    if args.action == "abandon" and not args.force:
        spec = args.registry or settings_from(args).worker.job_registry or DEFAULT_REGISTRY
        try:
            registry = load_registry(spec)
        except Exception as exc:
            raise CommandError(
                f"cannot load the job kinds {spec!r} for the abandonment hook ({exc}); "
                "name them with --registry, or --force to abandon without the hook"
            ) from exc

    async def steer(conn: AsyncConn) -> Any:
        return await queue.operator_action(
            conn,
            args.job_id,
            args.action,
            operator,
            args.reason,
            registry=registry,
            force=bool(getattr(args, "force", False)),
        )

    try:
        row = run_with_db(args, steer)
    except (queue.ActionRefused, queue.JobNotFound, ValueError) as exc:
        raise CommandError(str(exc)) from exc
    if args.json:
        print_json({k: v for k, v in row.items() if not k.startswith("_")})
    else:
        print(f"job {row['id']} is now {row['state']} (version {row['state_version']})")
    return 0
