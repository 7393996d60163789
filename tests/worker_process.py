"""A worker process for fault tests: the worker role with the test job kinds, settings from flags."""

from __future__ import annotations

import argparse
import asyncio
import sys

from controlplane.cli import process_roles
from controlplane.runtime import logs
from controlplane.runtime.settings import Settings
from tests.queue_kinds import build_registry


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--worker-id", required=True)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--heartbeat-interval", type=float, default=0.2)
    parser.add_argument("--poll-interval", type=float, default=0.5)
    parser.add_argument("--shutdown-grace", type=float, default=1.0)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args()
    logs.configure(args.log_level, "json")
    settings = Settings(
        database_url=args.database_url,
        worker_id=args.worker_id,
        worker_concurrency=args.concurrency,
        heartbeat_interval_s=args.heartbeat_interval,
        poll_interval_s=args.poll_interval,
        shutdown_grace_s=args.shutdown_grace,
    )
    asyncio.run(run(settings, args.database_url))
    return 0


async def run(settings: Settings, url: str) -> None:
    """The worker role until SIGTERM or SIGINT, as `controlplane worker` runs it."""
    stop = asyncio.Event()
    process_roles.stop_on_signals(stop)
    await process_roles.run_worker_role(settings, url, build_registry(), stop)


if __name__ == "__main__":
    sys.exit(main())
