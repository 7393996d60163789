"""The `controlplane` command: one parser, with sub-commands registered by the modules beside it.

It starts fast (`lazy.py`): the modules registering commands import no framework, driver or HTTP
client; each command imports what it needs when it runs."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from controlplane.cli import account, common, customer_parser, jobs, orgs, server, shell, sre
from controlplane.cli.lazy import Parser
from controlplane.core import exit_codes

COMMAND_MODULES = (server, customer_parser, account, sre, jobs, orgs, shell)


class _Version(argparse.Action):
    """--version, its number looked up only when asked for (importlib.metadata is not free)."""

    def __init__(
        self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: object
    ) -> None:
        super().__init__(option_strings, dest, nargs=0, help="show the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        sys.stdout.write(f"{parser.prog} {version()}\n")
        parser.exit()


def build_parser(*, lazy: bool = False) -> Parser:
    """The whole command line; `lazy`: each command's settings flags added only once it is chosen."""
    parser = Parser(
        prog="controlplane",
        description="Control plane for a managed PostgreSQL service: run it (up, serve, worker, "
        "reconcile, migrate), use it (instances, orgs, keys) and operate it (events, jobs, stuck, "
        "stats, audit).",
        epilog="exit codes: "
        + "; ".join(f"{code} {name}" for code, (name, _) in exit_codes.CODES.items())
        + "\nexample:\n  controlplane instances create orders --plan dev --wait",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action=_Version)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMAND_MODULES:
        module.register(commands)
    if not lazy:
        parser.fill_all()
    return parser


def version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("controlplane")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def failure_code(exc: Exception) -> int | None:
    """The exit code of a failure reported as one line, None for a bug (its traceback is shown).
    The classes are imported here, once something failed: the command that ran imported them."""
    if isinstance(exc, common.CommandError):
        return exc.code
    from controlplane.core.refusals import DomainError
    from controlplane.runtime.postgres import PostgresError
    from controlplane.runtime.settings import NotAvailable, SettingsError

    if isinstance(exc, NotAvailable):
        # Nothing wrong with the settings: what they point at is busy or down now.
        return exit_codes.UNAVAILABLE
    if isinstance(exc, SettingsError):
        # A setting that cannot be used: refused before anything starts, as a usage error.
        return exit_codes.USAGE
    if isinstance(exc, DomainError):
        # A use case's refusal on a direct path (the database, not the API): its problem's code.
        return exit_codes.for_domain_error(exc)
    if isinstance(exc, PostgresError):
        return exit_codes.OTHER
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(lazy=True)
    args = parser.parse_args(argv)
    try:
        code = args.handler(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        sys.stderr.close()
        return 0
    except Exception as exc:
        failed = failure_code(exc)
        if failed is None:
            raise
        print(f"controlplane: error: {exc}", file=sys.stderr)
        return failed
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
