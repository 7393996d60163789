"""The audit log under least privilege: the runtime role cannot tamper, the owner's tampering is
found at its row, checkpoints are signed, an export verifies offline and any edit of it fails,
partitions are made ahead and queries by instance and time use them."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from cryptography.fernet import Fernet

from alembic import command
from controlplane.audit import chain, checkpoints, export, export_verify, public_key, signing_key
from controlplane.audit import verify as audit
from controlplane.db import connection as db
from controlplane.db.connection import AsyncConn
from controlplane.db.transitions import Actor, VersionConflict, transition
from controlplane.runtime.secretbox import SecretBox
from controlplane.runtime.settings import Settings
from provisioners.noop import NoopProvisioner
from tests.factories import make_instance, walk
from tests.integration.test_audit import busy_history, run_cli
from tests.integration.test_schema import alembic_config
from tests.reconciler_support import duties, reconciling

EVENT_HASH_SIGNATURE = (
    "cp_event_hash(text, uuid, bigint, bytea, text, text, text, text, text, text, jsonb, text, bigint,"
    " timestamptz)"
)


def this_month_partition(table: str) -> str:
    return table + datetime.now(UTC).strftime("_y%Ym%m")


async def scalar(conn: AsyncConn, query: str, params: Any = None) -> Any:
    cursor = await conn.execute(query, params)
    row = await cursor.fetchone()
    assert row is not None
    return next(iter(row.values()))


@pytest.fixture
def box() -> SecretBox:
    return SecretBox(Fernet.generate_key())


# Each attempt of the runtime role to change the log's past, and how PostgreSQL refuses it.
TAMPERING = [
    ("ALTER TABLE instance_events DISABLE TRIGGER instance_events_append_only", "must be owner"),
    ("ALTER TABLE job_events DISABLE TRIGGER ALL", "must be owner"),
    ("UPDATE instance_events SET reason = 'rewritten'", "permission denied"),
    ("DELETE FROM instance_events", "permission denied"),
    ("TRUNCATE instance_events", "permission denied"),
    ("UPDATE job_events SET reason = 'rewritten'", "permission denied"),
    ("DELETE FROM job_events", "permission denied"),
    ("TRUNCATE job_events", "permission denied"),
    ("UPDATE {partition} SET reason = 'rewritten'", "permission denied"),
    ("DELETE FROM {partition}", "permission denied"),
    ("TRUNCATE {partition}", "permission denied"),
    ("ALTER TABLE instance_events DETACH PARTITION {partition}", "must be owner"),
    ("DROP TABLE instance_events", "must be owner"),
    (
        "CREATE TABLE instance_events_y2099m01 PARTITION OF instance_events"
        " FOR VALUES FROM ('2099-01-01') TO ('2099-02-01')",
        "permission denied",
    ),
    (f"ALTER FUNCTION {EVENT_HASH_SIGNATURE} RENAME TO cp_event_hash_old", "must be owner"),
    ("SET session_replication_role = replica", "permission denied"),
    ("UPDATE audit_checkpoints SET events = 0", "permission denied"),
    ("DELETE FROM audit_checkpoint_heads", "permission denied"),
    ("DELETE FROM audit_keys", "permission denied"),
]


@pytest.mark.parametrize(("statement", "refusal"), TAMPERING, ids=[s for s, _ in TAMPERING])
async def test_the_runtime_role_cannot_tamper_with_the_log(
    conn: AsyncConn, runtime_url: str, box: SecretBox, statement: str, refusal: str
) -> None:
    runtime = await db.connect(runtime_url)
    async with runtime:
        # What it may do: write through the transition path and record checkpoints.
        inst = await make_instance(runtime)
        await walk(runtime, inst["id"], "start_provisioning", "provisioned")
        assert await checkpoints.record(runtime, box) is not None
        before = await scalar(conn, "SELECT count(*) FROM instance_events")
        sql = statement.format(partition=this_month_partition("instance_events"))
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match=refusal):
            await runtime.execute(sql)
    assert await scalar(conn, "SELECT count(*) FROM instance_events") == before == 3
    assert await scalar(conn, "SELECT count(*) FROM instance_events WHERE reason = 'rewritten'") == 0
    assert (await audit.check(conn)).mismatches == []


async def test_the_runtime_role_cannot_move_a_chain_head_by_hand(conn: AsyncConn, runtime_url: str) -> None:
    runtime = await db.connect(runtime_url)
    async with runtime:
        inst = await make_instance(runtime)
        for change in ("chain_head = '\\x00'", "chain_seq = 5", "chain_seq = NULL, chain_head = NULL"):
            with pytest.raises(psycopg.errors.CheckViolation, match="chain head may only advance"):
                await runtime.execute(f"UPDATE instances SET {change} WHERE id = %s", (inst["id"],))


async def _owner_edit(owner_url: str, statement: str, params: Any) -> None:
    """A change the owner makes behind the append-only trigger, on purpose."""
    owner = await db.connect(owner_url)
    async with owner, owner.transaction():
        await owner.execute("ALTER TABLE instance_events DISABLE TRIGGER instance_events_append_only")
        await owner.execute(statement, params)
        await owner.execute("ALTER TABLE instance_events ENABLE TRIGGER instance_events_append_only")


async def test_an_owner_edit_behind_the_trigger_is_found_at_its_row(
    conn: AsyncConn, owner_url: str, fresh_database: str
) -> None:
    rows = await busy_history(conn)
    target = rows["deleted"]["id"]
    event_id = await scalar(
        conn, "SELECT id FROM instance_events WHERE instance_id = %s AND seq = 3", (target,)
    )
    await _owner_edit(
        owner_url,
        "UPDATE instance_events SET reason = 'nothing to see' WHERE instance_id = %s AND seq = 3",
        (target,),
    )

    result = await audit.check(conn)
    assert result.replay == []
    (broken,) = result.breaks
    assert (broken.entity, broken.entity_id, broken.seq) == ("instance", target, 3)
    assert broken.problem.startswith(f"event {event_id}: stored hash ")
    assert broken.problem.endswith("the row was changed after it was written")

    cli = run_cli("audit", "verify", "--database-url", fresh_database)
    assert cli.returncode == 1, cli.stderr
    first, summary = cli.stdout.splitlines()
    assert first == str(broken)
    assert summary.startswith("audit verify: 1 problem(s): 0 replay, 1 chain, 0 checkpoint;")


@pytest.mark.parametrize(
    ("edit", "seq", "problem"),
    [
        ("DELETE FROM instance_events WHERE instance_id = %s AND seq = 7", 6, "events were removed"),
        ("DELETE FROM instance_events WHERE instance_id = %s AND seq = 3", 4, "(events 3..3 missing)"),
        (
            "UPDATE instance_events SET seq = 9 - seq WHERE instance_id = %s AND seq IN (4, 5)",
            5,
            "follows seq 3",
        ),
        (
            "UPDATE instance_events SET at = at + interval '1 second' WHERE instance_id = %s AND seq = 2",
            2,
            "hash",
        ),
    ],
    ids=["newest removed", "one removed", "two swapped", "time moved"],
)
async def test_removed_and_reordered_events_are_found(
    conn: AsyncConn, owner_url: str, edit: str, seq: int, problem: str
) -> None:
    rows = await busy_history(conn)
    target = rows["deleted"]["id"]
    await _owner_edit(owner_url, edit, (target,))
    (broken,) = (await audit.check(conn)).breaks
    assert (broken.entity_id, broken.seq) == (target, seq)
    assert problem in broken.problem


REWRITE = """
WITH RECURSIVE walk AS (
    SELECT e.id, e.seq, e.prev_hash,
           cp_event_hash('instance', e.instance_id, e.seq, e.prev_hash, e.from_state, e.to_state,
                         e.event, e.actor_kind, e.actor_id, 'nothing to see', e.detail, e.request_id,
                         e.state_version, e.at) AS hash
    FROM instance_events e WHERE e.instance_id = %(id)s AND e.seq = 3
    UNION ALL
    SELECT e.id, e.seq, w.hash,
           cp_event_hash('instance', e.instance_id, e.seq, w.hash, e.from_state, e.to_state, e.event,
                         e.actor_kind, e.actor_id, e.reason, e.detail, e.request_id, e.state_version, e.at)
    FROM walk w JOIN instance_events e ON e.instance_id = %(id)s AND e.seq = w.seq + 1
)
UPDATE instance_events e
SET reason = CASE WHEN e.seq = 3 THEN 'nothing to see' ELSE e.reason END,
    prev_hash = w.prev_hash, hash = w.hash
