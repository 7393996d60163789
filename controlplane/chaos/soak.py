"""The chaos soak: the whole control plane as real processes under a steady mixed workload, while
its processes, its own PostgreSQL and its customers' servers (an HA instance's primary, standby
and pooler too) are killed at random.

Layout: an embedded PostgreSQL (durable settings), `controlplane serve` (A of them),
`controlplane worker` (W) and `controlplane reconcile` (R) on the local provisioner, all on one
data directory. The soak plays the platform's supervisor too (systemd's `Restart=always`, a
Deployment): a killed process is started again a second later, the killed PostgreSQL by
`embedded.keep_running`. Clients retry what failed with the same request (and Idempotency-Key)
until they get an answer, as a real client does; what they were answered is the ledger the end
state is checked against (`controlplane.chaos.plan.violations`). Around each HA fault a writer
commits rows through the instance's pooled endpoint, every acknowledged one to be read back after
(`plan.acknowledged_row_violations`); throughout, a watcher samples every HA server for two
writable primaries at once (`plan.double_primary_findings`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
from cryptography.fernet import Fernet

from controlplane.audit import verify as audit
from controlplane.chaos import plan
from controlplane.core import plans
from controlplane.db import connection as db
from controlplane.runtime.embedded import SERVER_SETTINGS, EmbeddedDatabase, keep_running, open_embedded
from controlplane.runtime.logs import first_line
from controlplane.runtime.postgres import free_port, postmaster_pid
from controlplane.runtime.secretbox import load_box
from controlplane.runtime.settings import Settings
from controlplane.services import tenants
from provisioners.base import ConnectionInfo
from provisioners.local import LocalProvisioner
from provisioners.local.network import owner_of
from provisioners.local.replication import member_name
from reconciler.leader import RECONCILER_LOCK_KEY

log = logging.getLogger("controlplane.chaos")

WEBHOOK_SECRET = "whsec_chaos_" + "0" * 24
RECOVERY_BOUND_S = 180.0
RESTART_AFTER_S = 1.0
PROBE_INTERVAL_S = 0.25
# How long a fault still owed after the schedule's last turn is waited for (Faults.inject_all).
DEFAULT_TARGET_WAIT_S = 15.0
TARGET_WAIT_S = {
    # A ready instance with a backup: one is spared and backed up for it
    # (Faults.keep_a_target_backed_up), which takes a backup's time, not a process's restart.
    plan.DATA_DIRECTORY: 60.0,
    # A ready, fully redundant HA instance no other fault is using: one may be recovering from the
    # last HA fault (a failover rebuilds the old primary as a standby). The single server's fault
    # waits as long: its kept instance may be healing from the last one, or held.
    **dict.fromkeys(plan.HA_FAULT_KINDS | {plan.CUSTOMER_SERVER}, 45.0),
}
SETTLED_FOR_S = 5.0
ANSWER_TIMEOUT_S = 10.0
PLANS = ("dev", "small")
HA_PLAN = "small"  # a primary, a synchronous standby, a pooler
# The workload's first creates (plan, kept): the faults on a customer's servers find targets from
# the soak's start; those kept the workload never resizes nor deletes (it churns through the
# others before they are long ready, and may leave no single-server one ready for a while). The
# data directory fault takes no kept one: it would take the single server again and again, each
# loss a restore that the workers' faults may see given up.
FIRST_CREATES = ((HA_PLAN, True), (HA_PLAN, False), ("dev", True))


@dataclass
class Options:
    minutes: float = 2.0
    seed: int = 1
    apis: int = 2
    workers: int = 2
    reconcilers: int = 2
    max_instances: int = 6
    orgs: int = 2
    min_interval_s: float = 5.0
    max_interval_s: float = 40.0
    converge_timeout_s: float = 300.0
    out: Path | None = None  # where the report goes (<out>.md and <out>.json)
    root: Path | None = None  # a scratch directory by default (removed after)
    pg_bindir: Path | None = None
    kinds: tuple[str, ...] = plan.FAULT_KINDS  # the faults injected (a targeted soak: some of them)


@dataclass
class Proc:
    """One supervised process of the control plane."""

    role: str  # api, worker, reconciler
    index: int
    args: list[str]  # the `controlplane` command line (a worker gets its id per incarnation)
    env: dict[str, str]
    log_dir: Path
    incarnation: int = 0
    popen: subprocess.Popen[bytes] | None = None
    port: int | None = None
    killed_at: float | None = None

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def worker_id(self) -> str:
        return f"chaos-{self.name}.{self.incarnation}"

    def start(self) -> None:
        self.incarnation += 1
        logfile = (self.log_dir / f"{self.name}.log").open("ab")
        with logfile:
            extra = ["--worker-id", self.worker_id] if self.role == "worker" else []
            self.popen = subprocess.Popen(
                _cli(*self.args, *extra),
                env=self.env,
                stdout=logfile,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.killed_at = None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGKILL)
            self.popen.wait()
        self.killed_at = time.monotonic()

    def stop(self, grace_s: float = 10.0) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


@dataclass
class Org:
    id: str
    key: str
    customer: str
    event_clock: int = 0


@dataclass
class Cluster:
    root: Path
    database: EmbeddedDatabase
    url: str
    settings: Settings
    procs: list[Proc]
    orgs: list[Org]
    admin_key: str
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    # Instances the workload neither resizes nor deletes, nor puts on a billing hold, for now (a
    # fault is making ready to remove its data directory, or looking at what comes back).
    spared: set[str] = field(default_factory=set)
    # Instances a workload request is resizing or deleting right now (its answer not yet in): no
    # fault that must see a member come back takes one (a resize to a single server removes it).
    changing: set[str] = field(default_factory=set)
    # Instances the workload never resizes nor deletes (billing may still suspend them): an HA
    # instance and a single-server one that stay so, for the faults on a customer's servers.
    kept: set[str] = field(default_factory=set)

    def of(self, role: str) -> list[Proc]:
        return [p for p in self.procs if p.role == role]

    @property
    def api_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p.port}" for p in self.of("api")]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "controlplane.cli", *args]


# The customer servers' ports come from below the kernel's ephemeral range (where `free_port`, and
# so the soak's own API and database ports, come from), in a block free when the soak starts.
INSTANCE_PORTS_FROM, INSTANCE_PORTS_TO = 20000, 32000


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _instance_ports(count: int) -> int:
    """The first of `count` ports, all free now, none of which the kernel hands out on its own."""
    picker = random.Random()  # noqa: S311 (a port, not a secret; apart from the seeded schedule)
    for _ in range(200):
        first = picker.randrange(INSTANCE_PORTS_FROM, INSTANCE_PORTS_TO - count)
        if all(_port_free(port) for port in range(first, first + count)):
            return first
    raise RuntimeError(f"no {count} free ports between {INSTANCE_PORTS_FROM} and {INSTANCE_PORTS_TO}")


def _environment(root: Path, url: str, options: Options) -> tuple[dict[str, str], Settings]:
    port_min = _instance_ports(4 * options.max_instances + 21)
    values = {
        "database_url": url,
        "data_dir": str(root / "data"),
        "provisioner": "local",
        "local_port_min": str(port_min),
        "local_port_max": str(port_min + 4 * options.max_instances + 20),
        "stripe_webhook_secret": WEBHOOK_SECRET,
        "secret_key": Fernet.generate_key().decode(),
        "heartbeat_interval_s": "1",
        "reconcile_interval_s": "1",
        "retry_base_delay_s": "0.5",
        "retry_max_delay_s": "4",
        "job_max_attempts": "10",
        "shutdown_grace_s": "3",
        "deadline_pending_s": "60",
        "deadline_provisioning_s": "120",
        "deadline_updating_s": "120",
        "deadline_deprovisioning_s": "120",
        "heal_backoff_base_s": "2",
        "heal_backoff_max_s": "10",
        "local_archive_timeout_s": str(int(ARCHIVE_TIMEOUT_S)),
        "log_format": "text",
    }
    if options.pg_bindir is not None:
        values["pg_bindir"] = str(options.pg_bindir)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONTROLPLANE_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update({f"CONTROLPLANE_{k.upper()}": v for k, v in values.items()})
    settings = Settings(
        database_url=url,
        data_dir=root / "data",
        provisioner="local",
        local_port_min=port_min,
        local_port_max=port_min + 4 * options.max_instances + 20,
        secret_key=values["secret_key"],
        pg_bindir=options.pg_bindir,
        local_archive_timeout_s=ARCHIVE_TIMEOUT_S,
    )
    return env, settings


async def _bootstrap(url: str, options: Options) -> tuple[list[Org], str]:
    conn = await db.connect(url)
    async with conn:
        orgs = []
        for n in range(options.orgs):
            customer = f"cus_chaos_{n}"
            org, key = await tenants.create_org(conn, f"chaos-{n}", stripe_customer_id=customer)
            orgs.append(Org(str(org["id"]), key.plaintext, customer))
        admin = await tenants.create_admin_key(conn, "chaos")
    return orgs, admin.plaintext


def start_cluster(options: Options, root: Path) -> Cluster:
    (root / "logs").mkdir(parents=True, exist_ok=True)
    (root / "data").mkdir(exist_ok=True)
    database = open_embedded(root / "db", SERVER_SETTINGS, bindir=options.pg_bindir)
    url = database.create_database()
    db.migrate(url)
    env, settings = _environment(root, url, options)
    orgs, admin_key = asyncio.run(_bootstrap(url, options))
    procs: list[Proc] = []
    logs = root / "logs"
    for i in range(options.apis):
        port = free_port()
        procs.append(Proc("api", i, ["serve", "--api-port", str(port)], env, logs, port=port))
    procs += [Proc("worker", i, ["worker"], env, logs) for i in range(options.workers)]
    procs += [Proc("reconciler", i, ["reconcile"], env, logs) for i in range(options.reconcilers)]
    for proc in procs:
        proc.start()
    return Cluster(root, database, url, settings, procs, orgs, admin_key)


# ---------------------------------------------------------------------------------------------
# The workload: a few clients, each a loop of mixed operations, answered or retried.


class Workload:
    def __init__(self, cluster: Cluster, rng: random.Random, report: plan.Report, options: Options) -> None:
        self.cluster = cluster
        self.rng = rng
        self.report = report
        self.options = options
        self.ledger = plan.Ledger()
        self.live: dict[str, Org] = {}  # instance id → its organisation (not yet asked to delete)
        self.names = itertools.count()
        self.http = httpx.AsyncClient(timeout=ANSWER_TIMEOUT_S)
        servers = plan.HA_FAULT_KINDS | {plan.CUSTOMER_SERVER}
        self.first = list(FIRST_CREATES) if servers & set(options.kinds) else []

    def _base(self) -> str:
        return self.rng.choice(self.cluster.api_urls)

    async def request(
        self,
        op: str,
        method: str,
        path: str,
        headers: dict[str, str],
        body: Any = None,
        content: bytes | None = None,
    ) -> httpx.Response | None:
        """Send until answered with something other than a 5xx, a busy 409 or no answer at all
        (another API process takes the retry); None if the soak ends first."""
        self.report.attempted[op] += 1
        delay = 0.2
        while True:
            try:
                response = await self.http.request(
                    method, self._base() + path, headers=headers, json=body, content=content
                )
            except httpx.HTTPError:
                response = None
            busy = response is not None and response.status_code == 409 and _retryable(response)
            if response is not None and response.status_code < 500 and not busy:
                if response.is_success:
                    self.report.completed[op] += 1
                else:
                    self.report.refused[op] += 1
                return response
            # What the soak must see through even as it ends: a request that changes the instances,
            # and the resume of a job it paused (else the job would wait for an operator forever).
            if self.cluster.stop.is_set() and op not in {"create", "delete", "resize", "billing", "resume"}:
                return None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def _current(self, iid: str, org: Org) -> dict[str, Any] | None:
        """The instance as it is now (after an answer that may hide an earlier attempt's effect)."""
        response = await self.request("read", "GET", f"/v1/instances/{iid}", self._org_headers(org))
        if response is not None and response.status_code == 404:
            return {"state": "deleted", "plan": None}  # gone from the customer's view
        return None if response is None or not response.is_success else dict(response.json())

    def _org_headers(self, org: Org) -> dict[str, str]:
        return {"Authorization": f"Bearer {org.key}"}

    async def create(self) -> None:
        org = self.rng.choice(self.cluster.orgs)
        key = str(uuid.uuid4())
        plan_name, keep = self.first.pop(0) if self.first else (self.rng.choice(PLANS), False)
        headers = {**self._org_headers(org), "Idempotency-Key": key}
        body = {"name": f"soak-{next(self.names)}", "plan": plan_name}
        response = await self.request("create", "POST", "/v1/instances", headers, body)
        if response is not None and response.is_success:
            iid = response.json()["id"]
            self.ledger.creates[key] = iid
            self.ledger.plans[iid] = plan_name
            self.live[iid] = org
            if keep:
                self.cluster.kept.add(iid)

    async def resize(self, iid: str, org: Org) -> None:
        plan_name = self.rng.choice(PLANS)
        response = await self.request(
            "resize", "PATCH", f"/v1/instances/{iid}", self._org_headers(org), {"plan": plan_name}
        )
        if response is not None and response.is_success:
            self.ledger.plans[iid] = plan_name
        elif response is not None:
            # Refused now; an earlier attempt whose answer was lost (its API killed) may have won.
            current = await self._current(iid, org)
            if current is not None and current["plan"] == plan_name:
                self.ledger.plans[iid] = plan_name

    async def delete(self, iid: str, org: Org) -> None:
        self.live.pop(iid, None)
        response = await self.request("delete", "DELETE", f"/v1/instances/{iid}", self._org_headers(org))
        if response is not None and response.is_success:
            self.ledger.deletes.add(iid)
            return
        current = await self._current(iid, org) if response is not None else None
        if current is not None and current["state"] in {"deprovisioning", "deleted"}:
            self.ledger.deletes.add(iid)  # an earlier attempt whose answer was lost took effect
        else:
            self.live[iid] = org  # refused (not deletable in its state right now): it stays ours

    async def billing(self, org: Org, hold: bool) -> None:
        org.event_clock += 1
        created = org.event_clock
        event_id = f"evt_chaos_{org.customer}_{created}"
        status = "unpaid" if hold else "active"
        payload = json.dumps(
            {
                "id": event_id,
                "object": "event",
                "type": "customer.subscription.updated",
                "created": created,
                "data": {
                    "object": {
                        "id": f"sub_{org.customer}",
                        "object": "subscription",
                        "customer": org.customer,
                        "status": status,
                    }
                },
            }
        ).encode()
        # Stripe delivers at least once: a retried delivery is a new signature over the same body.
        while True:
            headers = {"Content-Type": "application/json", "Stripe-Signature": sign(payload, WEBHOOK_SECRET)}
            response = await self.request("billing", "POST", "/v1/webhooks/stripe", headers, content=payload)
            if response is None or response.status_code != 400:
                break
        if response is not None and response.is_success:
            self.ledger.webhook_deliveries[event_id] += 1
            newest = self.ledger.billing.get(org.id)
            if newest is None or newest[0] < created:
                self.ledger.billing[org.id] = (created, hold)

    async def operator(self) -> None:
        """Pause a running job and resume it a moment later, or retry a failed one now."""
        admin = {"Authorization": f"Bearer {self.cluster.admin_key}"}
        if self.rng.random() < 0.5:
            found = await self.request("operator_list", "GET", "/v1/admin/jobs?state=running", admin)
            items = [] if found is None or not found.is_success else found.json()["items"]
            if not items:
                return
            job = self.rng.choice(items)
            await self.request(
                "pause", "POST", f"/v1/admin/jobs/{job['id']}/pause", admin, {"reason": "chaos soak: pause"}
            )
            # Resumed whatever the pause's answer: a refusal, or none as the soak ends, may follow an
            # attempt whose answer was lost (the API killed after its commit) and the job be paused.
            await asyncio.sleep(self.rng.uniform(0.5, 3))
            await self.request(
                "resume",
                "POST",
                f"/v1/admin/jobs/{job['id']}/resume",
                admin,
                {"reason": "chaos soak: resume"},
            )
        else:
            found = await self.request("operator_list", "GET", "/v1/admin/jobs?state=failed", admin)
            items = [] if found is None or not found.is_success else found.json()["items"]
            if items:
                job = self.rng.choice(items)
                await self.request(
                    "retry",
                    "POST",
                    f"/v1/admin/jobs/{job['id']}/retry",
                    admin,
                    {"reason": "chaos soak: retry"},
                )

    async def _room(self) -> bool:
        """Whether fewer than max_instances instances exist that are not yet gone: one whose
        deletion was accepted still holds a server until its deprovision has run (after its
        provisioning, if it was still pending), so the clients' own count is not enough."""
        try:
            rows = await _query(
                self.cluster.url,
                "SELECT count(*) AS n FROM instances WHERE state NOT IN ('deleted', 'failed')",
            )
        except (psycopg.Error, OSError):
            return False  # the database is away: create later
        return int(rows[0]["n"]) < self.options.max_instances

    async def step(self) -> None:
        choices: list[tuple[str, float]] = [("billing", 1), ("operator", 1)]
        if len(self.live) < self.options.max_instances and await self._room():
            choices.append(("create", 3))
        if self.live:
            choices += [("resize", 2), ("delete", 1 if len(self.live) > 1 else 0.2)]
        what = self.rng.choices([c for c, _ in choices], [w for _, w in choices])[0]
        if what == "create":
            await self.create()
        elif what in {"resize", "delete"}:
            deletable = sorted(set(self.live) - self.cluster.spared - self.cluster.kept)
            if not deletable:
                return
            iid = self.rng.choice(deletable)
            self.cluster.changing.add(iid)
            try:
                await (self.resize if what == "resize" else self.delete)(iid, self.live[iid])
            finally:
                self.cluster.changing.discard(iid)
        elif what == "billing":
            org = self.rng.choice(self.cluster.orgs)
            held = self.ledger.billing.get(org.id, (0, False))[1]
            sparing = {self.live[i].id for i in self.cluster.spared if i in self.live}
            if not held and org.id in sparing:
                return  # an instance of it is spared (a fault needs it writable): no hold for now
            await self.billing(org, hold=not held)
        else:
            await self.operator()

    async def client(self) -> None:
        while not self.cluster.stop.is_set():
            await self.step()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.rng.uniform(0.5, 2.0)):
                    await self.cluster.stop.wait()

    async def close(self) -> None:
        await self.http.aclose()


