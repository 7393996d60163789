"""Clients generated from the OpenAPI document by real generators drive the control plane running
as processes (API, worker, reconciler) with real PostgreSQL servers: openapi-python-client (from
PyPI into a cached environment of its own) create -> ready -> delete, and a TypeScript client
(openapi-typescript + openapi-fetch, from the npm registry into a cached folder, checked by tsc in
strict mode) create -> settled -> resize -> settled -> delete, with no workaround: the fields with
defaults left out, a plan from /v1/plans passed as it is, the watch stream's times parsed as the
REST answers' are."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controlplane.api.app import create_app
from controlplane.db import connection as db
from controlplane.runtime.settings import Settings
from controlplane.services import tenants
from tests.browser_support import Stack, stack_on_a_copy
from tests.npm_tools import cache_dir, npm_tools

GENERATOR = "openapi-python-client==0.29.1"
# The TypeScript generator, its fetch client and the compiler, pinned (npm).
TS_PACKAGES = ("openapi-typescript@7.13.0", "openapi-fetch@0.17.0", "typescript@5.9.3")
# What the generated client imports beyond the generator's own dependencies.
CLIENT_NEEDS = ("python-dateutil==2.9.0.post0",)
pytestmark = pytest.mark.timeout(600)


def tool_dir() -> Path:
    """A cached environment with the generator: made once per machine (and generator version)."""
    return cache_dir() / GENERATOR.replace("==", "-")


def generator() -> Path:
    venv = tool_dir()
    python = venv / "bin" / "python"
    ready = venv / ".installed"
    if ready.exists():
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", GENERATOR, *CLIENT_NEEDS],
        capture_output=True,
        text=True,
        timeout=420,
        check=False,
    )
    if install.returncode != 0:  # no silent skip: the test needs PyPI once per machine
        pytest.fail(
            f"cannot install {GENERATOR} from PyPI into {venv} (is PyPI reachable?):\n"
            + install.stderr[-2000:],
            pytrace=False,
        )
    ready.write_text(GENERATOR)
    return python


@pytest.fixture(scope="module")
def stack(
    test_server: Any, template_url: str, pg_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Stack, str]]:
    logs = tmp_path_factory.mktemp("sdk-logs")
    with stack_on_a_copy(test_server, template_url, pg_root, logs, "cp_sdk") as stacked:
        yield stacked


DRIVER = textwrap.dedent(
    """
    import sys, time
    from cpclient import AuthenticatedClient
    from cpclient.api.instances import create_instance, delete_instance, get_instance
    from cpclient.models import Instance, InstanceCreate, PlanName, Problem

    base, key, name = sys.argv[1:4]
    client = AuthenticatedClient(base_url=base, token=key, raise_on_unexpected_status=True)

    def until(state, ref, timeout=180):
        deadline = time.monotonic() + timeout
        while True:
            got = get_instance.sync(ref, client=client)
            assert isinstance(got, Instance), got
            if got.state.value == state:
                return got
            assert got.state.value not in ("failed",) and time.monotonic() < deadline, got.state
            time.sleep(0.2)

    asked = InstanceCreate(name=name, plan=PlanName.DEV)  # one PlanName for every plan field
    made = create_instance.sync_detailed(client=client, body=asked)
    assert made.status_code == 202, made.content
    assert made.headers["location"].endswith(str(made.parsed.id)) and made.headers["etag"]
    print("created", made.parsed.id, made.parsed.state.value)
    ready = until("ready", name)  # by name: the path takes a name too
    print("ready", ready.connection.host, ready.connection.port)
    again = create_instance.sync_detailed(client=client, body=asked)
    assert again.status_code == 409 and isinstance(again.parsed, Problem), again.content
    print("refused", again.parsed.type_)
    gone = delete_instance.sync_detailed(str(ready.id), client=client)
    assert gone.status_code == 202, gone.content
    print("deleting", gone.parsed.state.value)
    print("deleted", until("deleted", str(ready.id)).state.value)
    """
)


async def _org_key(url: str) -> str:
    conn = await db.connect(url)
    async with conn:
        _, key = await tenants.create_org(conn, f"sdk-{uuid.uuid4().hex[:6]}")
    return key.plaintext


def test_a_generated_client_creates_waits_for_ready_and_deletes(
    stack: tuple[Stack, str], tmp_path: Path
) -> None:
    running, database_url = stack
    python = generator()
    document = tmp_path / "openapi.json"
    document.write_text(json.dumps(create_app(Settings()).openapi()))
    config = tmp_path / "config.yaml"
    config.write_text("post_hooks: []\n")
    out = tmp_path / "cpclient"
    generated = subprocess.run(
        [
            str(python.parent / "openapi-python-client"),
            "generate",
            "--path",
            str(document),
            "--meta",
            "none",
            "--output-path",
            str(out),
            "--config",
            str(config),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    assert generated.returncode == 0 and (out / "api" / "instances" / "create_instance.py").exists(), (
        generated.stdout + generated.stderr
    )
    # The operations are named by their operationIds.
    assert {p.stem for p in (out / "api" / "instances").glob("*.py")} >= {
        "create_instance",
        "get_instance",
        "list_instances",
        "update_instance",
        "delete_instance",
    }
    key = asyncio.run(_org_key(database_url))
    driver = tmp_path / "drive.py"
    driver.write_text(DRIVER)
    ran = subprocess.run(
        [str(python), str(driver), running.url, key, "sdk-orders"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        check=False,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    print(ran.stdout, ran.stderr)
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["created", "ready", "refused", "deleting", "deleted"]
    assert lines[2] == "refused urn:controlplane:problem:name-taken"
    assert lines[-1] == "deleted deleted"


TS_DRIVER = textwrap.dedent(
    """
    import createClient from "openapi-fetch";
    import type { components, paths } from "./schema.js";

    declare const process: { argv: string[] };  // Node's, without its type package
    type Instance = components["schemas"]["Instance"];
    const [base, key, name] = process.argv.slice(2);
    const client = createClient<paths>({ baseUrl: base, headers: { Authorization: `Bearer ${key}` } });
    const RFC3339 = /^\\d{4}-\\d\\d-\\d\\dT\\d\\d:\\d\\d:\\d\\d(\\.\\d+)?(Z|[+-]\\d\\d:\\d\\d)$/;

    function check(ok: boolean, what: string): void {
      if (!ok) throw new Error(what);
    }

    async function get(id: string): Promise<{ instance: Instance; etag: string }> {
      const got = await client.GET("/v1/instances/{instance_id}", { params: { path: { instance_id: id } } });
      check(got.data !== undefined, `GET ${id}: ${got.response.status}`);
      return { instance: got.data!, etag: got.response.headers.get("ETag") ?? "" };
    }

    // Poll until the instance has done what it was asked (its own change, not merely `ready`).
    async function settled(id: string): Promise<Instance> {
      const deadline = Date.now() + 180_000;
      for (;;) {
        const { instance } = await get(id);
        if (instance.settled) return instance;
        check(Date.now() < deadline, `${id} never settled: ${instance.state}`);
        await new Promise((done) => setTimeout(done, 200));
      }
    }

    // A plan as /v1/plans lists it is what create takes (one PlanName type), and the fields with
    // defaults (region, deletion_protection) are left out.
    const plans = await client.GET("/v1/plans");
    const dev = plans.data!.items.find((p) => p.name === "dev")!;
    const made = await client.POST("/v1/instances", { body: { name, plan: dev.name } });
    check(made.response.status === 202 && made.data !== undefined, `create: ${made.response.status}`);
    console.log("created", made.data!.state, made.data!.settled);
    const ready = await settled(made.data!.id);
    console.log("ready", ready.state);
    const resized = await client.PATCH("/v1/instances/{instance_id}", {
      params: { path: { instance_id: ready.id } },
      body: { plan: "small" },
    });
    const generation = resized.data!.spec_generation;
    console.log("resizing", resized.data!.state, resized.data!.settled);
    const applied = await settled(ready.id);
    check(applied.observed_generation >= generation && applied.plan === "small", "resize not applied");
    console.log("resized", applied.state, applied.observed_generation === generation);
    // The ETag of the settled instance: a conditional DELETE goes through (no 412).
    const { etag } = await get(ready.id);
    const deleting = await client.DELETE("/v1/instances/{instance_id}", {
      params: { path: { instance_id: ready.id }, header: { "if-match": etag } },
    });
    console.log("deleting", deleting.response.status, deleting.data!.settled);
    const gone = await settled(ready.id);
    console.log("deleted", gone.state);
    // The watch stream of the deleted instance: its snapshot, times as the REST answers write them.
    const auth = { headers: { Authorization: `Bearer ${key}` } };
    const stream = await fetch(`${base}/v1/instances/${ready.id}/watch`, auth);
    const data = (await stream.text()).split("\\n").find((line) => line.startsWith("data: "))!;
    const snapshot = JSON.parse(data.slice(6)) as Instance;
    check(RFC3339.test(snapshot.updated_at) && snapshot.updated_at === gone.updated_at, snapshot.updated_at);
    check(!Number.isNaN(Date.parse(snapshot.state_entered_at)), snapshot.state_entered_at);
    console.log("watched", snapshot.state);
    """
)


def test_a_typescript_client_waits_for_its_own_changes_without_workarounds(
    stack: tuple[Stack, str], tmp_path: Path
) -> None:
    running, database_url = stack
    modules = npm_tools(TS_PACKAGES)
    document = tmp_path / "openapi.json"
    document.write_text(json.dumps(create_app(Settings()).openapi()))
    (tmp_path / "node_modules").symlink_to(modules)
    (tmp_path / "package.json").write_text('{"type": "module"}')
    generated = subprocess.run(
        [str(modules / ".bin" / "openapi-typescript"), str(document), "-o", str(tmp_path / "schema.ts")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert generated.returncode == 0, generated.stdout + generated.stderr
    (tmp_path / "drive.ts").write_text(TS_DRIVER)
    compiled = subprocess.run(
        [
            str(modules / ".bin" / "tsc"),
            "--strict",
            "--target",
            "es2022",
            "--module",
            "nodenext",
            "--moduleResolution",
            "nodenext",
            "--skipLibCheck",
            "--outDir",
            str(tmp_path / "out"),
            str(tmp_path / "drive.ts"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=180,
        check=False,
    )
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr  # type errors: a workaround needed
    key = asyncio.run(_org_key(database_url))
    ran = subprocess.run(
        ["node", str(tmp_path / "out" / "drive.js"), running.url, key, "ts-orders"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=400,
        check=False,
    )
    print(ran.stdout, ran.stderr)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == [
        "created pending false",
        "ready ready",
        "resizing ready false",  # still ready when accepted: settled says it is not done
        "resized ready true",
        "deleting 202 false",
        "deleted deleted",
        "watched deleted",
    ]
