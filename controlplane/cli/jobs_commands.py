"""What the `controlplane jobs` commands do (`jobs.py` parses them), and `stats dwell`."""

from __future__ import annotations

import argparse
import getpass
from typing import Any

from controlplane.audit import dwell
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
)
from controlplane.cli.render import actor_text
from controlplane.core import exit_codes
from controlplane.db.connection import AsyncConn
from controlplane.queue import moves as queue
from controlplane.queue.registry import JobRegistry


def _seconds(value: float) -> str:
    return f"{value:.3f}"


JOBS = Listing(
    ("id", "kind", "state", "attempt", "priority", "run_at", "claimed_by", "fence", "last_error"),
    lambda j: {"attempt": f"{j['attempt']}/{j['max_attempts']}", "last_error": j.get("last_error") or ""},
    state_column="state",
)
JOB_EVENTS = Listing(
    ("at", "from", "to", "event", "actor", "reason"),
    lambda e: {"from": e.get("from_state") or "", "to": e["to_state"], "actor": actor_text(e)},
    state_column="to",
)


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
    print_items([dict(r) for r in rows], args, JOBS)
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    if remote(args):
        rows = api_client(args, admin=True).request("GET", f"/v1/admin/jobs/{args.job_id}")["items"]
    else:
        rows = run_with_db(args, lambda conn: queue.job_events(conn, args.job_id))
        if not rows:
            raise CommandError(f"no job {args.job_id}", exit_codes.NOT_FOUND)
    print_items([dict(r) for r in rows][: args.limit], args, JOB_EVENTS)
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
        ("state", "stays", "now_in", "p50_s", "p95_s", "max_s"),
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
        # The instance job kinds: their abandonment hooks fail or degrade the instance (no
        # provisioner needed).
        from controlplane.handlers import operations

        registry = operations.registry()

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