def _retryable(response: httpx.Response) -> bool:
    """A 409 that asks to come back (a busy row, the same Idempotency-Key still in flight)."""
    try:
        kind = str(response.json().get("type", ""))
    except ValueError:
        return False
    return kind.endswith((":busy", ":idempotency-in-flight"))


def sign(payload: bytes, secret: str, timestamp: int | None = None) -> str:
    """A Stripe-Signature header over `payload` (what Stripe sends)."""
    import hashlib
    import hmac

    ts = int(time.time()) if timestamp is None else timestamp
    digest = hmac.new(secret.encode(), f"{ts}.".encode() + payload, hashlib.sha256).hexdigest()
    return f"t={ts},v1={digest}"


# ---------------------------------------------------------------------------------------------
# The faults, and how each one's recovery is seen.


async def _query(url: str, statement: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    conn = await db.connect(url)
    async with conn:
        cursor = await conn.execute(statement, params or {})
        return [dict(r) for r in await cursor.fetchall()]


async def _ready(http: httpx.AsyncClient, base: str) -> bool:
    try:
        return (await http.get(base + "/readyz", timeout=2)).status_code == 200
    except httpx.HTTPError:
        return False


def _socket_inodes(pid: int) -> set[str]:
    found = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    found.add(target[8:-1])
    return found


def _inode_of_local_port(port: int) -> str | None:
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port:
                    return fields[9]
    return None


async def leader(cluster: Cluster) -> Proc | None:
    """The reconciler process whose connection holds the leader lock (found by its socket)."""
    rows = await _query(
        cluster.url,
        "SELECT a.client_port FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
        " WHERE l.locktype = 'advisory' AND l.granted"
        " AND ((l.classid::bigint << 32) | l.objid::bigint) = %(key)s",
        {"key": RECONCILER_LOCK_KEY},
    )
    if not rows or rows[0]["client_port"] is None:
        return None
    inode = _inode_of_local_port(int(rows[0]["client_port"]))
    for proc in cluster.of("reconciler"):
        if proc.alive() and proc.popen is not None and inode in _socket_inodes(proc.popen.pid):
            return proc
    return None


class Faults:
    def __init__(self, cluster: Cluster, rng: random.Random, report: plan.Report) -> None:
        self.cluster = cluster
        self.rng = rng
        self.report = report
        self.http = httpx.AsyncClient()
        self.recoveries: list[asyncio.Task[None]] = []
        self.started = time.monotonic()
        # The instance spared from the workload for its first backup (the data directory fault's).
        self.backing_up: str | None = None
        # What is done once a fault recovered (or did not in time): an HA fault's writer stopped
        # and its rows read back. By the fault's target.
        self.after_recovery: dict[str, Callable[[], Awaitable[None]]] = {}
        # Instances an HA fault's writer is writing to, and those whose data directory is being
        # removed: neither fault takes the other's meanwhile.
        self.probed: set[str] = set()
        self.removing: set[str] = set()

    async def inject(self, kind: str, patience_s: float = 0.0) -> bool:
        """Kill a `kind`, looking for a target for up to `patience_s` (once for 0); False when
        none was found."""
        at = round(time.monotonic() - self.started, 1)
        injected = await self._target(kind)
        waited = time.monotonic()
        while injected is None and time.monotonic() - waited < patience_s:
            await asyncio.sleep(1)  # nothing to kill yet (no ready instance, no leader elected)
            injected = await self._target(kind)
        if injected is None:
            return False
        target, recovered = injected
        began = time.monotonic()
        log.warning("chaos: %s killed: %s", kind, target)
        record = plan.FaultRecord(kind, at, target, None)
        self.report.faults.append(record)

        async def watch() -> None:
            deadline = began + RECOVERY_BOUND_S
            try:
                while time.monotonic() < deadline:
                    with contextlib.suppress(Exception):
                        if await recovered():
                            record.recovery_s = round(time.monotonic() - began, 2)
                            log.info("chaos: %s %s recovered in %.1fs", kind, target, record.recovery_s)
                            return
                    await asyncio.sleep(PROBE_INTERVAL_S)
                log.error("chaos: %s %s not recovered within %.0fs", kind, target, RECOVERY_BOUND_S)
            finally:
                finish = self.after_recovery.pop(target, None)
                if finish is not None:
                    await finish()  # the writer of an HA fault stopped, its rows read back

        self.recoveries.append(asyncio.create_task(watch()))
        return True

    async def inject_all(self, schedule: list[plan.Fault]) -> None:
        """Inject the faults of `schedule` at their times. A fault whose turn finds no target is
        owed: looked for again at every later turn, and waited for after the last one (its kind's
        patience) before it counts as skipped. A short soak thus injects every kind even when the
        workload and earlier faults leave one without a target for a while."""
        owed: list[str] = []
        for fault in schedule:
            await asyncio.sleep(max(0.0, fault.at_s - (time.monotonic() - self.started)))
            still: list[str] = []
            for kind in owed:
                if await self.inject(kind):
                    self.report.deferred[kind] += 1
                else:
                    still.append(kind)
            if not await self.inject(fault.kind):
                log.info("chaos: no target for %s on its turn; owed", fault.kind)
                still.append(fault.kind)
            owed = still
        for kind in owed:
            if await self.inject(kind, TARGET_WAIT_S.get(kind, DEFAULT_TARGET_WAIT_S)):
                self.report.deferred[kind] += 1
            else:
                log.info("chaos: no target for %s by the end of the faults; skipped", kind)
                self.report.skipped[kind] += 1

    async def _target(self, kind: str) -> tuple[str, Callable[[], Awaitable[bool]]] | None:
        """Kill a `kind` and say how its recovery is seen; None when there is no target now (the
        lookup itself may need the database, which an earlier fault may still hold down)."""
        try:
            found: tuple[str, Callable[[], Awaitable[bool]]] | None = await getattr(self, f"_{kind}")()
        except (psycopg.Error, OSError) as exc:
            log.info("chaos: cannot look for a %s to kill yet (%s)", kind, first_line(exc))
            return None
        return found

    async def _worker(self) -> tuple[str, Callable[[], Awaitable[bool]]] | None:
        alive = [p for p in self.cluster.of("worker") if p.alive()]
        if not alive:
            return None
        proc = self.rng.choice(alive)
        gone = proc.worker_id
        proc.kill()

        async def recovered() -> bool:  # its jobs reclaimed (or finished), a new worker running
            held = await _query(
                self.cluster.url,
                "SELECT count(*) AS n FROM jobs WHERE claimed_by = %(w)s AND state IN ('claimed', 'running')",
                {"w": gone},
            )
            return proc.alive() and held[0]["n"] == 0

        return gone, recovered

    async def _reconciler_leader(self) -> tuple[str, Callable[[], Awaitable[bool]]] | None:
        proc = await leader(self.cluster)
        if proc is None:
            return None
        proc.kill()

        async def recovered() -> bool:
            now = await leader(self.cluster)
            return now is not None

        return proc.name, recovered

    async def _api(self) -> tuple[str, Callable[[], Awaitable[bool]]] | None:
        alive = [p for p in self.cluster.of("api") if p.alive()]
        if not alive:
            return None
        proc = self.rng.choice(alive)
        proc.kill()
        base = f"http://127.0.0.1:{proc.port}"

        async def recovered() -> bool:
            return proc.alive() and await _ready(self.http, base)

        return proc.name, recovered

    async def _control_plane_db(self) -> tuple[str, Callable[[], Awaitable[bool]]] | None:
        pid = postmaster_pid(self.cluster.database.server.datadir)
        if pid is None:
            return None
        os.kill(pid, signal.SIGKILL)

        async def recovered() -> bool:
            if not all(p.alive() for p in self.cluster.of("api")):
                return False
            answers = [await _ready(self.http, base) for base in self.cluster.api_urls]
            return all(answers) and await leader(self.cluster) is not None

        return f"postmaster pid {pid}", recovered

    async def _customer_server(self) -> tuple[str, Callable[[], Awaitable[bool]]] | None:
        """Kill the server of a ready single-server instance (an HA instance's are `ha_primary`'s
        and `ha_standby`'s)."""
        rows = await _query(self.cluster.url, "SELECT id FROM instances WHERE state = 'ready'")
        local = LocalProvisioner(self.cluster.settings)
        candidates = []
        for row in rows:
            if _servers_of(local, row["id"]) != 1:
                continue
            pid = postmaster_pid(local.instance_dir(row["id"]) / "pgdata")
            if pid is not None:
                candidates.append((row["id"], pid))
        if not candidates:
            return None
        iid, pid = self.rng.choice(candidates)
        os.kill(pid, signal.SIGKILL)

        async def recovered() -> bool:
            state = await _query(
                self.cluster.url, "SELECT state FROM instances WHERE id = %(id)s", {"id": iid}
            )
            if state[0]["state"] in {"deprovisioning", "deleted"}:
                return True  # deleted meanwhile: nothing left to recover
            now = postmaster_pid(local.instance_dir(iid) / "pgdata")
            return state[0]["state"] in {"ready", "suspended"} and now is not None and now != pid

        return f"instance {iid} (pid {pid})", recovered

    async def _ha_primary(self) -> tuple[str, Callable[[], Awaitable[bool]]] | None:
        return await self._ha_fault(plan.HA_PRIMARY)

    async def _ha_standby(self) -> tuple[str, Callable[[], Awaitable[bool]]] | None:
        return await self._ha_fault(plan.HA_STANDBY)

    async def _pooler(self) -> tuple[str, Callable[[], Awaitable[bool]]] | None:
        return await self._ha_fault(plan.POOLER)

    async def _ha_fault(self, kind: str) -> tuple[str, Callable[[], Awaitable[bool]]] | None:
        """Kill the current primary, a standby or the pooler of a ready, fully redundant HA
        instance while a writer commits rows through its pooled endpoint; recovered once it is
        ready again with a new process in place of the killed one (and, a server killed, its
        standbys all streaming); then every row whose COMMIT was acknowledged must read back."""
        local = LocalProvisioner(self.cluster.settings)
        rows = await _query(self.cluster.url, HA_TARGETS)
        rows = [
            r
            for r in rows
            if str(r["id"]) not in self.probed | self.removing | self.cluster.changing
            and _servers_of(local, r["id"]) > 1
        ]
        self.rng.shuffle(rows)
        for row in rows:
            if await _redundant(local, row["id"]) and local.pooler.is_running(row["id"]):
                break
        else:
            return None
        iid, info = row["id"], customer_info(self.cluster.settings, row)
        # Not resized, deleted or held while written to (it may be spared already: for a backup).
        spared_before = str(iid) in self.cluster.spared
        self.cluster.spared.add(str(iid))
        self.probed.add(str(iid))
        probe = plan.WriteProbe(str(iid), kind)
        writer = AckWriter(info, probe)

        async def let_go() -> None:
            await writer.finish()
            self.probed.discard(str(iid))
            if not spared_before:
                self.cluster.spared.discard(str(iid))

        try:
            # Spared now, so no resize starts: one in flight or applied since the lookup is seen.
            settled = str(iid) not in self.cluster.changing and await _plan_applied(self.cluster.url, iid)
            writer.start()
            acknowledged = settled and await writer.acknowledged(WRITER_START_S)
            victim = _ha_victim(local, iid, kind) if acknowledged else None
        except BaseException:
            await let_go()
            raise
        if victim is None:  # changing plan, not serving writes (suspended, busy), or its process gone
            await let_go()
            log.info("chaos: %s: %s takes no writes or has no process to kill now", kind, iid)
            return None
        what, pid, member = victim
        os.kill(pid, signal.SIGKILL)
        self.report.write_probes.append(probe)
        target = f"instance {iid} ({what} pid {pid})"

        async def recovered() -> bool:
            state = await _query(self.cluster.url, STATE_OF, {"id": iid})
            if state[0]["state"] in {"deprovisioning", "deleted"}:
                return True  # deleted meanwhile: nothing left to recover
            if state[0]["state"] not in {"ready", "suspended"}:
                return False
            if kind == plan.POOLER:
                now = local.pooler.pid(iid)
            else:  # the killed server's own member (a standby now, after a failover), back
                now = postmaster_pid(local.storage.member_datadir(iid, member))
            if now is None or now == pid:
                return False
            return kind == plan.POOLER or state[0]["state"] == "suspended" or await _redundant(local, iid)

        async def finish() -> None:
            await writer.finish()
            probe.present = await _read_back(info, probe, writer.token, self.cluster.url, iid)
            await let_go()
            log.info(
                "chaos: %s of %s: %d rows acknowledged, %s read back",
                kind,
                iid,
                len(probe.acknowledged),
                "none" if probe.present is None else len(set(probe.acknowledged) & set(probe.present)),
            )

        self.after_recovery[target] = finish
        return target, recovered

    async def _data_directory(self) -> tuple[str, Callable[[], Awaitable[bool]]] | None:
        """Remove a ready instance's data directory once it has a backup: a row written more than
        the archive timeout before must survive its restore to the end of the archive."""
        rows = await _query(self.cluster.url, BACKED_UP_TARGETS)
        rows = [row for row in rows if str(row["id"]) not in self.probed | self.cluster.kept]
        if not rows:
            return None  # `keep_a_target_backed_up` is making one
        row = self.rng.choice(rows)
        iid, info = row["id"], customer_info(self.cluster.settings, row)
        if self.backing_up is not None and self.backing_up != str(iid):
            self.cluster.spared.discard(self.backing_up)  # another one is the target
        self.backing_up = None
        local = LocalProvisioner(self.cluster.settings)
        self.cluster.spared.add(str(iid))  # until what comes back is looked at
        self.removing.add(str(iid))
        try:
            kept_at = await asyncio.to_thread(write_row, info, "kept")
            await asyncio.sleep(KEPT_AGE_S)
            await asyncio.to_thread(write_row, info, "late")
        except psycopg.Error:
            self.cluster.spared.discard(str(iid))
            self.removing.discard(str(iid))
            return None  # suspended or moved meanwhile: another target next time
        before = await _query(self.cluster.url, STATE_OF, {"id": iid})
        lost = DataLossProbe(plan.DataLoss(str(iid), round(time.time() - kept_at, 1)))
        self.report.data_losses.append(lost.record)
        await asyncio.to_thread(shutil.rmtree, local.datadir(iid), True)

        async def recovered() -> bool:
            state = await _query(self.cluster.url, STATE_OF, {"id": iid})
            if state[0]["state"] in {"deprovisioning", "deleted"}:
                return True  # deleted meanwhile: nothing left to look at
            # Back once the loss was seen (degraded, then recovered): not the server still running
            # from the removed directory.
            back = state[0]["state"] in {"ready", "suspended"}  # suspended: readable, by a hold since
            if not back or state[0]["state_version"] < before[0]["state_version"] + 2:
                return False
            looked = await asyncio.to_thread(lost.look, info)
            if looked:
                self.cluster.spared.discard(str(iid))
                self.removing.discard(str(iid))
            return looked

        return f"instance {iid} (data directory removed)", recovered

    async def keep_a_target_backed_up(self) -> None:
        """Until the soak stops: while no ready instance has a backup (the workload keeps them busy,
        and a first backup waits for no job to run), one is spared from the workload, ready or on
        its way there, and its backup asked for once it is ready, so that the data directory fault
        finds a target when its turn comes. One that has no backup a minute after it was spared
        (suspended meanwhile, its backup refused again and again) is let go for another."""
        spared_at = 0.0
        asked = False
        while not self.cluster.stop.is_set():
            with contextlib.suppress(psycopg.Error, OSError):  # the database is away: later
                rows = await _query(self.cluster.url, BACKED_UP_TARGETS)
                rows = [row for row in rows if str(row["id"]) not in self.cluster.kept]
                stale = time.monotonic() - spared_at > BACKUP_WAIT_S
                if not rows and self.backing_up is not None and stale:
                    self.cluster.spared.discard(self.backing_up)  # another one, then
                    self.backing_up = None
                if not rows and self.backing_up is None:
                    self.backing_up = await self._spare_one()
                    spared_at, asked = time.monotonic(), False
                if not rows and self.backing_up is not None and not asked:
                    asked = await self._ask_backup(self.backing_up)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self.cluster.stop.wait()

    async def _spare_one(self) -> str | None:
        """Spare from the workload an instance of the soak's that is ready or becoming so (the
        oldest first: the nearest to ready), for a backup; None when there is none."""
        rows = await _query(
            self.cluster.url,
            "SELECT i.id FROM instances i WHERE i.state IN ('pending', 'provisioning', 'ready')"
            " AND i.deletion_requested_at IS NULL AND i.org_id = ANY(%(orgs)s)"
            " ORDER BY i.state = 'ready' DESC, i.created_at",
            {"orgs": [org.id for org in self.cluster.orgs]},
        )
        ids = [str(row["id"]) for row in rows]
        ids = [iid for iid in ids if iid not in self.probed | self.cluster.kept | self.cluster.changing]
        if not ids:
            return None
        self.cluster.spared.add(ids[0])
        return ids[0]

    async def _ask_backup(self, iid: str) -> bool:
        """Ask for a backup of `iid` once it is ready; True once an API accepted it."""
        rows = await _query(
            self.cluster.url,
            "SELECT state, org_id FROM instances WHERE id = %(id)s AND deletion_requested_at IS NULL",
            {"id": iid},
        )
        if not rows or rows[0]["state"] != "ready":
            return False
        key = next(org.key for org in self.cluster.orgs if org.id == str(rows[0]["org_id"]))
        for base in self.cluster.api_urls:
            with contextlib.suppress(httpx.HTTPError):  # an API killed meanwhile: the next one
                asked = await self.http.post(
                    f"{base}/v1/instances/{iid}/backups",
                    headers={"Authorization": f"Bearer {key}"},
                    timeout=10,
                )
                log.info("chaos: a backup of %s asked for: %s", iid, asked.status_code)
                return asked.is_success
        return False

    async def close(self) -> None:
        await self.http.aclose()


STATE_OF = "SELECT state, state_version FROM instances WHERE id = %(id)s"
# Ready instances with a backup: what the data directory fault removes the data of.
BACKED_UP_TARGETS = (
    "SELECT i.id, i.connection, i.secret FROM instances i"
    " JOIN recovery_windows w ON w.instance_id = i.id"
    " WHERE i.state = 'ready' AND i.deletion_requested_at IS NULL AND w.earliest_at IS NOT NULL"
)
# How long an instance spared for its first backup may take to have one before another is tried.
BACKUP_WAIT_S = 60.0
# How old the row that must survive a removed data directory is (more than the soak's archive
# timeout, plus a reconciler interval: the observation closes a segment whose writes waited).
ARCHIVE_TIMEOUT_S = 5.0
KEPT_AGE_S = 2 * ARCHIVE_TIMEOUT_S


def customer_info(settings: Settings, row: dict[str, Any]) -> ConnectionInfo:
    password = load_box(settings).decrypt(bytes(row["secret"]))
    return ConnectionInfo.from_public(row["connection"], password)


# Ready HA instances (their connection details the pooled endpoint's), what the HA faults pick from.
HA_TARGETS = (
    "SELECT i.id, i.connection, i.secret FROM instances i"
    " WHERE i.state = 'ready' AND i.deletion_requested_at IS NULL AND i.connection ? 'pool_mode'"
    " AND i.observed_generation = i.spec_generation"
)


async def _plan_applied(url: str, instance_id: uuid.UUID) -> bool:
    """Whether the instance runs the plan it was last given (no resize waiting to be applied)."""
    rows = await _query(
        url,
        "SELECT observed_generation = spec_generation AS applied FROM instances"
        " WHERE id = %(id)s AND deletion_requested_at IS NULL",
        {"id": instance_id},
    )
    return bool(rows and rows[0]["applied"])


# The writer of an HA fault: rows acknowledged before the kill, its pace, how long it may take to
# start, and to stop once its fault recovered (a commit waits for a standby, or the pooler for a
# server, as long as there is none).
WRITES_BEFORE_THE_FAULT = 5
WRITE_INTERVAL_S = 0.05
WRITER_START_S = 10.0
WRITER_STOP_S = 30.0
READ_BACK_S = 60.0


def _servers_of(local: LocalProvisioner, instance_id: uuid.UUID) -> int:
    """How many servers the instance's applied plan runs (as the provisioner recorded it)."""
    try:
        applied = local.storage.load_state(instance_id).get("plan")
    except (OSError, ValueError):
        return 0
    return plans.SHAPES[str(applied)].instances if applied in plans.SHAPES else 0


async def _redundant(local: LocalProvisioner, instance_id: uuid.UUID) -> bool:
    """Whether the instance's primary serves and sees every standby of its plan streaming (what
    observe reports of replication)."""
    seen = await local.observe(instance_id)
    return (
        seen.healthy
        and not seen.read_only
        and seen.servers > 1
        and seen.standbys_streaming == seen.servers - 1
    )


def _ha_victim(local: LocalProvisioner, instance_id: uuid.UUID, kind: str) -> tuple[str, int, int] | None:
    """What an HA fault kills: (what, pid, member) of the current primary (whichever member it is
    now), of a standby, or of the pooler (member -1)."""
    if kind == plan.POOLER:
        pid = local.pooler.pid(instance_id)
        return None if pid is None else ("pooler", pid, -1)
    primary = local.storage.primary_member(instance_id)
    members = local.standbys.all_members(instance_id)
    chosen = [primary] if kind == plan.HA_PRIMARY else [m for m in members if m != primary]
    for member in chosen:
        pid = postmaster_pid(local.storage.member_datadir(instance_id, member))
        if pid is not None:
            role = "primary" if member == primary else "standby"
            return f"{role} {member_name(member)}", pid, member
    return None


ACKNOWLEDGED_TABLE = (
    "CREATE TABLE IF NOT EXISTS chaos_acknowledged (probe text, id bigint, PRIMARY KEY (probe, id))"
)


class AckWriter:
    """Commits rows 1, 2, 3... one by one through an instance's pooled endpoint, each in its own
    transaction, at a steady pace, on a thread; records each id whose COMMIT was acknowledged. A
    failed attempt (its outcome unknown) is not retried: the next id goes on a fresh connection."""

    def __init__(self, info: ConnectionInfo, probe: plan.WriteProbe) -> None:
        self.info = info
        self.probe = probe
        self.token = uuid.uuid4().hex
        self.stop = threading.Event()
        # Set when the soak gives up waiting for a blocked commit: what it is then told is not
        # counted (a cancelled wait for the standby answers COMMIT, committed on one server only).
        self.abandoned = threading.Event()
        self.warmed_up = threading.Event()  # acknowledged WRITES_BEFORE_THE_FAULT rows
        self.conn: psycopg.Connection[Any] | None = None
        self.thread = threading.Thread(
            target=self._run, name=f"chaos-writer-{probe.instance_id}", daemon=True
        )

    def start(self) -> None:
        self.thread.start()

    def _connect(self) -> psycopg.Connection[Any]:
        conn = psycopg.connect(
            **self.info.libpq(),
            sslmode="require",
            autocommit=True,
            connect_timeout=3,
            prepare_threshold=None,  # the pooler pools by transaction
        )
        try:
            conn.execute(ACKNOWLEDGED_TABLE)
        except psycopg.Error:
            conn.close()  # connected, but its server went meanwhile: not left open for the collector
            raise
        return conn

    def _run(self) -> None:
        next_id = 0
        while not self.stop.is_set():
            next_id += 1
            try:
                if self.conn is None:
                    self.conn = self._connect()
                self.probe.attempted += 1
                self.conn.execute("INSERT INTO chaos_acknowledged VALUES (%s, %s)", (self.token, next_id))
                if not self.abandoned.is_set():
                    self.probe.acknowledged.append(next_id)
                    if len(self.probe.acknowledged) >= WRITES_BEFORE_THE_FAULT:
                        self.warmed_up.set()
            except psycopg.Error:
                self.probe.errors += 1
                if self.conn is not None:
                    with contextlib.suppress(Exception):
                        self.conn.close()
                self.conn = None
            self.stop.wait(WRITE_INTERVAL_S)
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.close()

    async def acknowledged(self, within_s: float) -> bool:
        """Whether WRITES_BEFORE_THE_FAULT rows were acknowledged within `within_s`."""
        return await asyncio.to_thread(self.warmed_up.wait, within_s)

    async def finish(self) -> None:
        """Stop writing; a commit still blocked after WRITER_STOP_S is cancelled and not counted."""
        self.stop.set()
        await asyncio.to_thread(self.thread.join, WRITER_STOP_S)
        if self.thread.is_alive():
            self.abandoned.set()
            conn = self.conn
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.cancel_safe(timeout=5)
            await asyncio.to_thread(self.thread.join, 10)
            log.warning("chaos: the writer of %s was stopped mid-commit", self.probe.instance_id)


async def _read_back(
    info: ConnectionInfo, probe: plan.WriteProbe, token: str, url: str, instance_id: uuid.UUID
) -> list[int] | None:
    """The ids of the probe's rows, read through the pooled endpoint (None: the instance was
    deleted meanwhile, or did not serve within READ_BACK_S)."""

    def read() -> list[int]:
        with psycopg.connect(
            **info.libpq(), sslmode="require", autocommit=True, connect_timeout=3, prepare_threshold=None
        ) as conn:
            rows = conn.execute("SELECT id FROM chaos_acknowledged WHERE probe = %s", (token,)).fetchall()
        return [int(r[0]) for r in rows]

    deadline = time.monotonic() + READ_BACK_S
    while time.monotonic() < deadline:
        try:
            return await asyncio.to_thread(read)
        except psycopg.errors.UndefinedTable:
            return []
        except psycopg.Error:
            with contextlib.suppress(psycopg.Error, OSError):
                state = await _query(url, STATE_OF, {"id": instance_id})
                if state[0]["state"] in {"deprovisioning", "deleted"}:
                    return None
            await asyncio.sleep(0.5)
    log.error("chaos: the rows of %s's %s writer could not be read back", instance_id, probe.fault)
    return None


def _sample_round(local: LocalProvisioner) -> list[plan.PrimarySample]:
    """One look at every server of every HA instance: each instance's servers there and back
    (m0, m1, ..., m1, m0) so that any two writable at once are proven so."""
    members: dict[uuid.UUID, dict[str, int]] = {}
    for key, port in local.ports.table().items():
        owner, held_by = owner_of(key)
        if owner is not None and held_by.isdigit():
            members.setdefault(owner, {})[held_by] = port
    samples: list[plan.PrimarySample] = []
    for instance_id, ports in members.items():
        if len(ports) < 2:
            continue
        order = sorted(ports, key=int)
        for member in order + order[-2::-1]:
            samples.append(
                plan.PrimarySample(
                    str(instance_id), member_name(int(member)), _writable(local, instance_id, ports[member])
                )
            )
    return samples


def _writable(local: LocalProvisioner, instance_id: uuid.UUID, port: int) -> bool | None:
    try:
        with local.admin.connect(instance_id, port, timeout=PRIMARY_SAMPLE_TIMEOUT_S) as admin:
            row = admin.execute("SELECT NOT pg_is_in_recovery()").fetchone()
    except Exception:  # no answer, whatever the reason: a server down, its state gone
        return None
    return None if row is None else bool(row[0])


PRIMARY_SAMPLE_TIMEOUT_S = 2  # libpq's shortest connect timeout
PRIMARY_ROUND_EVERY_S = 0.5


async def watch_primaries(cluster: Cluster, report: plan.Report, stop: asyncio.Event) -> None:
    """Until `stop`: rounds of samples of every HA instance's servers, each proven double primary
    recorded (once)."""
    local = LocalProvisioner(cluster.settings)
    while not stop.is_set():
        began = time.monotonic()
        samples = await asyncio.to_thread(_sample_round, local)
        report.primary_samples += len(samples)
        for finding in plan.double_primary_findings(samples):
            if finding not in report.double_primaries:
                log.error("chaos: %s", finding)
                report.double_primaries.append(finding)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.05, PRIMARY_ROUND_EVERY_S - (time.monotonic() - began))):
                await stop.wait()


