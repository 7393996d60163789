"""The server roles (API, worker, reconciler) as async services, alone or all together in `up`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import uvicorn
from prometheus_client import make_wsgi_app, start_http_server
from psycopg_pool import AsyncConnectionPool

import provisioners
from controlplane.api.app import create_app, end_streams
from controlplane.cli import config
from controlplane.cli.common import CommandError
from controlplane.core import lifecycle
from controlplane.db import connection as db
from controlplane.db import sql
from controlplane.handlers import operations
from controlplane.queue.consumers import ConsumerRunner
from controlplane.queue.registry import JobRegistry
from controlplane.queue.worker import Worker, default_worker_id, worker_pool
from controlplane.runtime import crashpoints, datadir, liveness
from controlplane.runtime.settings import NotAvailable, Settings
from controlplane.services import notices, tenants
from provisioners.base import Provisioner
from reconciler.leader import LeaderElection, ShardLeases
from reconciler.maintenance import Maintenance
from reconciler.reconciler import Reconciler

if TYPE_CHECKING:
    from controlplane.runtime.embedded import EmbeddedDatabase

log = logging.getLogger(__name__)

# How long a stopping API waits for the requests in flight (the watch streams end at once).
GRACEFUL_SHUTDOWN_S = 20
# Instances whose servers `up` brings back after a restart of the host or of `up` itself.
ADOPTED_STATES = lifecycle.WITH_SERVER


class _QuietServer(uvicorn.Server):
    """uvicorn without its own signal handling: the role's stop event decides when to exit."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)


def serve_metrics(settings: Settings, role: str | None = None) -> None:
    """`/metrics` on the metrics port; for a background `role` (worker, reconciler) also `/healthz`
    and `/readyz`, from what its own loop reports (controlplane.runtime.liveness)."""
    if not settings.metrics_port:
        return
    if role is None:
        start_http_server(settings.metrics_port, addr=settings.api.host)
    else:
        liveness.LOOP.configure(role, stale_after_s(settings, role))
        serve_health_and_metrics(settings.metrics_port, settings.api.host, liveness.LOOP)
    log.info("metrics on %s:%d/metrics", settings.api.host, settings.metrics_port)


def stale_after_s(settings: Settings, role: str) -> float:
    """How long a role's loop may go without turning before /healthz says it hangs: the worker's
    turns every heartbeat interval, the reconciler's every interval plus a pass (a bounded batch)."""
    if role == "worker":
        return 3 * settings.worker.heartbeat_interval_s + 30
    return 3 * settings.reconciler.interval_s + 120


def serve_health_and_metrics(port: int, host: str, loop: liveness.Liveness) -> None:
    """A thread serving /healthz, /readyz (from `loop`) and /metrics (everything else)."""
    metrics_app = make_wsgi_app()

    def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path in ("/healthz", "/readyz"):
            health = loop.live() if path == "/healthz" else loop.ready()
            status = "200 OK" if health.ok else "503 Service Unavailable"
            start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
            return [health.detail.encode() + b"\n"]
        body: Iterable[bytes] = metrics_app(environ, start_response)
        return body

    server = make_server(host, port, app, ThreadingWSGIServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="health-and-metrics", daemon=True).start()


class ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Probes every few seconds are not news."""


def bind_api_socket(settings: Settings) -> socket.socket:
    """The API's listening socket, bound now: a port in use is refused in one line (NotAvailable)."""
    host, port = settings.api.host, settings.api.port
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise NotAvailable(f"cannot listen on {host}:{port}: {exc.strerror}; check --api-host") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise NotAvailable(
            f"port {port} on {host} is not free ({exc.strerror}): choose another with --api-port "
            "(or CONTROLPLANE_API_PORT)"
        ) from None
    sock.set_inheritable(True)
    return sock