FROM walk w WHERE e.id = w.id
"""


async def test_a_consistent_rewrite_is_found_by_the_signed_checkpoint(
    conn: AsyncConn, owner_url: str, box: SecretBox
) -> None:
    """Hashes recomputed down the chain and the row's head moved too: only the checkpoint knows."""
    rows = await busy_history(conn)
    target = rows["deleted"]["id"]
    made = await checkpoints.record(conn, box)
    assert made is not None and made["number"] == 1
    await _owner_edit(owner_url, REWRITE, {"id": target})
    owner = await db.connect(owner_url)
    async with owner, owner.transaction():
        await owner.execute("ALTER TABLE instances DISABLE TRIGGER instances_guard_chain")
        await owner.execute(
            "UPDATE instances SET chain_head = (SELECT hash FROM instance_events"
            " WHERE instance_id = %(id)s AND seq = 7) WHERE id = %(id)s",
            {"id": target},
        )
        await owner.execute("ALTER TABLE instances ENABLE TRIGGER instances_guard_chain")

    assert (await audit.check(conn)).mismatches == []  # the chain itself is consistent again
    keys = await signing_key.public_keys(conn)
    signed = await audit.check_checkpoints(conn, keys)
    assert signed.problems == [
        f"checkpoint 1: the head of instance {target} at seq 7 has another hash in the log now:"
        " the chain was rewritten"
    ]


