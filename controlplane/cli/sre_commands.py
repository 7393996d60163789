"""What the SRE commands do (`sre.py` parses them): lifecycle, audit (verify, checkpoints, export,
offline verification), events, stuck."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from controlplane.audit import checkpoints, export, export_verify, public_key, search, signing_key
from controlplane.audit import verify as audit
from controlplane.cli.common import (
    CommandError,
    Listing,
    api_client,
    output_format,
    print_data,
    print_items,
    print_table,
    remote,
    run_with_db,
    settings_from,
)
from controlplane.cli.render import actor_text
from controlplane.core import lifecycle, reference
from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.runtime.secretbox import load_box


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
    row = None
    if since is not None:
        row = await (
            checkpoints.latest(conn) if since == "latest" else checkpoints.by_number(conn, int(since))
        )
        if row is None and since != "latest":
            raise CommandError(f"no checkpoint {since}")
    # `--since` alone before the first checkpoint (the reconciler records one every few minutes):
    # the whole log (the summary ends "no checkpoint yet").
    if row is not None:
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


EVENTS = Listing(
    ("at", "instance", "from", "to", "event", "actor", "reason"),
    lambda e: {
        "instance": e.get("instance_name") or e["instance_id"],
        "from": e.get("from_state") or "",
        "to": e["to_state"],
        "actor": actor_text(e),
    },
    state_column="to",
)


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
        query = {k: str(v) for k, v in params.items() if v is not None}
        rows = api_client(args, admin=True).all_items("/v1/admin/events", query, limit=args.limit)
    else:
        where = search.EventFilter(
            args.instance, args.org, args.actor, args.event, args.to_state, args.since, args.until
        )
        rows = run_with_db(args, lambda conn: search.search(conn, where, limit=args.limit))
    print_items([dict(r) for r in rows], args, EVENTS)
    return 0


def cmd_stuck(args: argparse.Namespace) -> int:
    if remote(args):
        found = api_client(args, admin=True).request("GET", "/v1/admin/stuck")
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
            ("id", "name", "state", "step", "retries", "overdue"),
        )
    print(f"jobs without a heartbeat for over {stale_after_s:g}s: {len(silent)}")
    if silent:
        print_table(
            [
                (r["id"], r["kind"], r["state"], r["claimed_by"], r["attempt"], f"{r['silent_for_s']:.0f}s")
                for r in silent
            ],
            ("id", "kind", "state", "worker", "attempt", "silent_for"),
        )
    return 0
