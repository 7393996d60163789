"""SRE commands on the control plane's database: lifecycle, audit verify, events, stats, stuck."""

from __future__ import annotations

import argparse
import asyncio
import uuid
from datetime import datetime
from typing import Any

from controlplane import audit, db, events, lifecycle, reference, sql
from controlplane.cli import jobs as jobs_cli
from controlplane.cli.common import add_settings_flags, print_json, print_table, run_with_db, settings_from
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

    parser = commands.add_parser("events", help="the audit log of all instances, filtered, oldest first")
    parser.add_argument("--instance", type=uuid.UUID)
    parser.add_argument("--org", type=uuid.UUID)
    parser.add_argument("--actor", help="actor kind (stripe) or kind:id")
    parser.add_argument("--event")
    parser.add_argument("--to-state", choices=lifecycle.INSTANCE.states)
    parser.add_argument("--since", type=datetime.fromisoformat, help="ISO time, inclusive")
    parser.add_argument("--until", type=datetime.fromisoformat, help="ISO time, exclusive")
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    add_settings_flags(parser, DB_FLAGS)
    parser.set_defaults(handler=cmd_events)

    parser = commands.add_parser("stats", help="lifecycle statistics")
    stats = parser.add_subparsers(dest="stats_command", metavar="WHAT", required=True)
    dwell = stats.add_parser("dwell", help="time spent in each state: count, p50, p95, max")
    dwell.add_argument("--entity", choices=tuple(lifecycle.LIFECYCLES), default="instance")
    dwell.add_argument("--json", action="store_true")
    add_settings_flags(dwell, DB_FLAGS)
    dwell.set_defaults(handler=jobs_cli.cmd_dwell)

    parser = commands.add_parser(
        "stuck", help="instances past their state deadline and jobs whose heartbeat went silent"
    )
    parser.add_argument("--json", action="store_true")
    add_settings_flags(parser, (*DB_FLAGS, "heartbeat_interval_s", "reclaim_after_intervals"))
    parser.set_defaults(handler=cmd_stuck)


def cmd_lifecycle(args: argparse.Namespace) -> int:
    document = reference.lifecycle_document(settings_from(args).reconciler.deadline_s)
    if args.format == "json":
        print_json(document)
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


def cmd_events(args: argparse.Namespace) -> int:
    where = events.EventFilter(
        args.instance, args.org, args.actor, args.event, args.to_state, args.since, args.until
    )
    rows = run_with_db(args, lambda conn: events.search(conn, where, limit=args.limit))
    if args.json:
        print_json(rows)
        return 0
    print_table(
        [
            (
                r["at"].isoformat(timespec="seconds"),
                r["instance_id"],
                r["from_state"] or "",
                r["to_state"],
                r["event"],
                f"{r['actor_kind']}:{r['actor_id']}",
                (r["reason"] or "")[:60],
            )
            for r in rows
        ],
        ("AT", "INSTANCE", "FROM", "TO", "EVENT", "ACTOR", "REASON"),
    )
    return 0


def cmd_stuck(args: argparse.Namespace) -> int:
    stale_after_s = settings_from(args).worker.reclaim_after_s

    async def find(conn: AsyncConn) -> tuple[list[Any], list[Any]]:
        instances = await (await conn.execute(sql.STUCK_INSTANCES)).fetchall()
        silent = await (await conn.execute(sql.SILENT_JOBS, {"stale_after_s": stale_after_s})).fetchall()
        return instances, silent

    instances, silent = run_with_db(args, find)
    if args.json:
        print_json({"instances_past_deadline": instances, "jobs_without_heartbeat": silent})
        return 0
    print(f"instances past their deadline: {len(instances)}")
    if instances:
        print_table(
            [
                (r["id"], r["name"], r["state"], r["progress"] or "", r["deadline_retries"], r["overdue"])
                for r in instances
            ],
            ("ID", "NAME", "STATE", "STEP", "RETRIES", "OVERDUE"),
        )
    print(f"jobs without a heartbeat for over {stale_after_s:g}s: {len(silent)}")
    if silent:
        print_table(
            [
                (r["id"], r["kind"], r["state"], r["claimed_by"], r["attempt"], r["silent_for"])
                for r in silent
            ],
            ("ID", "KIND", "STATE", "WORKER", "ATTEMPT", "SILENT_FOR"),
        )
    return 0