async def test_checkpoints_are_signed_chained_and_checked(
    conn: AsyncConn, owner_url: str, box: SecretBox
) -> None:
    rows = await busy_history(conn)
    first = await checkpoints.record(conn, box)
    assert await checkpoints.record(conn, box) is None  # nothing new
    await walk(conn, rows["ready"]["id"], "suspend", "resume")
    second = await checkpoints.record(conn, box)
    assert first is not None and second is not None
    assert (first["events"], first["heads"]) == (29, 6)
    assert (second["number"], second["events"], second["prev_hash"]) == (2, 31, first["hash"])
    keys = await signing_key.public_keys(conn)
    assert (await audit.check_checkpoints(conn, keys)).problems == []

    # Another key (one the auditor holds from elsewhere) does not verify them.
    stranger = _other_key()
    other = {public_key.fingerprint(public_key.raw_public(stranger)): stranger}
    problems = (await audit.check_checkpoints(conn, other)).problems
    assert problems[:2] == [
        f"checkpoint 1: signed by key {first['key_fingerprint']}, not a trusted key",
        f"checkpoint 2: signed by key {second['key_fingerprint']}, not a trusted key",
    ]

    # A checkpoint's count changed behind its append-only trigger: its hash and signature fail.
    owner = await db.connect(owner_url)
    async with owner, owner.transaction():
        await owner.execute("ALTER TABLE audit_checkpoints DISABLE TRIGGER audit_checkpoints_append_only")
        await owner.execute("UPDATE audit_checkpoints SET events = 30 WHERE number = 2")
        await owner.execute("ALTER TABLE audit_checkpoints ENABLE TRIGGER audit_checkpoints_append_only")
    problems = (await audit.check_checkpoints(conn, keys)).problems
    assert problems[:2] == [
        "checkpoint 2: its stored hash is not the hash of its fields",
        "checkpoint 2: the signature does not verify",
    ]


def _other_key() -> Any:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.generate().public_key()


async def test_one_signing_key_even_when_two_processes_start_at_once(
    fresh_database: str, box: SecretBox
) -> None:
    conns = [await db.connect(fresh_database) for _ in range(2)]
    try:
        keys = await asyncio.gather(*(signing_key.ensure_key(c, box) for c in conns))
    finally:
        for c in conns:
            await c.close()
    assert keys[0].fingerprint == keys[1].fingerprint


