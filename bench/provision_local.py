"""Create-to-ready time of the local provisioner through the real worker: p50 over N instances, one at a time.

Run: .venv/bin/python -m bench.provision_local [--instances 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from controlplane.core.kinds import DEPROVISION, PROVISION
from controlplane.db import connection as db
from controlplane.db import job_rows as jobs
from controlplane.db.instance_rows import create_instance
from controlplane.db.transitions import Actor
from controlplane.handlers import operations
from controlplane.queue.worker import Worker
from controlplane.runtime.embedded import FAST_SETTINGS, open_embedded
from controlplane.runtime.postgres import free_port
from controlplane.runtime.settings import Settings
from provisioners.local import LocalProvisioner

ACTOR = Actor("system", "bench")


async def wait_for(conn: db.AsyncConn, query: str, args: tuple[object, ...], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cursor = await conn.execute(query, args)
        if await cursor.fetchone():
            return
        await asyncio.sleep(0.01)
    raise TimeoutError(query)


async def measure(count: int, root: Path) -> list[float]:
    embedded = open_embedded(root / "db", FAST_SETTINGS)
    url = embedded.create_database("bench_provision")
    db.migrate(url)
    low = free_port()
    settings = Settings(
        database_url=url,
        data_dir=root / "data",
        local_port_min=30000 + low % 2000,
        local_port_max=30000 + low % 2000 + 50,
        poll_interval_s=0.05,
        heartbeat_interval_s=1.0,
    )
    local = LocalProvisioner(settings)
    registry = operations.registry(local)
    pool = db.pool(url, min_size=2, max_size=8)
    await pool.open(wait=True)
    worker = Worker("bench", settings, pool, registry)
    running = asyncio.create_task(worker.run())
    conn = await db.connect(url)
    org = await (
        await conn.execute("INSERT INTO organisations (name) VALUES ('bench') RETURNING id")
    ).fetchone()
    assert org is not None
    durations: list[float] = []
    try:
        for index in range(count):
            async with conn.transaction():
                inst = await create_instance(
                    conn, org["id"], f"bench-{index}", {"plan": "dev"}, ACTOR, deadline_s=600
                )
                await jobs.enqueue(conn, jobs.NewJob(PROVISION, inst["id"]), ACTOR)
            await wait_for(conn, "SELECT 1 FROM instances WHERE id = %s AND state = 'ready'", (inst["id"],))
            cursor = await conn.execute(
                "SELECT extract(epoch FROM e.at - i.created_at) AS s FROM instances i"
                " JOIN instance_events e ON e.instance_id = i.id AND e.to_state = 'ready' WHERE i.id = %s",
                (inst["id"],),
            )
            row = await cursor.fetchone()
            assert row is not None
            durations.append(float(row["s"]))
            print(f"instance {index + 1:2d}: create-to-ready {durations[-1]:.3f} s", flush=True)
            await jobs.enqueue(
                conn, jobs.NewJob(DEPROVISION, inst["id"], payload={"skip_final_backup": True}), ACTOR
            )
            await wait_for(conn, "SELECT 1 FROM instances WHERE id = %s AND state = 'deleted'", (inst["id"],))
    finally:
        worker.request_stop()
        await running
        await pool.close()
        await conn.close()
        embedded.stop()
    return durations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=10)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-provision-"))
    os.chmod(root, 0o755)
    try:
        durations = asyncio.run(measure(args.instances, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    quantiles = statistics.quantiles(durations, n=10) if len(durations) > 1 else durations
    print(
        f"local provisioner create-to-ready over {len(durations)} instances: "
        f"p50 {statistics.median(durations):.3f} s, p90 {quantiles[-1]:.3f} s, "
        f"min {min(durations):.3f} s, max {max(durations):.3f} s"
    )


if __name__ == "__main__":
    main()
