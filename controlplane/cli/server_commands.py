"""What the server roles do (`server.py` parses them): migrate, serve (API), worker, reconcile, up."""

from __future__ import annotations

import argparse
import asyncio
import atexit
import sys
from collections.abc import Awaitable, Callable

import provisioners
from controlplane.cli import process_roles
from controlplane.cli.common import CommandError, settings_from
from controlplane.db import connection as db
from controlplane.handlers import operations
from controlplane.runtime import aio, datadir, logs, metrics, tracing
from controlplane.runtime.settings import Settings
from provisioners.base import Provisioner


def _configured(args: argparse.Namespace, role: str, default_format: str = "json") -> Settings:
    """The settings of a serving process, and what it sets up once as it starts: its logs, its
    metrics (no `_created` series) and its tracing (`role` names it: controlplane-api, ...)."""
    settings = settings_from(args)
    logs.configure(settings.logging.level, settings.logging.format or default_format)
    metrics.configure_process()
    provider = tracing.configure(settings, f"controlplane-{role}")
    if provider is not None:
        atexit.register(provider.shutdown)  # sends the spans still batched
    for line in fault_warnings(settings):
        print(f"controlplane: warning: {line}", file=sys.stderr, flush=True)
    return settings


def fault_warnings(settings: Settings) -> list[str]:
    """One line per kind of fault injection switched on: a role started with faults says so first."""
    lines = []
    if settings.provisioner.faults:
        lines.append(
            f"fault injection is on: provisioning steps fail on purpose ({settings.provisioner.faults});"
            " for tests only (CONTROLPLANE_FAULTS, --faults)"
        )
    if settings.crash_points:
        lines.append(
            f"crash points are on: this process kills itself at {settings.crash_points};"
            " for tests only (CONTROLPLANE_CRASH_POINTS, --crash-points)"
        )
    return lines


def cmd_migrate(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    try:
        if settings.database.url_value or datadir.holder(settings.data_dir) is not None:
            target = db.migration_target(settings)  # the configured URLs, or the running `up`'s
            db.migrate(target.url, runtime_role=target.runtime_role)
        else:
            from controlplane.runtime.embedded import open_embedded

            # No `up` runs here: the embedded server is started for the migration only, under the lock.
            with datadir.held(settings.data_dir):
                embedded = open_embedded(settings.data_dir / "db", bindir=settings.database.pg_bindir)
                try:
                    target = db.migration_target(settings, embedded)
                    db.migrate(target.url, runtime_role=target.runtime_role)
                finally:
                    embedded.stop()
    except db.RoleError as exc:
        raise CommandError(str(exc)) from None
    print(f"database migrated to revision {db.head_revision()}")
    if target.runtime_role:
        print(f"runtime role {target.runtime_role}: SELECT and INSERT only on the audit log")
    else:
        print(
            "warning: one role for migrations and the services (CONTROLPLANE_MIGRATION_DATABASE_URL "
            "unset): it owns the tables and could rewrite the audit log (docs/deployment.md)",
            file=sys.stderr,
        )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    settings = _configured(args, "api")
    url = db.resolve_database_url(settings)
    # The API runs no job, so it needs no provisioner: only the instance operations' abandonment
    # hooks. The one whose CA it publishes (GET /v1/ca.pem) is built when first asked for, and
    # closed with the application.
    registry = operations.registry()

    async def run() -> None:
        stop = asyncio.Event()
        process_roles.stop_on_signals(stop)
        await process_roles.run_api(settings, url, registry, stop)

    aio.run(run())
    return 0


# A long-running role over the configured provisioner: (settings, database URL, provisioner, stop).
Role = Callable[[Settings, str, Provisioner, asyncio.Event], Awaitable[None]]


def _run_role(args: argparse.Namespace, role: Role, name: str) -> int:
    """Run `role` with its metrics served until a signal sets its stop; the provisioner is closed after."""
    settings = _configured(args, name)
    url = db.resolve_database_url(settings)

    async def run() -> None:
        provisioner = provisioners.build(settings)
        stop = asyncio.Event()
        process_roles.stop_on_signals(stop)
        process_roles.serve_metrics(settings, name)
        try:
            await role(settings, url, provisioner, stop)
        finally:
            await provisioner.close()

    aio.run(run())
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    async def worker(settings: Settings, url: str, provisioner: Provisioner, stop: asyncio.Event) -> None:
        await process_roles.run_worker_role(settings, url, operations.registry(provisioner), stop)

    return _run_role(args, worker, "worker")


def cmd_reconcile(args: argparse.Namespace) -> int:
    async def reconcile(settings: Settings, url: str, provisioner: Provisioner, stop: asyncio.Event) -> None:
        await process_roles.run_reconciler_role(
            settings,
            url,
            provisioner,
            operations.registry(provisioner),
            stop,
            once=args.once,
            dry_run_orphans=args.dry_run_orphans,
        )

    return _run_role(args, reconcile, "reconciler")


def cmd_up(args: argparse.Namespace) -> int:
    settings = _configured(args, "up", default_format="text")
    return aio.run(process_roles.up(settings, leave_instances_running=args.leave_instances_running))