async def test_verify_since_a_checkpoint_checks_only_what_came_after(
    conn: AsyncConn, owner_url: str, box: SecretBox, fresh_database: str
) -> None:
    rows = await busy_history(conn)
    made = await checkpoints.record(conn, box)
    assert made is not None
    await walk(conn, rows["ready"]["id"], "suspend", "resume")
    await make_instance(conn)
    window = audit.Window(made["cut"], {})
    result = await audit.check(conn, window)
    assert (result.mismatches, result.events, result.entities) == ([], 3, 2)

    # An edit after the checkpoint is found incrementally, at its row.
    await _owner_edit(
        owner_url,
        "UPDATE instance_events SET actor_id = 'someone else' WHERE instance_id = %s AND seq = 5",
        (rows["ready"]["id"],),
    )
    since = run_cli("audit", "verify", "--since", "--database-url", fresh_database)
    assert since.returncode == 1
    lines = since.stdout.splitlines()
    assert lines[0].startswith(f"instance {rows['ready']['id']} seq 5: event ")
    assert "3 events of 2 entities since checkpoint 1" in lines[-1]

    # The chain since the checkpoint must start from the head it recorded.
    heads = {("instance", str(rows["ready"]["id"])): (4, b"\x00" * 32)}
    (broken,) = (await audit.check(conn, audit.Window(made["cut"], heads))).breaks
    assert broken.seq == 5 and "is not the head the checkpoint recorded at seq 4" in broken.problem


async def _export(conn: AsyncConn, box: SecretBox, path: Path, since: int | None = None) -> list[bytes]:
    with path.open("wb") as out:
        await export.export(conn, box, out, since)
    return path.read_bytes().splitlines(keepends=True)


async def _public(conn: AsyncConn, box: SecretBox) -> Any:
    return public_key.load_public_pem(
        public_key.public_pem((await signing_key.ensure_key(conn, box)).public_raw).encode()
    )


def _line_of(lines: list[bytes], **fields: Any) -> int:
    """The index of the line whose record has these fields."""
    for index, raw in enumerate(lines):
        record = json.loads(raw)
        if all(record.get(k) == v for k, v in fields.items()):
            return index
    raise AssertionError(f"no line with {fields}")


def _problems(lines: list[bytes], key: Any) -> list[str]:
    report = export_verify.verify_export(lines, key)
    assert not report.ok
    return report.problems


async def test_an_export_verifies_offline_and_every_edit_fails(
    conn: AsyncConn, box: SecretBox, tmp_path: Path
) -> None:
    rows = await busy_history(conn)
    await checkpoints.record(conn, box)
    await walk(conn, rows["ready"]["id"], "suspend")
    lines = await _export(conn, box, tmp_path / "audit.ndjson")
    key = await _public(conn, box)
    report = export_verify.verify_export(lines, key)
    assert report.ok, report.problems
    assert (report.events, report.chains, report.checkpoints) == (30, 6, (1, 2))
    assert str(report).startswith("export verified: 30 events in 6 chains, checkpoints 1..2")

    ready = str(rows["ready"]["id"])
    at = _line_of(lines, type="event", entity_id=ready, seq=2)
    edited = lines[at].replace(b'"actor_id":"tests"', b'"actor_id":"testz"')
    assert edited != lines[at] and len(edited) == len(lines[at])
    problems = _problems([*lines[:at], edited, *lines[at + 1 :]], key)
    changed = "the hash is not the hash of its fields (the line was changed)"
    assert problems[0] == f"line {at + 1}: instance {ready} seq 2: {changed}"
    assert problems[-1].endswith("the lines before the end line are not the ones exported (digest differs)")

    # A deleted line, in the middle of a chain and at its end.
    problems = _problems([*lines[:at], *lines[at + 1 :]], key)
    assert (
        problems[0] == f"line {at + 1}: instance {ready} seq 3 follows seq 1: lines removed or out of order"
    )
    last = _line_of(lines, type="event", entity_id=ready, seq=5)
    problems = _problems([*lines[:last], *lines[last + 1 :]], key)
    assert any(
        f"instance {ready}: the chain ends at seq 4, but checkpoints recorded its head at seq 5" in p
        for p in problems
    ), problems

    # A swapped pair: within a chain, and two chains' lines.
    swapped = [*lines[:at], lines[at + 1], lines[at], *lines[at + 2 :]]
    problems = _problems(swapped, key)
    assert (
        problems[0] == f"line {at + 1}: instance {ready} seq 3 follows seq 1: lines removed or out of order"
    )
    first_job = _line_of(lines, type="event", entity="job", seq=0)
    swapped = [*lines[: first_job - 1], lines[first_job], lines[first_job - 1], *lines[first_job + 1 :]]
    assert any("out of order" in p for p in _problems(swapped, key))

    # A one-character edit of a checkpoint's count, a head, and the end line removed.
    cp = _line_of(lines, type="checkpoint", number=2)
    problems = _problems(
        [*lines[:cp], lines[cp].replace(b'"events":30', b'"events":31'), *lines[cp + 1 :]], key
    )
    assert problems[0] == f"line {cp + 1}: checkpoint 2: its hash is not the hash of its fields"
    head = _line_of(lines, type="head", checkpoint=2)
    problems = _problems(
        [*lines[:head], lines[head].replace(b'"seq":5', b'"seq":6'), *lines[head + 1 :]], key
    )
    assert f"line {cp + 1}: checkpoint 2: the heads that follow it are not the ones it signed" in problems
    assert _problems(lines[:-1], key) == ["the export has no end line: it is incomplete"]
    # Whitespace only: the record is the same, the bytes are not.
    spaced = lines[at].replace(b'"seq":2,', b'"seq": 2,')
    problems = _problems([*lines[:at], spaced, *lines[at + 1 :]], key)
    assert problems[0] == f"line {at + 1}: the line is not written as the exporter writes it (changed bytes)"
    # Another key.
    assert _problems(lines, _other_key())[0].startswith("line 1: exported with key ")