async def run_api(
    settings: Settings,
    url: str,
    registry: JobRegistry,
    stop: asyncio.Event,
    *,
    provisioner: Provisioner | None = None,
    sock: socket.socket | None = None,
    listening: asyncio.Event | None = None,
) -> None:
    """Serve the API until `stop`; `listening` is set once it accepts requests on its socket."""
    crashpoints.arm(crashpoints.parse(settings.crash_points))
    app = create_app(settings, database_url=url, job_registry=registry, provisioner=provisioner)
    config = uvicorn.Config(
        app,
        host=settings.api.host,
        port=settings.api.port,
        log_config=None,
        proxy_headers=True,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    server = _QuietServer(config)
    sock = sock or bind_api_socket(settings)
    serving = asyncio.create_task(_serve(server, sock))
    stopping = asyncio.create_task(stop.wait())
    while not server.started and not serving.done() and not stop.is_set():
        await asyncio.wait({serving, stopping}, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
    if server.started and listening is not None:
        listening.set()
    await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    server.should_exit = True
    await end_streams(app)  # watch streams end now; their clients reconnect (to another replica)
    await serving
    stopping.cancel()
    if not server.started and not stop.is_set():
        raise RuntimeError(f"the API did not start on {settings.api.host}:{settings.api.port}")


async def _serve(server: uvicorn.Server, sock: socket.socket) -> None:
    try:
        await server.serve(sockets=[sock])
    except SystemExit as exc:  # uvicorn exits when the application's startup fails
        raise RuntimeError(f"the API's startup failed (exit {exc.code}); see the log above") from None
    finally:
        sock.close()


async def run_worker_role(settings: Settings, url: str, registry: JobRegistry, stop: asyncio.Event) -> None:
    crashpoints.arm(crashpoints.parse(settings.crash_points))
    worker_id = settings.worker.id or default_worker_id()
    pool = await worker_pool(settings, url, worker_id, registry)
    worker = Worker(worker_id, settings, pool, registry)
    waiter = asyncio.create_task(_forward_stop(stop, worker.request_stop))
    # The event log's consumers (one runner per consumer across the replicas, by its lock).
    runner = event_consumers(pool, settings)
    consuming = asyncio.create_task(
        runner.run(stop, settings.notifications.consumer_poll_interval_s), name="consumers"
    )
    try:
        await worker.run()
    finally:
        waiter.cancel()
        stop.set()
        await asyncio.gather(consuming, return_exceptions=True)
        await pool.close()


def event_consumers(pool: AsyncConnectionPool[db.AsyncConn], settings: Settings) -> ConsumerRunner:
    """The consumers of the instance event log this control plane runs."""
    return ConsumerRunner(pool, [notices.consumer()], batch_size=settings.notifications.consumer_batch_size)


async def _forward_stop(stop: asyncio.Event, request_stop: Callable[[], None]) -> None:
    await stop.wait()
    request_stop()


async def run_reconciler_role(
    settings: Settings,
    url: str,
    provisioner: Provisioner,
    registry: JobRegistry,
    stop: asyncio.Event,
    *,
    once: bool = False,
    dry_run_orphans: bool = False,
) -> None:
    reconciler_id = f"reconciler-{socket.gethostname()}-{os.getpid()}"
    pool = db.pool(
        url,
        min_size=1,
        max_size=max(2, settings.reconciler.concurrency + 1),
        name=reconciler_id,
        timeouts=db.Timeouts.background(settings),
    )
    await pool.open(wait=True, timeout=30)
    # The leader's duties (job supervision, orphans, the audit log, billing, backups): run by its loop.
    maintenance = Maintenance(
        settings, pool, provisioner, registry, maintainer_id=reconciler_id, dry_run_orphans=dry_run_orphans
    )
    reconciler = Reconciler(settings, pool, provisioner, reconciler_id=reconciler_id, maintenance=maintenance)
    election = LeaderElection(url)
    try:
        if once:
            if await election.ensure():
                maintained = await maintenance.run_once()
                await reconciler.run_once()
                for orphan in maintained.orphans:
                    print(f"orphan: {orphan}")
            elif dry_run_orphans:
                # Listing changes nothing, so it needs no lock: an SRE can list orphans while
                # the running reconciler leads.
                log.warning("another reconciler holds the leader lock; listing orphans only, no pass run")
                for instance_id, why, _ in await maintenance.orphans.find():
                    print(f"orphan: {instance_id}: {why}")
            else:
                log.warning("another reconciler holds the leader lock; no pass run")
            return
        shards = ShardLeases(url, settings.reconciler.shards)
        try:
            await reconciler.run(stop, election, shards)
        finally:
            await shards.release()
    finally:
        await maintenance.close()  # the backups' check under way, if any (once: the pass started it)
        await election.release()
        await pool.close()


@dataclass
class UpReport:
    """What `up` prints for a person once everything listens."""

    url: str
    admin_key: str | None
    admin_key_file: Path
    embedded: bool
    data_dir: Path


async def up(settings: Settings, *, leave_instances_running: bool = False) -> int:
    """Embedded PostgreSQL (unless a URL is set), migrations, API, worker and reconciler together.

    The data directory is held exclusively for the whole run and the API's port is bound before
    anything starts, so a second `up` or a busy port is refused in one line with nothing touched.
    SIGTERM and SIGINT stop everything: the services, every instance server, the embedded server.
    """
    data_dir = Path(settings.data_dir).resolve()  # noqa: ASYNC240 (once, before anything runs)
    with datadir.held(data_dir), bind_api_socket(settings) as sock:
        stop = asyncio.Event()
        stop_on_signals(stop)
        return await _up(settings, data_dir, sock, stop, leave_instances_running=leave_instances_running)


async def _up(
    settings: Settings,
    data_dir: Path,
    sock: socket.socket,
    stop: asyncio.Event,
    *,
    leave_instances_running: bool,
) -> int:
    embedded = None
    if not settings.database.url_value:
        from controlplane.runtime.embedded import open_embedded

        embedded = await asyncio.to_thread(open_embedded, data_dir / "db", bindir=settings.database.pg_bindir)
    target = await asyncio.to_thread(db.migration_target, settings, embedded)
    url = await asyncio.to_thread(db.resolve_database_url, settings)
    provisioner = provisioners.build(settings)
    try:
        await asyncio.to_thread(db.migrate, target.url, runtime_role=target.runtime_role)
        await provisioner.ca_certificate()  # the CA that signs the instances' certificates, made once
        report = UpReport(
            url=settings.api.url,
            admin_key=await _first_admin_key(url),
            admin_key_file=data_dir / "admin.key",
            embedded=embedded is not None,
            data_dir=data_dir,
        )
        await _adopt_instances(url, provisioner)
        return await _serve_all(settings, url, provisioner, sock, stop, report, embedded)
    finally:
        stop.set()
        if not leave_instances_running:
            stopped = await provisioner.stop_all()
            if stopped:
                print(f"stopped {len(stopped)} instance server(s)", flush=True)
        await provisioner.close()
        if embedded is not None:
            await asyncio.to_thread(embedded.stop)
            print("embedded PostgreSQL stopped", flush=True)


async def _serve_all(
    settings: Settings,
    url: str,
    provisioner: Provisioner,
    sock: socket.socket,
    stop: asyncio.Event,
    report: UpReport,
    embedded: EmbeddedDatabase | None,
) -> int:
    """The services (and the embedded server's supervisor) until `stop` or one of them fails."""
    from controlplane.runtime.embedded import keep_running

    registry = operations.registry(provisioner)
    listening = asyncio.Event()
    api = run_api(settings, url, registry, stop, provisioner=provisioner, sock=sock, listening=listening)
    services = [
        asyncio.create_task(api, name="api"),
        asyncio.create_task(run_worker_role(settings, url, registry, stop), name="worker"),
        asyncio.create_task(
            run_reconciler_role(settings, url, provisioner, registry, stop), name="reconciler"
        ),
    ]
    if embedded is not None:
        services.append(asyncio.create_task(keep_running(embedded, stop), name="embedded-postgres"))
    await _announce_when_listening(report, listening, services)
    await asyncio.wait(services, return_when=asyncio.FIRST_EXCEPTION)
    stop.set()
    results = await asyncio.gather(*services, return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    for failure in failures:
        log.error("service stopped with an error: %s", failure)
    return 1 if failures else 0


async def _first_admin_key(url: str) -> str | None:
    conn = await db.connect(url)
    async with conn:
        return await tenants.ensure_admin_key(conn)


async def _adopt_instances(url: str, provisioner: Provisioner) -> None:
    conn = await db.connect(url)
    async with conn:
        cursor = await conn.execute(sql.INSTANCE_IDS_IN, {"states": list(ADOPTED_STATES)})
        ids = [row["id"] for row in await cursor.fetchall()]
    started = await provisioner.start_all(ids)
    if started:
        print(f"started {len(started)} instance server(s) again", flush=True)


def _admin_profile_lines(report: UpReport) -> list[str]:
    """Keep the admin key as the CLI's profile `local-admin` (the admin profile unless one is set
    already), so that the admin and SRE commands work in any shell; what the person should know."""
    if not report.admin_key_file.exists():
        return []
    try:
        path = config.save_profile(config.UP_PROFILE, report.url, report.admin_key_file, admin=True)
        chosen = config.load_config().get(config.ADMIN_PROFILE)
    except (OSError, CommandError) as exc:
        return [f"the admin key was not kept as a CLI profile ({exc}): admin commands need --api-key"]
    if chosen == config.UP_PROFILE:
        return [
            f"admin commands (orgs, keys --org, events, jobs, stuck, stats) use it: profile {chosen}"
            f" in {path}"
        ]
    return [
        f"the admin key is the profile {config.UP_PROFILE} in {path}; admin commands use the profile"
        f" {chosen} (admin_profile): add --profile {config.UP_PROFILE}"
    ]


async def _announce_when_listening(
    report: UpReport, listening: asyncio.Event, services: list[asyncio.Task[None]]
) -> None:
    """Wait until our API serves on its socket (or a service died), then tell the person what to do."""
    waiting = asyncio.create_task(listening.wait())
    await asyncio.wait({waiting, *services}, return_when=asyncio.FIRST_COMPLETED)
    waiting.cancel()
    if not listening.is_set() or any(task.done() for task in services):
        return
    lines = [
        "",
        f"controlplane is up: API {report.url}  (data in {report.data_dir})",
        "PostgreSQL: embedded" if report.embedded else "PostgreSQL: CONTROLPLANE_DATABASE_URL",
    ]
    if report.admin_key:
        report.admin_key_file.write_text(report.admin_key + "\n")
        os.chmod(report.admin_key_file, 0o600)
        lines += [
            f"admin key (shown once; also saved to {report.admin_key_file}, mode 0600):",
            f"  {report.admin_key}",
        ]
    else:
        lines.append(f"admin key: created on first start (see {report.admin_key_file} if kept)")
    lines += _admin_profile_lines(report)
    url_flag = "" if report.url == config.DEFAULT_URL else f" --url {report.url}"
    lines += [
        "next: create an organisation and a database:",
        f"  .venv/bin/controlplane orgs create my-org{url_flag}",
        f"  .venv/bin/controlplane login{url_flag}          (paste the organisation's key it printed)",
        "  .venv/bin/controlplane instances create mydb --plan dev --wait",
        f"or open the console at {report.url}/ and sign in with the organisation's key.",
        "Ctrl-C stops everything (instance servers too; they start again with the next `up`).",
        "",
    ]
    print("\n".join(lines), flush=True)
