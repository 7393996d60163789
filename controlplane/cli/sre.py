"""SRE commands on the control plane's database: lifecycle, audit (verify, checkpoints, export,
offline verification), events, stats, stuck."""

from __future__ import annotations

import argparse
import sys
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

from controlplane.audit import checkpoints, export, export_verify, public_key, search, signing_key
from controlplane.audit import verify as audit
from controlplane.cli import jobs as jobs_cli
from controlplane.cli.client import Api
from controlplane.cli.common import (
    CommandError,
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
from controlplane.core import lifecycle, reference
from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.runtime.secretbox import load_box

DB_FLAGS = ("database_url", "data_dir")
# Commands that sign (a checkpoint, an export) decrypt the key with the secret box.
SIGNING_FLAGS = (*DB_FLAGS, "secret_key")


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "lifecycle", help="print the lifecycle tables, their metadata and the failure reasons"
    )
    parser.add_argument("--format", choices=("table", "json", "mermaid"), default="table")
    parser.set_defaults(handler=cmd_lifecycle)

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
    verify.set_defaults(handler=cmd_audit_verify)

    checkpoint = audit_commands.add_parser("checkpoint", help="record a signed checkpoint now")
    add_settings_flags(checkpoint, SIGNING_FLAGS)
    checkpoint.set_defaults(handler=cmd_audit_checkpoint)

    public = audit_commands.add_parser("public-key", help="print the checkpoints' public key (PEM)")
    public.add_argument("--output", type=Path, help="write it to this file instead")
    add_settings_flags(public, SIGNING_FLAGS)
    public.set_defaults(handler=cmd_audit_public_key)

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
    exporting.add_argument("--format", choices=("ndjson",), default="ndjson")
    exporting.add_argument("--output", type=Path, help="write to this file (default: standard output)")
    add_settings_flags(exporting, SIGNING_FLAGS)
    exporting.set_defaults(handler=cmd_audit_export)

    offline = audit_commands.add_parser(
        "verify-export", help="verify an export offline with the public key (no database)"
    )
    offline.add_argument("file", type=Path, metavar="FILE")
    offline.add_argument("--key", type=Path, required=True, help="the public key (PEM)")
    offline.set_defaults(handler=cmd_audit_verify_export)

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


def _trusted_keys(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    try:
        key = public_key.load_public_pem(path.read_bytes())
    except OSError as exc:
        raise CommandError(f"cannot read the key {path}: {exc.strerror}") from None
    except public_key.BadPublicKey as exc:
        raise CommandError(f"{path}: {exc}") from None
    return {public_key.fingerprint(public_key.raw_public(key)): key}


async def _verify(conn: AsyncConn, since: str | None, keys: dict[str, Any] | None) -> tuple[list[str], str]:
    trusted = keys if keys is not None else await signing_key.public_keys(conn)
    window = None
    number = None
    if since is not None:
        row = await (
            checkpoints.latest(conn) if since == "latest" else checkpoints.by_number(conn, int(since))
        )
        if row is None:
            raise CommandError(
                "no checkpoint to start from" if since == "latest" else f"no checkpoint {since}"
            )
        number = row["number"]
        cursor = await conn.execute(sql.HEADS_OF_CHECKPOINT, {"number": number})
        heads = {
            (h["entity"], str(h["entity_id"])): (h["seq"], bytes(h["hash"])) for h in await cursor.fetchall()
        }
        window = audit.Window(row["cut"], heads)
    result = await audit.check(conn, window)
    signed = await audit.check_checkpoints(conn, trusted, number)
    lines = [str(m) for m in result.mismatches] + signed.problems
    scope = "" if number is None else f" since checkpoint {number}"
    if signed.count:
        fingerprints = ", ".join(sorted(signed.keys)) or "none"
        checked = f"checkpoints {signed.first}..{signed.last} ({signed.heads} heads; key {fingerprints})"
    else:
        checked = "no checkpoint yet"
    summary = (
        f"audit verify: {len(lines)} problem(s): {len(result.replay)} replay, {len(result.breaks)} chain, "
        f"{len(signed.problems)} checkpoint; {result.events} events of {result.entities} entities{scope}; "
        f"{checked}"
    )
    return lines, summary


def cmd_audit_verify(args: argparse.Namespace) -> int:
    if args.since is not None and args.since != "latest" and not args.since.isdigit():
        raise CommandError(f"--since {args.since}: expected a checkpoint number")
    keys = _trusted_keys(args.key)
    lines, summary = run_with_db(args, lambda conn: _verify(conn, args.since, keys))
    for line in lines:
        print(line)
    print(summary)
    return 1 if lines else 0


def cmd_audit_checkpoint(args: argparse.Namespace) -> int:
    box = load_box(settings_from(args))

    async def record(conn: AsyncConn) -> tuple[Any, Any]:
        return await checkpoints.record(conn, box), await checkpoints.latest(conn)

    made, newest = run_with_db(args, record)
    if made is None:
        print(f"nothing new since checkpoint {newest['number']}")
    else:
        print(f"checkpoint {made['number']}: {made['events']} events, {made['heads']} heads")
    return 0


def cmd_audit_public_key(args: argparse.Namespace) -> int:
    box = load_box(settings_from(args))

    async def key(conn: AsyncConn) -> str:
        return public_key.public_pem((await signing_key.ensure_key(conn, box)).public_raw)

    pem = run_with_db(args, key)
    if args.output:
        args.output.write_text(pem)
        print(f"public key written to {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(pem)
    return 0


def cmd_audit_export(args: argparse.Namespace) -> int:
    box = load_box(settings_from(args))

    async def run(conn: AsyncConn) -> export.ExportSummary:
        if args.output is None:
            return await export.export(conn, box, sys.stdout.buffer, args.since)
        with args.output.open("wb") as out:
            return await export.export(conn, box, out, args.since)

    try:
        summary = run_with_db(args, run)
    except export.ExportError as exc:
        raise CommandError(str(exc)) from None
    print(
        f"exported {summary.events} events and checkpoints {summary.first}..{summary.last} "
        f"({summary.lines} lines)",
        file=sys.stderr,
    )
    return 0


def cmd_audit_verify_export(args: argparse.Namespace) -> int:
    keys = _trusted_keys(args.key)
    assert keys is not None
    (key,) = keys.values()
    try:
        with args.file.open("rb") as handle:
            report = export_verify.verify_export(handle, key)
    except OSError as exc:
        raise CommandError(f"cannot read {args.file}: {exc.strerror}") from None
    print(report)
    return 0 if report.ok else 1


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
        where = search.EventFilter(
            args.instance, args.org, args.actor, args.event, args.to_state, args.since, args.until
        )
        rows = run_with_db(args, lambda conn: search.search(conn, where, limit=args.limit))
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