async def test_an_export_since_a_checkpoint_covers_what_came_after(
    conn: AsyncConn, box: SecretBox, tmp_path: Path
) -> None:
    rows = await busy_history(conn)
    first = await checkpoints.record(conn, box)
    assert first is not None
    await walk(conn, rows["ready"]["id"], "suspend", "resume")
    second = await make_instance(conn)
    lines = await _export(conn, box, tmp_path / "since.ndjson", since=first["number"])
    report = export_verify.verify_export(lines, await _public(conn, box))
    assert report.ok, report.problems
    # The window starts at checkpoint 1's cut: the two moves and the new instance's creation.
    assert (report.events, report.chains, report.since) == (3, 2, 1)
    new = _line_of(lines, type="event", entity_id=str(second["id"]), seq=0)
    problems = _problems([*lines[:new], *lines[new + 1 :]], await _public(conn, box))
    assert any(f"instance {second['id']} seq 0, recorded by checkpoint 2, is missing" in p for p in problems)
    assert any("the checkpoints count 3 events after checkpoint 1; the export has 2" in p for p in problems)


def test_the_cli_exports_and_verifies_offline(fresh_database: str, tmp_path: Path) -> None:
    data = ["--database-url", fresh_database, "--data-dir", str(tmp_path / "data")]
    out, pub = tmp_path / "audit.ndjson", tmp_path / "audit.pub"
    made = run_cli("audit", "export", "--since", "0", "--output", str(out), *data)
    assert made.returncode == 0, made.stderr
    assert made.stderr.strip() == "exported 0 events and checkpoints 1..1 (3 lines)"
    keyed = run_cli("audit", "public-key", "--output", str(pub), *data)
    assert keyed.returncode == 0, keyed.stderr
    assert pub.read_text().startswith("-----BEGIN PUBLIC KEY-----")
    good = run_cli("audit", "verify-export", str(out), "--key", str(pub))
    assert (good.returncode, good.stdout.strip()) == (
        0,
        "export verified: 0 events in 0 chains, checkpoints 1..1, 3 lines, complete from the beginning",
    )
    out.write_bytes(out.read_bytes().replace(b'"events":0', b'"events":1'))
    bad = run_cli("audit", "verify-export", str(out), "--key", str(pub))
    assert bad.returncode == 1
    assert bad.stdout.splitlines()[0] == "line 2: checkpoint 1: its hash is not the hash of its fields"
    missing = run_cli("audit", "verify-export", str(out), "--key", str(tmp_path / "nope.pub"))
    assert (missing.returncode, missing.stderr.strip()) == (
        1,
        f"controlplane: error: cannot read the key {tmp_path / 'nope.pub'}: No such file or directory",
    )