def customer_session(info: ConnectionInfo) -> psycopg.Connection[Any]:
    return psycopg.connect(**info.libpq(), sslmode="require", autocommit=True, connect_timeout=5)


def write_row(info: ConnectionInfo, what: str) -> float:
    """A row committed (and acknowledged) now; when it was acknowledged."""
    with customer_session(info) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS chaos_durability (what text, at timestamptz)")
        conn.execute("INSERT INTO chaos_durability VALUES (%s, clock_timestamp())", (what,))
    return time.time()


@dataclass
class DataLossProbe:
    """Looks, once the instance is ready again, at which of the two rows survived."""

    record: plan.DataLoss

    def look(self, info: ConnectionInfo) -> bool:
        try:
            with customer_session(info) as conn:
                present = {r[0] for r in conn.execute("SELECT what FROM chaos_durability").fetchall()}
        except psycopg.errors.UndefinedTable:
            present = set()
        except psycopg.Error:
            return False  # not serving yet
        self.record.kept_present = "kept" in present
        self.record.late_present = "late" in present
        return True


async def supervise(cluster: Cluster, stop: asyncio.Event) -> None:
    """Start again every process found dead (after RESTART_AFTER_S), until `stop`."""
    while not stop.is_set():
        for proc in cluster.procs:
            if not proc.alive():
                if proc.killed_at is None:
                    proc.killed_at = time.monotonic()
                    log.error(
                        "chaos: %s exited by itself (code %s)",
                        proc.name,
                        proc.popen and proc.popen.returncode,
                    )
                if time.monotonic() - proc.killed_at >= RESTART_AFTER_S:
                    proc.start()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.2):
                await stop.wait()


