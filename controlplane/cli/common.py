"""What the CLI's commands share: errors, settings flags with their environment variables, output
(table, JSON or YAML; one timestamp format; colour only on a terminal; cut cells end in an ellipsis)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from controlplane.cli.lazy import Parser
from controlplane.core import exit_codes

if TYPE_CHECKING:  # imported where used: `controlplane --help` needs no HTTP client, pydantic or psycopg
    from controlplane.cli.client import Api
    from controlplane.db.connection import AsyncConn
    from controlplane.runtime.settings import Settings

T = TypeVar("T")


def api_client(args: argparse.Namespace, *, need_key: bool = True, admin: bool = False) -> Api:
    """The REST API's client the flags, environment and profile name (`client.Api`, imported here)."""
    from controlplane.cli.client import Api

    return Api(args, need_key=need_key, admin=admin)


class CommandError(Exception):
    """A failure to report as one line on stderr, with its exit code (`controlplane.core.exit_codes`)."""

    def __init__(self, message: str, code: int = exit_codes.OTHER) -> None:
        super().__init__(message)
        self.code = code


def shown_default(value: Any) -> str:
    """A default as a user would type it: `.controlplane`, `8700`, `(none)`, never a repr."""
    if value is None or value == "":
        return "(none)"
    if hasattr(value, "get_secret_value"):  # a SecretStr
        return "(secret)" if value.get_secret_value() else "(none)"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple | list):
        return ",".join(str(v) for v in value) or "(none)"
    return str(value)


def add_settings_flags(parser: argparse.ArgumentParser, names: Sequence[str]) -> None:
    """Add --flag for each named setting (by its flat name); each defaults to its CONTROLPLANE_* variable.
    On a lazy Parser, once the command is used (the settings' model is not imported before)."""
    if isinstance(parser, Parser):
        parser.defer(lambda filled: _settings_flags(filled, names))
    else:
        _settings_flags(parser, names)


def _settings_flags(parser: argparse.ArgumentParser, names: Sequence[str]) -> None:
    from controlplane.runtime import settings as settings_module

    for name in names:
        entry = settings_module.SETTINGS[name]
        default = entry.field.get_default(call_default_factory=True)
        parser.add_argument(
            entry.flag,
            dest=f"setting_{name}",
            type=entry.kind,
            default=None,
            metavar=flag_metavar(name, entry.kind),
            help=f"{first_sentence(entry.field.description or '')} (env {entry.env}; default:"
            f" {shown_default(default)})",
        )


def flag_metavar(name: str, kind: type) -> str:
    """What a setting's flag takes, as --help shows it: SECONDS, N, PORT, PATH, URL, or its last word."""
    last = name.rsplit("_", 1)[-1]
    if kind is float and last == "s":
        return "SECONDS"
    if kind is Path:
        return "PATH"
    if last in ("port", "url"):
        return last.upper()
    return "N" if kind in (int, float) else last.upper()