@pytest.mark.parametrize(
    "text",
    [
        '{"b": 1.10, "aa": [1, 2, {}], "a": "x", "n": 1e2, "z": 0.0000001, "m": -0,'
        ' "big": 123456789012345678901}',
        '{"é": "\\u0001\\t\\"\\\\/", "ä": null, "": true, "k": false, "nested": {"y": [], "x": {}}}',
        '{"emoji": "\U0001f600", "key with space": "line\\nbreak", "dup": 1, "dup": 2}',
        "[]",
        '"a string"',
    ],
)
async def test_pythons_jsonb_text_is_postgresqls(conn: AsyncConn, text: str) -> None:
    printed = await scalar(conn, "SELECT %s::jsonb::text", (text,))
    assert chain.jsonb_text(chain.loads(printed)) == printed


async def test_the_reconciler_makes_partitions_ahead_and_checkpoints(settings: Settings) -> None:
    later = datetime.now(UTC).replace(day=15) + timedelta(days=400)
    async with reconciling(settings, NoopProvisioner()) as rec:
        summary = await duties(rec).run_once(now=later)
        assert summary.audit is not None
        made = set(summary.audit.partitions)
        months = [checkpoints.month_start(later, n) for n in range(4)]
        assert made >= {
            f"{t}{m.strftime('_y%Ym%m')}" for t in ("instance_events", "job_events") for m in months
        }
        assert summary.audit.checkpoint == 1
        again = await duties(rec).run_once(now=later)
        assert again.audit is not None and (again.audit.partitions, again.audit.checkpoint) == ([], None)
        # An instance created now lands in this month's partition; one at the later time in its own.
        async with rec.pool.connection() as runtime:
            inst = await make_instance(runtime)
            where = await scalar(
                runtime,
                "SELECT tableoid::regclass::text FROM instance_events WHERE instance_id = %s",
                (inst["id"],),
            )
    assert where == this_month_partition("instance_events")


async def _spread_events(conn: AsyncConn, instances: int, per_month: int, months: int) -> uuid.UUID:
    """Events of many instances over the months ahead (plain rows: only their placement matters)."""
    org = await scalar(conn, "INSERT INTO organisations (name) VALUES ('spread') RETURNING id")
    await conn.execute(
        "INSERT INTO instances (org_id, name, spec, state) SELECT %s, 'i' || g, '{}', 'pending'"
        " FROM generate_series(1, %s) g",
        (org, instances),
    )
    await conn.execute(
        """
        INSERT INTO instance_events (instance_id, from_state, to_state, event, actor_kind, actor_id,
                                     state_version, at, seq, hash)
        SELECT i.id, 'ready', 'suspended', 'suspend', 'system', 'spread', n,
               m.start + n * interval '1 minute', n, '\\x00'
        FROM instances i
        CROSS JOIN (SELECT date_trunc('month', now()) + k * interval '1 month' AS start
                    FROM generate_series(0, %s - 1) k) m
        CROSS JOIN generate_series(1, %s) n
        WHERE i.org_id = %s
        """,
        (months, per_month, org),
    )
    await conn.execute("ANALYZE instance_events")
    victim: uuid.UUID = await scalar(conn, "SELECT id FROM instances WHERE org_id = %s LIMIT 1", (org,))
    return victim


def relations(plan: Any) -> set[str]:
    """The tables a plan reads (after partition pruning)."""
    if isinstance(plan, list):
        return set().union(*(relations(p) for p in plan))
    if isinstance(plan, dict):
        found = {plan["Relation Name"]} if "Relation Name" in plan else set()
        return found.union(*(relations(v) for v in plan.values()))
    return set()


async def _plan(conn: AsyncConn, query: str, params: Any) -> str:
    cursor = await conn.execute("EXPLAIN (FORMAT JSON) " + query, params)
    row = await cursor.fetchone()
    assert row is not None
    return json.dumps(row["QUERY PLAN"])