# ---------------------------------------------------------------------------------------------
# The end: convergence, the snapshot, the invariants.


async def snapshot(cluster: Cluster) -> plan.Snapshot:
    conn = await db.connect(cluster.url)
    async with conn:

        async def rows(statement: str) -> list[dict[str, Any]]:
            cursor = await conn.execute(statement)
            return [dict(r) for r in await cursor.fetchall()]

        instances = await rows(
            "SELECT id, org_id, state, spec->>'plan' AS plan, spec_generation, observed_generation,"
            " failed_generation, suspended_by_billing, failure_reason,"
            " deletion_requested_at IS NOT NULL AS deletion_requested FROM instances"
        )
        jobs = await rows("SELECT id, kind, state, instance_id FROM jobs")
        organisations = await rows("SELECT id, billing_hold FROM organisations")
        idempotency = await rows(
            "SELECT org_id, key, status_code, response->>'id' AS instance_id FROM idempotency_keys"
        )
        stripe_events = await rows("SELECT id FROM stripe_events")
        events = await rows("SELECT instance_id, event FROM instance_events")
        mismatches = [str(m) for m in await audit.verify(conn)]
    inventory = await LocalProvisioner(cluster.settings).inventory()
    return plan.Snapshot(
        instances=instances,
        jobs=jobs,
        organisations=organisations,
        idempotency=idempotency,
        stripe_events=stripe_events,
        inventory=[(r.kind, None if r.instance_id is None else str(r.instance_id)) for r in inventory],
        audit_mismatches=mismatches,
        instance_events=events,
    )


