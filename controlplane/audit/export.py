"""The audit export's writer: a checkpoint recorded, then the events and checkpoints as NDJSON.

The lines are `export_format`'s (the header, the checkpoints with their heads, the events, a signed
end line); `export_verify` checks such a file offline.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import IO, Any

from controlplane.audit import chain, checkpoints, signing_key
from controlplane.audit.export_format import FORMAT, encode_line, end_body
from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.runtime.secretbox import SecretBox


def checkpoint_line(row: dict[str, Any]) -> bytes:
    return encode_line(
        [
            ("type", "checkpoint"),
            ("number", row["number"]),
            ("at", chain.iso(row["at"])),
            ("cut", chain.iso(row["cut"])),
            ("prev_hash", chain.hex_or_none(row["prev_hash"])),
            ("events", row["events"]),
            ("heads", row["heads"]),
            ("heads_digest", bytes(row["heads_digest"]).hex()),
            ("hash", bytes(row["hash"]).hex()),
            ("key", row["key_fingerprint"]),
            ("signature", bytes(row["signature"]).hex()),
        ]
    )


def head_line(row: dict[str, Any]) -> bytes:
    return encode_line(
        [
            ("type", "head"),
            ("checkpoint", row["checkpoint"]),
            ("entity", row["entity"]),
            ("entity_id", str(row["entity_id"])),
            ("seq", row["seq"]),
            ("hash", bytes(row["hash"]).hex()),
            ("at", chain.iso(row["at"])),
        ]
    )


def event_line(entity: str, row: dict[str, Any]) -> bytes:
    return encode_line(
        [
            ("type", "event"),
            ("entity", entity),
            ("entity_id", str(row["entity_id"])),
            ("seq", row["seq"]),
            ("prev_hash", chain.hex_or_none(row["prev_hash"])),
            ("hash", bytes(row["hash"]).hex()),
            ("at", chain.iso(row["at"])),
            ("from_state", row["from_state"]),
            ("to_state", row["to_state"]),
            ("event", row["event"]),
            ("actor_kind", row["actor_kind"]),
            ("actor_id", row["actor_id"]),
            ("reason", row["reason"]),
            ("request_id", row["request_id"]),
            ("state_version", row["state_version"]),
            ("detail", chain.RawJson(row["detail_text"])),
        ]
    )


class ExportError(ValueError):
    """An export that cannot be made as asked (an unknown checkpoint)."""


@dataclass
class ExportSummary:
    lines: int = 0
    events: int = 0
    first: int = 0
    last: int = 0


async def resolve_since(conn: AsyncConn, since: int | datetime | None) -> int | None:
    """A checkpoint number from `--since`: a number, the newest checkpoint at or before a time, or
    None (from the beginning)."""
    if since is None or since == 0:
        return None
    if isinstance(since, int):
        if await checkpoints.by_number(conn, since) is None:
            raise ExportError(f"there is no checkpoint {since}")
        return since
    cursor = await conn.execute(sql.NEWEST_CHECKPOINT_AT_OR_BEFORE, {"at": since})
    row = await cursor.fetchone()
    return None if row is None else row["number"]


async def export(
    conn: AsyncConn, box: SecretBox, out: IO[bytes], since: int | datetime | None = None
) -> ExportSummary:
    """Record a checkpoint of what is committed now, then write the events since checkpoint
    `since` (a number or a time; None: all) with every checkpoint from it to the new one."""
    key = await signing_key.ensure_key(conn, box)
    await checkpoints.record(conn, box)
    summary = ExportSummary()
    digest = hashlib.sha256()

    def write(data: bytes) -> None:
        out.write(data)
        digest.update(data)
        summary.lines += 1

    async with conn.transaction():
        await conn.execute(sql.READ_ONLY_SNAPSHOT)
        number = await resolve_since(conn, since)
        newest = await checkpoints.latest(conn)
        assert newest is not None
        summary.first, summary.last = number or 1, newest["number"]
        params = {"first": summary.first, "last": summary.last}
        cursor = await conn.execute(sql.CHECKPOINTS_EARLIEST_CUT, params)
        start_row = await cursor.fetchone()
        start = None if number is None or start_row is None else start_row["start"]
        write(
            encode_line(
                [
                    ("type", "audit-export"),
                    ("format", FORMAT),
                    ("since", number),
                    ("window_start", None if start is None else chain.iso(start)),
                    ("checkpoints", [summary.first, summary.last]),
                    ("key", key.fingerprint),
                    ("exported_at", chain.iso(newest["at"])),
                ]
            )
        )
        await _write_checkpoints(conn, params, write)
        for entity in sql.ENTITY_TABLES:
            query = sql.EXPORT_EVENTS[entity] if start is None else sql.EXPORT_EVENTS_SINCE[entity]
            async with conn.cursor(name=f"export_{entity}") as rows:
                rows.itersize = 5000
                await rows.execute(query, {**params, "entity": entity, "start": start})
                async for row in rows:
                    write(event_line(entity, row))
                    summary.events += 1
    lines = summary.lines
    out.write(
        encode_line(
            [
                ("type", "end"),
                ("lines", lines),
                ("digest", digest.hexdigest()),
                ("signature", key.sign(end_body(lines, digest.digest())).hex()),
            ]
        )
    )
    summary.lines += 1
    return summary


async def _write_checkpoints(conn: AsyncConn, params: dict[str, Any], write: Callable[[bytes], None]) -> None:
    cursor = await conn.execute(sql.CHECKPOINTS_BETWEEN, params)
    for row in await cursor.fetchall():
        write(checkpoint_line(row))
        async with conn.cursor(name="export_heads") as heads:
            heads.itersize = 5000
            await heads.execute(sql.CHECKPOINT_HEADS, {"number": row["number"]})
            async for head in heads:
                write(head_line(head))
