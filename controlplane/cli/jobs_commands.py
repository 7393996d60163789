"""What the `controlplane jobs` commands do (`jobs.py` parses them), and `stats dwell`."""

from __future__ import annotations

import argparse
import getpass
from typing import Any

from controlplane.audit import dwell
from controlplane.cli.common import (
    CommandError,
    api_client,
    output_format,
    print_data,
    print_table,
    remote,
    run_with_db,
    settings_from,
)
from controlplane.cli.jobs import DEFAULT_REGISTRY
from controlplane.core import exit_codes
from controlplane.db.connection import AsyncConn
from controlplane.queue import moves as queue
from controlplane.queue.registry import JobRegistry, load_registry


def _seconds(value: float) -> str:
    return f"{value:.3f}"


def cmd_list(args: argparse.Namespace) -> int:
    if remote(args):
        params = {"state": args.state, "kind": args.kind, "instance": args.instance, "limit": args.limit}
        query = {k: str(v) for k, v in params.items() if v is not None}
        rows = api_client(args, admin=True).request("GET", "/v1/admin/jobs", params=query)["items"]
    else:
        rows = run_with_db(
            args,
            lambda conn: queue.list_jobs(
                conn, state=args.state, kind=args.kind, instance_id=args.instance, limit=args.limit
            ),
        )
    fmt = output_format(args)
    if fmt != "table":
        print_data(rows, fmt)
        return 0
    print_table(
        [
            (
                r["id"],
                r["kind"],
                r["state"],
                f"{r['attempt']}/{r['max_attempts']}",
                r["priority"],
                r["run_at"],
                r["claimed_by"],
                r["fence"],
                r["last_error"] or "",
            )
            for r in rows
        ],
        ("ID", "KIND", "STATE", "ATTEMPT", "PRIO", "RUN_AT", "CLAIMED_BY", "FENCE", "LAST_ERROR"),
        state_column="STATE",
    )
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    if remote(args):
        rows = api_client(args, admin=True).request("GET", f"/v1/admin/jobs/{args.job_id}")["items"]
    else:
        rows = run_with_db(args, lambda conn: queue.job_events(conn, args.job_id))
        if not rows:
            raise CommandError(f"no job {args.job_id}", exit_codes.NOT_FOUND)
    fmt = output_format(args)
    if fmt != "table":
        print_data(rows, fmt)
        return 0
    print_table(
        [
            (
                r["at"],
                r.get("from_state") or "",
                r["to_state"],
                r["event"],
                f"{r['actor']['kind']}:{r['actor']['id']}"
                if "actor" in r
                else f"{r['actor_kind']}:{r['actor_id']}",
                r.get("reason") or "",
            )
            for r in rows
        ],
        ("AT", "FROM", "TO", "EVENT", "ACTOR", "REASON"),
        state_column="TO",
    )
    return 0


def cmd_dwell(args: argparse.Namespace) -> int:
    if remote(args):
        found = api_client(args, admin=True).request(
            "GET", "/v1/admin/stats/dwell", params={"entity": args.entity}
        )
        states = found["states"]
    else:
        stats = run_with_db(args, lambda conn: dwell.dwell_stats(conn, args.entity))
        states = [s.as_dict() for s in stats]
    fmt = output_format(args)
    if fmt != "table":
        print_data({"entity": args.entity, "states": states}, fmt)
        return 0
    print_table(
        [
            (
                s["state"],
                s["count"],
                s["current"],
                _seconds(s["p50_s"]),
                _seconds(s["p95_s"]),
                _seconds(s["max_s"]),
            )
            for s in states
        ],
        ("STATE", "STAYS", "NOW_IN", "P50_S", "P95_S", "MAX_S"),
    )
    return 0


def cmd_steer(args: argparse.Namespace) -> int:
    if remote(args):
        # The API records the admin key as the operator, and runs the abandonment hook of its
        # own job kinds.
        row = api_client(args, admin=True).request(
            "POST", f"/v1/admin/jobs/{args.job_id}/{args.action}", json={"reason": args.reason}
        )
        _print_job(args, row)
        return 0
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
        raise CommandError(str(exc), exit_codes.for_domain_error(exc)) from exc
    _print_job(args, {k: v for k, v in row.items() if not k.startswith("_")})
    return 0


def _print_job(args: argparse.Namespace, row: dict[str, Any]) -> None:
    fmt = output_format(args)
    if fmt != "table":
        print_data(row, fmt)
    else:
        print(f"job {row['id']} is now {row['state']} (version {row['state_version']})")
