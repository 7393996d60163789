"""The peer queues' databases: a template per peer with its schema installed by its own code."""

from __future__ import annotations

from pathlib import Path

from bench.core import Context, NotAvailable

PEERS_DIR = Path(__file__).resolve().parent.parent / "peers"
DRIVERS = {
    "pgqueuer": PEERS_DIR / "pgqueuer_driver.py",
    "procrastinate": PEERS_DIR / "procrastinate_driver.py",
}
_templates: dict[str, str] = {}


def driver(ctx: Context, peer: str) -> list[str]:
    if ctx.peers_python is None:
        raise NotAvailable("the peers' environment (bench/.venv) could not be set up")
    return [ctx.peers_python, str(DRIVERS[peer])]


def template(ctx: Context, peer: str) -> str:
    """A database with `peer`'s schema installed (once per run), to clone per measured run."""
    if peer not in _templates:
        name = f"bench_{peer}_template"
        url = ctx.cluster.create_database(name, template="template0")
        ctx.procs.run_json([*driver(ctx, peer), "install", "--dsn", url], name=f"{peer}-install", timeout=120)
        _templates[peer] = name
    return _templates[peer]


def fresh(ctx: Context, peer: str) -> tuple[str, str]:
    return ctx.fresh_database(f"w_{peer}", template=template(ctx, peer))