async def wait_converged(cluster: Cluster, timeout_s: float) -> tuple[plan.Snapshot, float | None]:
    began = time.monotonic()
    settled_since: float | None = None
    while True:
        try:
            taken = await snapshot(cluster)
        except (psycopg.Error, OSError) as exc:  # the database still restarting: look again
            log.info("chaos: snapshot failed (%s); again", first_line(exc))
            if time.monotonic() - began > timeout_s:
                raise
            await asyncio.sleep(1)
            continue
        if plan.converged(taken) and not _orphans(taken):
            # Settled for a few reconciler intervals in a row: no pass has anything left to start.
            settled_since = settled_since or time.monotonic()
            if time.monotonic() - settled_since >= SETTLED_FOR_S:
                return taken, round(settled_since - began, 1)
        else:
            settled_since = None
        if time.monotonic() - began > timeout_s:
            return taken, None
        await asyncio.sleep(1)


def _orphans(taken: plan.Snapshot) -> bool:
    deleted = {str(i["id"]) for i in taken.instances if i["state"] == "deleted"}
    return any(owner in deleted or owner is None for _, owner in taken.inventory)


async def soak(options: Options, cluster: Cluster) -> plan.Report:
    rng = random.Random(options.seed)  # noqa: S311 (reproducible, not a secret)
    report = plan.Report(
        seed=options.seed,
        minutes=options.minutes,
        processes={
            "API": options.apis,
            "workers": options.workers,
            "reconcilers": options.reconcilers,
            "PostgreSQL (control plane)": 1,
        },
    )
    faults = Faults(cluster, rng, report)
    workload = Workload(cluster, rng, report, options)
    keeper_stop = asyncio.Event()
    keeper = asyncio.create_task(keep_running(cluster.database, keeper_stop, interval_s=0.5))
    supervisor_stop = asyncio.Event()
    supervisor = asyncio.create_task(supervise(cluster, supervisor_stop))
    watcher_stop = asyncio.Event()
    watcher = asyncio.create_task(watch_primaries(cluster, report, watcher_stop))
    try:
        await _wait_serving(cluster, faults.http)
        duration = options.minutes * 60
        schedule = plan.schedule(
            options.seed, duration, options.min_interval_s, options.max_interval_s, kinds=options.kinds
        )
        clients = [asyncio.create_task(workload.client()) for _ in range(3)]
        if plan.DATA_DIRECTORY in options.kinds:
            clients.append(asyncio.create_task(faults.keep_a_target_backed_up()))
        faults.started = time.monotonic()
        await faults.inject_all(schedule)
        await asyncio.sleep(max(0.0, duration - (time.monotonic() - faults.started)))
        log.info("chaos: faults stopped; the workload finishes what it started")
        cluster.stop.set()
        await asyncio.gather(*clients)
        await asyncio.gather(*faults.recoveries)
        taken, report.convergence_s = await wait_converged(cluster, options.converge_timeout_s)
        watcher_stop.set()
        await watcher
        report.violations = plan.violations(workload.ledger, taken)
        report.violations += plan.durability_violations(report.data_losses, taken.instances)
        report.violations += plan.acknowledged_row_violations(report.write_probes, taken.instances)
        report.violations += report.double_primaries
        report.violations += [
            f"{f.kind} ({f.target}) not recovered within {RECOVERY_BOUND_S:.0f}s"
            for f in report.faults
            if f.recovery_s is None
        ]
        if report.convergence_s is None:
            report.violations.append(
                f"not converged within {options.converge_timeout_s:.0f}s of the faults' end"
            )
    finally:
        cluster.stop.set()
        supervisor_stop.set()
        keeper_stop.set()
        watcher_stop.set()
        await asyncio.gather(keeper, supervisor, watcher, return_exceptions=True)
        await faults.close()
        await workload.close()
    return report


