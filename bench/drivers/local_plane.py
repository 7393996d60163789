"""The control plane the durability and failover drivers run: a worker and a reconciler loop in the
driver's process over one local provisioner, and the waits and reads both use."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from controlplane.core.kinds import PROVISION
from controlplane.db import connection as db
from controlplane.db import job_rows as jobs
from controlplane.db.instance_rows import create_instance
from controlplane.db.transitions import Actor
from controlplane.handlers import operations
from controlplane.queue.worker import Worker
from controlplane.runtime.secretbox import load_box
from controlplane.runtime.settings import Settings
from provisioners.base import ConnectionInfo
from provisioners.local import LocalProvisioner
from reconciler.reconciler import Reconciler

ACTOR = Actor("system", "bench")


class LocalControlPlane:
    """A worker and a reconciler loop in this process over one local provisioner, named `name`."""

    def __init__(self, settings: Settings, url: str, name: str) -> None:
        self.settings = settings
        self.name = name
        self.local = LocalProvisioner(settings)
        self.url = url

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[db.AsyncConn]:
        registry = operations.registry(self.local)
        pool = db.pool(self.url, min_size=2, max_size=12)
        await pool.open(wait=True)
        worker = Worker(self.name, self.settings, pool, registry)
        reconciler = Reconciler(self.settings, pool, self.local, reconciler_id=self.name)
        stop = asyncio.Event()
        tasks = [asyncio.create_task(worker.run()), asyncio.create_task(reconciler.run(stop))]
        conn = await db.connect(self.url)
        try:
            yield conn
        finally:
            stop.set()
            worker.request_stop()
            await asyncio.gather(*tasks, return_exceptions=True)
            await conn.close()
            await pool.close()
            await self.local.stop_all()

    async def ready_instance(self, conn: db.AsyncConn, org: uuid.UUID, name: str, plan: str) -> uuid.UUID:
        """A new instance of `plan`, provisioned by the worker."""
        async with conn.transaction():
            inst = await create_instance(conn, org, name, {"plan": plan}, ACTOR, deadline_s=600)
            await jobs.enqueue(conn, jobs.NewJob(PROVISION, inst["id"]), ACTOR)
        iid: uuid.UUID = inst["id"]
        await until(lambda: state_is(conn, iid, "ready"), f"{name} ready", 300)
        return iid

    async def credentials(self, conn: db.AsyncConn, iid: uuid.UUID) -> ConnectionInfo:
        row = await (
            await conn.execute("SELECT connection, secret FROM instances WHERE id = %s", (iid,))
        ).fetchone()
        assert row is not None
        password = load_box(self.settings).decrypt(bytes(row["secret"]))
        return ConnectionInfo.from_public(row["connection"], password)


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout_s}s: {what}")
        await asyncio.sleep(0.1)


async def state_is(conn: db.AsyncConn, iid: uuid.UUID, state: str) -> bool:
    row = await (
        await conn.execute("SELECT state, failure_reason FROM instances WHERE id = %s", (iid,))
    ).fetchone()
    if row is not None and row["state"] == "failed":
        raise RuntimeError(f"instance {iid} failed: {row['failure_reason']}")
    return row is not None and row["state"] == state