async def test_queries_by_instance_and_time_use_the_partitions_indexes(conn: AsyncConn) -> None:
    victim = await _spread_events(conn, instances=200, per_month=10, months=4)
    by_instance = await _plan(
        conn,
        "SELECT e.* FROM instance_events e JOIN instances i ON i.id = e.instance_id"
        " WHERE e.instance_id = %s AND i.org_id = i.org_id AND e.id > 0 ORDER BY e.id LIMIT 101",
        (victim,),
    )
    assert "Seq Scan" not in by_instance, by_instance
    # Each month's own index on (instance_id, id) serves it, merged in id order.
    assert "instance_id_id_idx" in by_instance, by_instance
    month = datetime.now(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    next_month = checkpoints.month_start(month, 1)
    in_a_month = await _plan(
        conn,
        "SELECT * FROM instance_events WHERE instance_id = %s AND at >= %s AND at < %s ORDER BY id",
        (victim, next_month, checkpoints.month_start(month, 2)),
    )
    assert "Seq Scan" not in in_a_month, in_a_month
    assert relations(json.loads(in_a_month)) == {"instance_events" + next_month.strftime("_y%Ym%m")}


async def test_the_chain_holds_under_racing_writers_as_the_runtime_role(
    conn: AsyncConn, runtime_url: str
) -> None:
    """Eight connections move one instance back and forth, each retrying when it loses."""
    inst = await walk(conn, (await make_instance(conn))["id"], "start_provisioning", "provisioned")
    writers = [await db.connect(runtime_url) for _ in range(8)]
    moved = 0

    async def writer(wconn: AsyncConn, rounds: int) -> None:
        nonlocal moved
        for _ in range(rounds):
            while True:
                cursor = await wconn.execute(
                    "SELECT state, state_version FROM instances WHERE id = %s", (inst["id"],)
                )
                row = await cursor.fetchone()
                assert row is not None
                event = "suspend" if row["state"] == "ready" else "resume"
                try:
                    await transition(
                        wconn,
                        "instance",
                        inst["id"],
                        event,
                        row["state_version"],
                        expected_state=row["state"],
                        actor=Actor("worker", "racer"),
                    )
                except VersionConflict:
                    continue
                moved += 1
                break

    try:
        await asyncio.gather(*(writer(w, 5) for w in writers))
    finally:
        for w in writers:
            await w.close()
    assert moved == 40
    seqs = await scalar(
        conn, "SELECT array_agg(seq ORDER BY id) FROM instance_events WHERE instance_id = %s", (inst["id"],)
    )
    assert seqs == list(range(43))
    assert (await audit.check(conn)).mismatches == []


def test_0006_chains_the_events_already_there(empty_database: str) -> None:
    config = alembic_config(empty_database)
    command.upgrade(config, "0005")
    with psycopg.connect(empty_database, autocommit=True) as conn:
        org = conn.execute("INSERT INTO organisations (name) VALUES ('o') RETURNING id").fetchone()
        assert org is not None
        inst = conn.execute(
            "INSERT INTO instances (org_id, name, spec, state)"
            " VALUES (%s, 'old', '{}', 'pending') RETURNING id",
            (org[0],),
        ).fetchone()
        assert inst is not None
        conn.execute(
            "INSERT INTO instance_events (instance_id, from_state, to_state, event, actor_kind, actor_id,"
            " detail, state_version, at) VALUES (%s, NULL, 'pending', 'create', 'customer', 'k',"
            " '{\"spec\": {}}', 0, now() - interval '40 days')",
            (inst[0],),
        )
        conn.execute("UPDATE instances SET state = 'failed', state_version = 1 WHERE id = %s", (inst[0],))
        conn.execute(
            "INSERT INTO instance_events (instance_id, from_state, to_state, event, actor_kind, actor_id,"
            " reason, state_version) VALUES (%s, 'pending', 'failed', 'fail', 'worker', 'w', 'x', 1)",
            (inst[0],),
        )
    command.upgrade(config, "head")

    async def verify() -> list[audit.Mismatch]:
        async with await db.connect(empty_database) as aconn:
            return await audit.verify(aconn)

    assert asyncio.run(verify()) == []
    with psycopg.connect(empty_database) as conn:
        rows = conn.execute(
            "SELECT seq, prev_hash IS NULL, tableoid::regclass::text FROM instance_events ORDER BY id"
        ).fetchall()
    old_month = (datetime.now(UTC) - timedelta(days=40)).strftime("_y%Ym%m")
    assert rows == [
        (0, True, "instance_events" + old_month),
        (1, False, this_month_partition("instance_events")),
    ]
