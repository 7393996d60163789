"""SRE commands that read the control plane's database directly: lifecycle, audit verify."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from controlplane import audit, db, lifecycle
from controlplane.cli.common import add_settings_flags, print_json, settings_from

DB_FLAGS = ("database_url", "data_dir")


def register(commands: Any) -> None:
    parser = commands.add_parser("lifecycle", help="print the instance and job lifecycle tables")
    parser.add_argument("--format", choices=("table", "json", "mermaid"), default="table")
    parser.set_defaults(handler=cmd_lifecycle)

    parser = commands.add_parser("audit", help="check the audit log against the current rows")
    audit_commands = parser.add_subparsers(dest="audit_command", metavar="ACTION", required=True)
    verify = audit_commands.add_parser(
        "verify", help="replay every event log; print mismatches; exit 1 if there is any"
    )
    add_settings_flags(verify, DB_FLAGS)
    verify.set_defaults(handler=cmd_audit_verify)


def cmd_lifecycle(args: argparse.Namespace) -> int:
    if args.format == "json":
        print_json({name: table.as_dict() for name, table in lifecycle.LIFECYCLES.items()})
        return 0
    for name, table in lifecycle.LIFECYCLES.items():
        if args.format == "mermaid":
            print(f"%% {name} lifecycle\n{table.mermaid()}\n")
            continue
        print(f"{name}: initial {table.initial}; terminal {', '.join(sorted(table.terminal))}")
        width = max(len(s) for s, _ in table.transitions)
        for (src, event), dst in table.transitions.items():
            print(f"  {src.ljust(width)}  --{event}-->  {dst}")
        print()
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
