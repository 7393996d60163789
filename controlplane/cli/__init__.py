"""The `controlplane` command: one parser, with sub-commands registered by the modules beside it."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Sequence

from controlplane.cli import account, common, customer_parser, jobs, orgs, server, shell, sre
from controlplane.core import exit_codes
from controlplane.core.refusals import DomainError
from controlplane.runtime.postgres import PostgresError
from controlplane.runtime.settings import NotAvailable, SettingsError

COMMAND_MODULES = (server, customer_parser, account, sre, jobs, orgs, shell)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="controlplane",
        description="Control plane for a managed PostgreSQL service: run it (up, serve, worker, "
        "reconcile, migrate), use it (instances, orgs, keys) and operate it (events, jobs, stuck, "
        "stats, audit).",
        epilog="exit codes: "
        + "; ".join(f"{code} {name}" for code, (name, _) in exit_codes.CODES.items())
        + "\nexample:\n  controlplane instances create orders --plan dev --wait",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMAND_MODULES:
        module.register(commands)
    return parser


def version() -> str:
    try:
        return importlib.metadata.version("controlplane")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.handler(args)
    except NotAvailable as exc:
        # Nothing wrong with the settings: what they point at is busy or down now.
        print(f"controlplane: error: {exc}", file=sys.stderr)
        return exit_codes.UNAVAILABLE
    except SettingsError as exc:
        # A setting that cannot be used: refused before anything starts, as a usage error.
        print(f"controlplane: error: {exc}", file=sys.stderr)
        return exit_codes.USAGE
    except common.CommandError as exc:
        print(f"controlplane: error: {exc}", file=sys.stderr)
        return exc.code
    except DomainError as exc:
        # A use case's refusal on a direct path (the database, not the API): its problem's code.
        print(f"controlplane: error: {exc}", file=sys.stderr)
        return exit_codes.for_domain_error(exc)
    except PostgresError as exc:
        print(f"controlplane: error: {exc}", file=sys.stderr)
        return exit_codes.OTHER
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        sys.stderr.close()
        return 0
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
