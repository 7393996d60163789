"""Organisation commands: `controlplane orgs create NAME` straight against the database."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from controlplane import db, tenants
from controlplane.cli.common import CommandError, add_settings_flags, print_json, settings_from

DB_FLAGS = ("database_url", "data_dir")


def register(commands: Any) -> None:
    parser = commands.add_parser("orgs", help="manage organisations (direct database access)")
    actions = parser.add_subparsers(dest="orgs_command", metavar="ACTION", required=True)
    create = actions.add_parser("create", help="create an organisation and print its first API key once")
    create.add_argument("name")
    create.add_argument("--stripe-customer", default=None, metavar="ID", help="Stripe customer id (cus_...)")
    create.add_argument("--json", action="store_true", help="machine-readable output")
    add_settings_flags(create, DB_FLAGS)
    create.set_defaults(handler=cmd_create)


def cmd_create(args: argparse.Namespace) -> int:
    url = db.resolve_database_url(settings_from(args))

    async def run() -> tuple[Any, tenants.NewKey]:
        conn = await db.connect(url)
        async with conn:
            return await tenants.create_org(conn, args.name, args.stripe_customer)

    try:
        org, key = asyncio.run(run())
    except tenants.OrgExists as exc:
        raise CommandError(str(exc)) from None
    if args.json:
        print_json({"org": {"id": org["id"], "name": org["name"]}, "key": key.plaintext})
        return 0
    print(f"organisation {org['name']} created: {org['id']}")
    print(f"API key (shown once, keep it safe): {key.plaintext}")
    return 0
