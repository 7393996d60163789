"""The `controlplane` command: one parser, with sub-commands registered by the modules beside it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from controlplane.cli import account, common, customer, jobs, orgs, server, sre
from controlplane.postgres import PostgresError
from controlplane.settings import NotAvailable, SettingsError

COMMAND_MODULES = (server, customer, account, sre, jobs, orgs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="controlplane",
        description="Control plane for a managed PostgreSQL service.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMAND_MODULES:
        module.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.handler(args)
    except NotAvailable as exc:
        # Nothing wrong with the settings: what they point at is busy or down now.
        print(f"controlplane: error: {exc}", file=sys.stderr)
        return 1
    except SettingsError as exc:
        # A setting that cannot be used: refused before anything starts, as a usage error.
        print(f"controlplane: error: {exc}", file=sys.stderr)
        return 2
    except (common.CommandError, PostgresError) as exc:
        print(f"controlplane: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        sys.stderr.close()
        return 0
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