def first_sentence(markdown: str) -> str:
    """The first sentence of a setting's description (docs/configuration.md), as plain text."""
    text = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", markdown).replace("`", "").replace("**", "")
    return re.split(r"(?<=[.;])\s+(?=[A-Z])", text, maxsplit=1)[0].rstrip(".")


def settings_from(args: argparse.Namespace) -> Settings:
    from controlplane.runtime import settings as settings_module

    overrides = {
        key.removeprefix("setting_"): value
        for key, value in vars(args).items()
        if key.startswith("setting_") and value is not None
    }
    return settings_module.load(**overrides)


OUTPUT_FORMATS = ("table", "json", "yaml")
# The widest a table's cell is printed; longer values end in ELLIPSIS (`-o json` has them whole).
MAX_CELL = 48
ELLIPSIS = "…"


def add_output_flag(parser: argparse.ArgumentParser) -> None:
    """-o/--output table|json|yaml (default: CONTROLPLANE_OUTPUT, else table); --json = -o json."""
    parser.add_argument(
        "-o",
        "--output",
        choices=OUTPUT_FORMATS,
        default=None,
        help="output format (env CONTROLPLANE_OUTPUT; default: table)",
    )
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)


def output_format(args: argparse.Namespace) -> str:
    if getattr(args, "json", False):
        return "json"
    chosen = getattr(args, "output", None) or os.environ.get("CONTROLPLANE_OUTPUT") or "table"
    if chosen not in OUTPUT_FORMATS:
        raise CommandError(
            f"CONTROLPLANE_OUTPUT must be one of {', '.join(OUTPUT_FORMATS)}, not {chosen!r}",
            exit_codes.USAGE,
        )
    return str(chosen)


def timestamp(value: datetime) -> str:
    """The one timestamp format of the CLI: RFC 3339 in UTC to the second, `2026-01-31T12:00:00Z`."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(\.\d+)?([+-]\d{2}:?\d{2}|Z)?")


def cell_text(value: Any) -> str:
    """A value as a table shows it: timestamps (datetimes, or RFC 3339 text) in the one format,
    lists joined with commas, whole numbers without a decimal point."""
    if value is None:
        return ""
    if isinstance(value, datetime):
        return timestamp(value)
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list | tuple):
        return ", ".join(cell_text(v) for v in value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    text = str(value)
    if _RFC3339.fullmatch(text):
        try:
            return timestamp(datetime.fromisoformat(text.replace("Z", "+00:00")))
        except ValueError:
            return text
    return text


def duration_text(seconds: float) -> str:
    """A duration as a person reads it: `42 s`, `5 min 3 s`, `3 h 25 min`, `7 d`, `2 d 3 h`."""
    whole = round(seconds)
    if whole < 60:
        return f"{seconds:.3g} s" if seconds < 10 and not float(seconds).is_integer() else f"{whole} s"
    units = (("d", 86400), ("h", 3600), ("min", 60), ("s", 1))
    parts = []
    for name, size in units:
        count, whole = divmod(whole, size)
        if count:
            parts.append(f"{count} {name}")
    return " ".join(parts[:2])


def field_text(name: str, value: Any) -> str:
    """A field's value in a `field value` table: `none` when unset, a duration (a name ending in
    `_s`) in words (with its seconds from a minute on), the rest as a table cell."""
    if value is None or value == []:
        return "none"
    if name.endswith("_s") and isinstance(value, int | float) and not isinstance(value, bool):
        words = duration_text(float(value))
        return words if value < 60 else f"{words} ({cell_text(float(round(value, 3)))} s)"
    return cell_text(value)


def print_fields(rows: Sequence[tuple[str, Any]], max_cell: int | None = MAX_CELL) -> None:
    """A `field value` table of one thing."""
    print_table(
        [(name, field_text(name, value)) for name, value in rows], ("field", "value"), max_cell=max_cell
    )


# ---- lists: their columns, --columns and --limit ----------------------------------------------------


@dataclass(frozen=True)
class Listing:
    """How a list is shown: its default columns in order, and `view`: the values an item shows
    besides its own fields (a derived column, or a field shown otherwise in a table). `--columns`
    picks among both; with `-o json|yaml` the picked fields are the item's own (raw) where it has
    them."""

    columns: tuple[str, ...]
    view: Callable[[dict[str, Any]], dict[str, Any]] = lambda item: {}
    state_column: str | None = None


def add_list_flags(parser: argparse.ArgumentParser, *, limit_default: int | None = None) -> None:
    """--columns (the fields to show, in order) and --limit (the first N items)."""
    parser.add_argument(
        "--columns",
        type=_column_names,
        default=None,
        metavar="NAME[,NAME]",
        help="the columns to show, in this order: any field of the items (-o json lists them);"
        " with -o json|yaml, only those fields",
    )
    shown = f"default: {limit_default}" if limit_default else "default: all"
    parser.add_argument(
        "--limit", type=positive_int, default=limit_default, metavar="N", help=f"the first N items ({shown})"
    )


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def _column_names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError("name at least one column")
    return names


def print_items(items: Sequence[dict[str, Any]], args: argparse.Namespace, listing: Listing) -> None:
    """A list as a table of its columns (`--columns`, else the listing's), or as JSON or YAML."""
    fmt = output_format(args)
    chosen: tuple[str, ...] | None = getattr(args, "columns", None)
    shown = [{**item, **listing.view(item)} for item in items]
    if chosen and shown:
        known = dict.fromkeys([*listing.columns, *shown[0]])
        unknown = [c for c in chosen if c not in known]
        if unknown:
            raise CommandError(
                f"no column {', '.join(unknown)}; the columns are {', '.join(known)}", exit_codes.USAGE
            )
    if fmt != "table":
        if chosen:
            print_data(
                [
                    {c: item[c] if c in item else view.get(c) for c in chosen}
                    for item, view in zip(items, shown, strict=True)
                ],
                fmt,
            )
        else:
            print_data(list(items), fmt)
        return
    columns = chosen or listing.columns
    state = listing.state_column if listing.state_column in columns else None
    print_table([[view.get(c) for c in columns] for view in shown], columns, state_column=state)


def _jsonable(value: Any) -> Any:
    """What JSON does not have: datetimes as RFC 3339, bytes (hashes) as hex, the rest (ids) as text."""
    if isinstance(value, datetime):
        return value.isoformat().replace("+00:00", "Z")
    return value.hex() if isinstance(value, bytes) else str(value)


def plain_data(value: Any) -> Any:
    """`value` as JSON would carry it (datetimes as RFC 3339 text, UUIDs as text)."""
    return json.loads(json.dumps(value, default=_jsonable))


def print_json(value: Any) -> None:
    json.dump(value, sys.stdout, indent=2, default=_jsonable)
    sys.stdout.write("\n")


def print_data(value: Any, fmt: str) -> None:
    """JSON or YAML of `value` (the API's field names and values, whole)."""
    if fmt == "yaml":
        import yaml

        sys.stdout.write(yaml.safe_dump(plain_data(value), sort_keys=False, allow_unicode=True))
        return
    print_json(value)


def colour_enabled() -> bool:
    """Colour only on a terminal, never with NO_COLOR set (https://no-color.org) or TERM=dumb."""
    if "NO_COLOR" in os.environ or os.environ.get("TERM") == "dumb":
        return False
    return sys.stdout.isatty()


# The colour of a state in a table: settled fine, transitional, needs attention.
_STATE_COLOURS = {
    "ready": "32",
    "failed": "31",
    "degraded": "33",
    "suspended": "33",
    "deleted": "2",
}


def coloured(text: str, state: str) -> str:
    code = _STATE_COLOURS.get(state, "36")
    return f"\033[{code}m{text}\033[0m"


def cut(text: str, width: int | None) -> str:
    if width is None or len(text) <= width:
        return text
    return text[: width - 1] + ELLIPSIS


def print_table(
    rows: Sequence[Sequence[Any]],
    headers: Sequence[str],
    *,
    max_cell: int | None = MAX_CELL,
    state_column: str | None = None,
) -> None:
    """Aligned columns; a cell longer than `max_cell` is cut with an ellipsis, never silently; the
    `state_column` coloured on a terminal."""
    head = [str(h) for h in headers]
    body = [[cut(cell_text(c), max_cell) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(headers))]
    colour_at = head.index(state_column) if state_column in head and colour_enabled() else None
    for index, row in enumerate([head, *body]):
        padded = [cell.ljust(width) for cell, width in zip(row, widths, strict=True)]
        if colour_at is not None and index > 0 and row[colour_at]:
            padded[colour_at] = coloured(padded[colour_at], row[colour_at].strip())
        print("  ".join(padded).rstrip())


def run_with_db(args: argparse.Namespace, work: Callable[[AsyncConn], Awaitable[T]]) -> T:
    """Run `work` on one connection to the database the flags and environment name."""
    import asyncio

    from controlplane.db import connection as db

    url = db.resolve_database_url(settings_from(args))

    async def run() -> T:
        conn = await db.connect(url)
        async with conn:
            return await work(conn)

    return asyncio.run(run())


def remote(args: argparse.Namespace) -> bool:
    """Whether an SRE command goes through the admin API (--url, --profile, CONTROLPLANE_URL or
    CONTROLPLANE_PROFILE given) rather than to the database directly."""
    return bool(
        getattr(args, "url", None)
        or getattr(args, "profile", None)
        or os.environ.get("CONTROLPLANE_URL")
        or os.environ.get("CONTROLPLANE_PROFILE")
    )


def add_remote_flags(parser: argparse.ArgumentParser) -> None:
    """--profile, --url and --api-key of an SRE command: through the admin API with any of them."""
    parser.add_argument(
        "--profile", default=None, help="through the API of this profile (env CONTROLPLANE_PROFILE)"
    )
    parser.add_argument(
        "--url", default=None, help="through the admin API at this URL (env CONTROLPLANE_URL)"
    )
    parser.add_argument(
        "--api-key", default=None, help="the admin key (env CONTROLPLANE_API_KEY; default: the profile's)"
    )