async def _wait_serving(cluster: Cluster, http: httpx.AsyncClient, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not all([await _ready(http, base) for base in cluster.api_urls]):
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the APIs did not serve within {timeout_s:.0f}s (logs: {cluster.root / 'logs'})"
            )
        await asyncio.sleep(0.2)


def stop_cluster(cluster: Cluster) -> None:
    for proc in cluster.procs:
        proc.stop()
    with contextlib.suppress(Exception):
        asyncio.run(LocalProvisioner(cluster.settings).stop_all())
    cluster.database.stop()


def run(options: Options) -> plan.Report:
    """Run one soak and write its report (if `options.out`); the caller decides on its violations."""
    made_root = options.root is None
    root = options.root or Path(tempfile.mkdtemp(prefix="cp-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o755)  # noqa: S103 (the servers' user must reach the data directory)
    cluster = start_cluster(options, root)
    report: plan.Report | None = None
    try:
        report = asyncio.run(soak(options, cluster))
    finally:
        stop_cluster(cluster)
        if options.out is not None and (report is None or report.violations):
            # What to read when it failed: every process's log, beside the report.
            kept = options.out.parent / f"{options.out.name}-logs"
            shutil.copytree(root / "logs", kept, dirs_exist_ok=True)
            log.error("chaos: the processes' logs are kept in %s", kept)
        if made_root:
            shutil.rmtree(root, ignore_errors=True)
    if options.out is not None:
        options.out.parent.mkdir(parents=True, exist_ok=True)
        options.out.with_suffix(".md").write_text(report.markdown())
        options.out.with_suffix(".json").write_text(report.dumps())
    return report
