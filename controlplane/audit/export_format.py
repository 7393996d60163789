"""The audit export's line format: the records, their keys in order, and how a line is written.

One JSON object per line, keys in a fixed order, no spaces (an event's `detail` as jsonb prints
it): the header; the checkpoints covered, each followed by the heads it recorded; the events,
by entity and sequence number; a signed end line with the number of lines before it and the
SHA-256 of their bytes. The writer (`export`) writes each line with `encode_line`; the offline
verifier (`export_verify`) encodes each record it reads again, and a line that is not byte for
byte what it gives is refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from controlplane.audit import chain

FORMAT = "controlplane-audit-export/1"
END_TAG = "cp-export-end-1"

HEADER_KEYS = ("type", "format", "since", "window_start", "checkpoints", "key", "exported_at")
CHECKPOINT_KEYS = (
    "type",
    "number",
    "at",
    "cut",
    "prev_hash",
    "events",
    "heads",
    "heads_digest",
    "hash",
    "key",
    "signature",
)
HEAD_KEYS = ("type", "checkpoint", "entity", "entity_id", "seq", "hash", "at")
EVENT_KEYS = (
    "type",
    "entity",
    "entity_id",
    "seq",
    "prev_hash",
    "hash",
    "at",
    "from_state",
    "to_state",
    "event",
    "actor_kind",
    "actor_id",
    "reason",
    "request_id",
    "state_version",
    "detail",
)
END_KEYS = ("type", "lines", "digest", "signature")
KEYS = {
    "audit-export": HEADER_KEYS,
    "checkpoint": CHECKPOINT_KEYS,
    "head": HEAD_KEYS,
    "event": EVENT_KEYS,
    "end": END_KEYS,
}


def _value(value: Any) -> str:
    if isinstance(value, chain.RawNumber):
        return str(value)
    if isinstance(value, chain.RawJson):
        return str(value)
    if isinstance(value, dict):
        return chain.jsonb_text(value)
    if isinstance(value, list):
        return "[" + ",".join(_value(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def encode_line(pairs: Iterable[tuple[str, Any]]) -> bytes:
    """One export line: a JSON object with the keys in the order given, no spaces, then a newline."""
    return ("{" + ",".join(f"{json.dumps(k)}:{_value(v)}" for k, v in pairs) + "}\n").encode()


def end_body(lines: int, digest: bytes) -> bytes:
    return f'["{END_TAG}", {lines}, "{digest.hex()}"]'.encode()
