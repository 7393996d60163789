"""What the CLI's commands share: errors, settings flags with their environment variables, output."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from controlplane import db
from controlplane import settings as settings_module
from controlplane.db import AsyncConn
from controlplane.settings import Settings

T = TypeVar("T")


class CommandError(Exception):
    """A failure to report as one line on stderr with exit code 1."""


def add_settings_flags(parser: argparse.ArgumentParser, names: Sequence[str]) -> None:
    """Add --flag for each named setting (by its flat name); each defaults to its CONTROLPLANE_* variable."""
    for name in names:
        entry = settings_module.SETTINGS[name]
        default = entry.field.get_default(call_default_factory=True)
        parser.add_argument(
            entry.flag,
            dest=f"setting_{name}",
            type=entry.kind,
            default=None,
            help=f"(env {entry.env}, default {default!r})",
        )


def settings_from(args: argparse.Namespace) -> Settings:
    overrides = {
        key.removeprefix("setting_"): value
        for key, value in vars(args).items()
        if key.startswith("setting_") and value is not None
    }
    return settings_module.load(**overrides)


def _plain(value: Any) -> str:
    """What JSON does not have: bytes (hashes) as hex, the rest (times, ids) as text."""
    return value.hex() if isinstance(value, bytes) else str(value)


def print_json(value: Any) -> None:
    json.dump(value, sys.stdout, indent=2, default=_plain)
    sys.stdout.write("\n")


def print_table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> None:
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


def run_with_db(args: argparse.Namespace, work: Callable[[AsyncConn], Awaitable[T]]) -> T:
    """Run `work` on one connection to the database the flags and environment name."""
    url = db.resolve_database_url(settings_from(args))

    async def run() -> T:
        conn = await db.connect(url)
        async with conn:
            return await work(conn)

    return asyncio.run(run())
