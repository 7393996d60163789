"""Server roles: migrate, and `up` (everything in one process on the embedded default)."""

from __future__ import annotations

import argparse
from typing import Any

from controlplane import db
from controlplane.cli.common import add_settings_flags, settings_from


def register(commands: Any) -> None:
    parser = commands.add_parser("migrate", help="bring the database schema to the latest revision")
    add_settings_flags(parser, ("database_url", "data_dir"))
    parser.set_defaults(handler=cmd_migrate)


def cmd_migrate(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    url = db.resolve_database_url(settings)
    db.migrate(url)
    print(f"database migrated to revision {db.head_revision()}")
    return 0
