"""SRE commands on the control plane's database: lifecycle, audit verify, events, stats, stuck."""

from __future__ import annotations

import argparse
import asyncio
import uuid
from datetime import datetime
from typing import Any

from controlplane import audit, db, events, lifecycle, reference, sql
from controlplane.cli import jobs as jobs_cli
from controlplane.cli.client import Api
from controlplane.cli.common import (
    add_output_flag,
    add_remote_flags,
    add_settings_flags,
    output_format,
    print_data,
    print_table,
    remote,
    run_with_db,
    settings_from,
)
from controlplane.db import AsyncConn

DB_FLAGS = ("database_url", "data_dir")


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "lifecycle", help="print the lifecycle tables, their metadata and the failure reasons"
    )
    parser.add_argument("--format", choices=("table", "json", "mermaid"), default="table")
    parser.set_defaults(handler=cmd_lifecycle)

    parser = commands.add_parser("audit", help="check the audit log against the current rows")
    audit_commands = parser.add_subparsers(dest="audit_command", metavar="ACTION", required=True)
    verify = audit_commands.add_parser(
        "verify", help="replay every event log; print mismatches; exit 1 if there is any"
    )
    add_settings_flags(verify, DB_FLAGS)
    verify.set_defaults(handler=cmd_audit_verify)

    parser = commands.add_parser(
        "events",
        help="the audit log of all instances, filtered, oldest first",
        description="The audit log of all instances, filtered, oldest first. --actor stripe also finds "
        "the moves of the jobs a Stripe event enqueued (stripe:<event id> for one event's).",
        epilog="examples:\n  controlplane events --to-state failed --since 2026-01-31T00:00:00Z\n"
        "  controlplane events --actor stripe --url https://cp.example.com",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--instance", type=uuid.UUID)
    parser.add_argument("--org", type=uuid.UUID)
    parser.add_argument("--actor", help="actor kind (stripe) or kind:id")
    parser.add_argument("--event")
    parser.add_argument("--to-state", choices=lifecycle.INSTANCE.states)
    parser.add_argument("--since", type=datetime.fromisoformat, help="ISO time, inclusive")
    parser.add_argument("--until", type=datetime.fromisoformat, help="ISO time, exclusive")
    parser.add_argument("--limit", type=int, default=200, help="events at most (default: 200)")
    add_output_flag(parser)
    add_remote_flags(parser)
    add_settings_flags(parser, DB_FLAGS)
    parser.set_defaults(handler=cmd_events)

    parser = commands.add_parser("stats", help="lifecycle statistics")
    stats = parser.add_subparsers(dest="stats_command", metavar="WHAT", required=True)
    dwell = stats.add_parser("dwell", help="time spent in each state: count, p50, p95, max")
    dwell.add_argument(
        "--entity", choices=tuple(lifecycle.LIFECYCLES), default="instance", help="(default: instance)"
    )
    add_output_flag(dwell)
    add_remote_flags(dwell)
    add_settings_flags(dwell, DB_FLAGS)
    dwell.set_defaults(handler=jobs_cli.cmd_dwell)

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
    parser.set_defaults(handler=cmd_stuck)


def cmd_lifecycle(args: argparse.Namespace) -> int:
    document = reference.lifecycle_document(settings_from(args).reconciler.deadline_s)
    if args.format == "json":
        print_data(document, "json")
        return 0
    if args.format == "mermaid":
        for name, table in lifecycle.LIFECYCLES.items():
            print(f"%% {name} lifecycle\n{table.mermaid()}\n")
        return 0
    states = document["instance"]["state_info"]
    print_table(
        [
            (state, info["label"], info["severity"], info["billing"], info["deadline_s"] or "")
            for state, info in states.items()
        ],
        ("instance state", "label", "severity", "billing", "deadline_s"),
    )
    print()
    for name, table in lifecycle.LIFECYCLES.items():
        print(f"{name}: initial {table.initial}; terminal {', '.join(sorted(table.terminal))}")
        width = max(len(s) for s, _ in table.transitions)
        for (src, event), dst in table.transitions.items():
            alert = "  (alerts)" if table.alerts(src, event) else ""
            print(f"  {src.ljust(width)}  --{event}-->  {dst}{alert}")
        print()
    print_table(
        [
            (r["code"], "yes" if r["retryable"] else "no", ", ".join(r["states"]), r["message"])
            for r in document["failure_reasons"]
        ],
        ("failure code", "retryable", "states", "message"),
    )
    return 0


def cmd_audit_verify(args: argparse.Namespace) -> int:
    url = db.resolve_database_url(settings_from(args))

    async def run() -> list[audit.Mismatch]:
        conn = await db.connect(url)
        async with conn:
            return await audit.verify(conn)

    mismatches = asyncio.run(run())
    for mismatch in mismatches:
        print(mismatch)
    print(f"audit verify: {len(mismatches)} mismatch(es)")
    return 1 if mismatches else 0


def _event_row(r: dict[str, Any]) -> dict[str, Any]:
    """An audit row as the API or the database gives it, with the actor as kind:id."""
    actor = r.get("actor")
    if isinstance(actor, dict):
        return {**r, "actor": f"{actor['kind']}:{actor['id']}"}
    return {**r, "actor": f"{r['actor_kind']}:{r['actor_id']}"}


def cmd_events(args: argparse.Namespace) -> int:
    if remote(args):
        params: dict[str, Any] = {
            "instance": args.instance,
            "org": args.org,
            "actor": args.actor,
            "event": args.event,
            "to_state": args.to_state,
            "since": args.since.isoformat() if args.since else None,
            "until": args.until.isoformat() if args.until else None,
            "limit": min(args.limit, 500),
        }
        page = Api(args, admin=True).request(
            "GET", "/v1/admin/events", params={k: str(v) for k, v in params.items() if v is not None}
        )
        rows = page["items"][: args.limit]
    else:
        where = events.EventFilter(
            args.instance, args.org, args.actor, args.event, args.to_state, args.since, args.until
        )
        rows = run_with_db(args, lambda conn: events.search(conn, where, limit=args.limit))
    fmt = output_format(args)
    if fmt != "table":
        print_data(rows, fmt)
        return 0
    shown = [_event_row(dict(r)) for r in rows]
    print_table(
        [
            (
                r["at"],
                r["instance_id"],
                r["from_state"] or "",
                r["to_state"],
                r["event"],
                r["actor"],
                r["reason"],
            )
            for r in shown
        ],
        ("AT", "INSTANCE", "FROM", "TO", "EVENT", "ACTOR", "REASON"),
        state_column="TO",
    )
    return 0


def cmd_stuck(args: argparse.Namespace) -> int:
    if remote(args):
        found = Api(args, admin=True).request("GET", "/v1/admin/stuck")
        instances, silent = found["instances_past_deadline"], found["jobs_without_heartbeat"]
        stale_after_s = float(found["stale_after_s"])
    else:
        stale_after_s = settings_from(args).worker.reclaim_after_s

        async def find(conn: AsyncConn) -> tuple[list[Any], list[Any]]:
            late = await (await conn.execute(sql.STUCK_INSTANCES)).fetchall()
            quiet = await (await conn.execute(sql.SILENT_JOBS, {"stale_after_s": stale_after_s})).fetchall()
            return [{**r, "overdue_s": r["overdue"].total_seconds()} for r in late], [
                {**r, "silent_for_s": r["silent_for"].total_seconds()} for r in quiet
            ]

        instances, silent = run_with_db(args, find)
    fmt = output_format(args)
    if fmt != "table":
        print_data({"instances_past_deadline": instances, "jobs_without_heartbeat": silent}, fmt)
        return 0
    print(f"instances past their deadline: {len(instances)}")
    if instances:
        print_table(
            [
                (
                    r["id"],
                    r["name"],
                    r["state"],
                    r["progress"] or "",
                    r["deadline_retries"],
                    f"{r['overdue_s']:.0f}s",
                )
                for r in instances
            ],
            ("ID", "NAME", "STATE", "STEP", "RETRIES", "OVERDUE"),
        )
    print(f"jobs without a heartbeat for over {stale_after_s:g}s: {len(silent)}")
    if silent:
        print_table(
            [
                (r["id"], r["kind"], r["state"], r["claimed_by"], r["attempt"], f"{r['silent_for_s']:.0f}s")
                for r in silent
            ],
            ("ID", "KIND", "STATE", "WORKER", "ATTEMPT", "SILENT_FOR"),
        )
    return 0
