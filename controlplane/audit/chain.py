"""The audit chain's encodings (pure): what is hashed for an event, a checkpoint head and a checkpoint.

The database computes an event's hash in the statement that writes it (`cp_event_hash`, migration
0006); this module computes the same bytes in Python, so that `audit verify` does not trust code
kept in the database it checks, and so that an export verifies with no database at all.

An event's canonical encoding is the JSON text PostgreSQL's `json_build_array` gives for
`["cp-event-1", entity, entity_id, seq, prev_hash (hex), from_state, to_state, event, actor_kind,
actor_id, reason, detail, request_id, state_version, at (Unix microseconds)]`: elements separated
by ", ", strings escaped as PostgreSQL's `escape_json` does (the same as `json.dumps` with
`ensure_ascii=False`), `detail` as its jsonb text. The hash is SHA-256 of its UTF-8 bytes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

EVENT_TAG = "cp-event-1"
HEAD_TAG = "cp-head-1"
CHECKPOINT_TAG = "cp-checkpoint-1"
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MICROSECOND = timedelta(microseconds=1)


class RawNumber(str):
    """A JSON number kept as the literal text it was written with (jsonb prints numbers exactly)."""


class RawJson(str):
    """JSON text spliced in as it is (an event's detail, as jsonb prints it)."""


def micros(at: datetime) -> int:
    """Microseconds since the Unix epoch, exactly (PostgreSQL keeps microseconds)."""
    return (at - EPOCH) // MICROSECOND


def from_micros(value: int) -> datetime:
    return EPOCH + timedelta(microseconds=value)


def iso(at: datetime) -> str:
    """UTC, always with six fractional digits: `2026-12-01T10:00:00.000000Z`."""
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_iso(text: str) -> datetime:
    at = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if at.tzinfo is None:
        raise ValueError(f"time {text!r} has no time zone")
    return at


def hex_or_none(value: bytes | None) -> str | None:
    return None if value is None else bytes(value).hex()


# A JSON string as PostgreSQL's escape_json writes it: `"`, `\\` and the control characters
# escaped (\b \f \n \r \t, the others as \u00xx), everything else as it is. This is what
# json.dumps(text, ensure_ascii=False) gives, by the json module's own C function.
json_string: Callable[[str], str] = json.encoder.encode_basestring


def jsonb_text(value: Any) -> str:
    """The text PostgreSQL's jsonb output gives for a value parsed by `loads` (keys by length, then bytes)."""
    if isinstance(value, RawNumber):
        return str(value)
    if isinstance(value, str):
        return json_string(value)
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int | float):
        return json.dumps(value)
    if isinstance(value, Mapping):
        keys = sorted(value, key=lambda k: (len(k.encode()), k.encode()))
        return "{" + ", ".join(f"{json_string(k)}: {jsonb_text(value[k])}" for k in keys) + "}"
    if isinstance(value, Sequence):
        return "[" + ", ".join(jsonb_text(v) for v in value) + "]"
    raise TypeError(f"not a JSON value: {value!r}")


def loads(text: str) -> Any:
    """Parse JSON keeping every number's literal text (so that jsonb_text gives back the same bytes)."""
    return json.loads(text, parse_int=RawNumber, parse_float=RawNumber, parse_constant=_no_constant)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _item(item: Any) -> str:
    kind = type(item)
    if kind is str:
        return json_string(item)
    if item is None:
        return "null"
    if kind is int:
        return str(item)
    if kind is RawJson:
        return str(item)
    raise TypeError(f"cannot encode {item!r}")


def _maybe_string(item: str | None) -> str:
    return "null" if item is None else json_string(item)


def _array(items: Sequence[Any]) -> bytes:
    """The elements as json_build_array(...)::text prints them (strings, integers, null, JSON)."""
    return ("[" + ", ".join([_item(item) for item in items]) + "]").encode()


@dataclass(slots=True)
class Event:
    """One event row as the chain sees it: every field its hash covers, and the hashes."""

    entity: str
    entity_id: str
    seq: int
    prev_hash: bytes | None
    from_state: str | None
    to_state: str
    event: str
    actor_kind: str
    actor_id: str
    reason: str | None
    detail: str  # jsonb text
    request_id: str | None
    state_version: int
    at: datetime
    hash: bytes

    def canonical(self) -> bytes:
        # _array's encoding, written out: this runs once per event of a whole-log check.
        text, maybe = json_string, _maybe_string
        prev = "null" if self.prev_hash is None else f'"{self.prev_hash.hex()}"'
        return (
            f'["{EVENT_TAG}", {text(self.entity)}, {text(self.entity_id)}, {self.seq}, {prev}, '
            f"{maybe(self.from_state)}, {text(self.to_state)}, {text(self.event)}, "
            f"{text(self.actor_kind)}, {text(self.actor_id)}, {maybe(self.reason)}, {self.detail}, "
            f"{maybe(self.request_id)}, {self.state_version}, {micros(self.at)}]"
        ).encode()

    def computed_hash(self) -> bytes:
        return hashlib.sha256(self.canonical()).digest()


@dataclass(frozen=True)
class Head:
    """An entity's chain head as a checkpoint records it."""

    entity: str
    entity_id: str
    seq: int
    hash: bytes
    at: datetime

    def canonical(self) -> bytes:
        return _array([HEAD_TAG, self.entity, self.entity_id, self.seq, self.hash.hex(), micros(self.at)])


def head_order(head: Head) -> tuple[str, str]:
    return (head.entity, head.entity_id)


def heads_digest(heads: Sequence[Head]) -> bytes:
    """SHA-256 over the heads' encodings, one per line, in (entity, entity_id) order."""
    digest = hashlib.sha256()
    for head in sorted(heads, key=head_order):
        digest.update(head.canonical() + b"\n")
    return digest.digest()


@dataclass(frozen=True)
class Checkpoint:
    """What a checkpoint signs: its number, times, predecessor, the event count and its heads."""

    number: int
    at: datetime
    # Every event this checkpoint did not see has `at` at or after the cut.
    cut: datetime
    prev_hash: bytes | None
    events: int
    heads: int
    heads_digest: bytes

    def body(self) -> bytes:
        return _array(
            [
                CHECKPOINT_TAG,
                self.number,
                micros(self.at),
                micros(self.cut),
                hex_or_none(self.prev_hash),
                self.events,
                self.heads,
                self.heads_digest.hex(),
            ]
        )

    def hash(self) -> bytes:
        return hashlib.sha256(self.body()).digest()
