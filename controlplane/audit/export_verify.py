"""The offline verification of an audit export (`audit verify-export`): no database, no settings.

`verify_export` re-derives everything from the lines and the public key: each line is exactly
what the exporter writes; each event's hash from its fields, each link, each checkpoint's hash,
link and signature, the heads each signed, that the events reach every head, the counts, and
the end line.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from controlplane.audit import chain, public_key
from controlplane.audit.export_format import FORMAT, KEYS, encode_line, end_body

MAX_PROBLEMS = 50


@dataclass
class ExportReport:
    problems: list[str] = field(default_factory=list)
    lines: int = 0
    events: int = 0
    chains: int = 0
    checkpoints: tuple[int, int] | None = None
    since: int | None = None
    more: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        if self.ok:
            assert self.checkpoints is not None
            first, last = self.checkpoints
            scope = "from the beginning" if self.since is None else f"since checkpoint {self.since}"
            return (
                f"export verified: {self.events} events in {self.chains} chains, checkpoints "
                f"{first}..{last}, {self.lines} lines, complete {scope}"
            )
        extra = [f"... and {self.more} more"] if self.more else []
        return "\n".join(
            [*self.problems, *extra, f"export NOT verified: {len(self.problems) + self.more} problem(s)"]
        )


class _Bad(ValueError):
    """A line that cannot be read as what it claims to be."""


def _int(value: Any, name: str) -> int:
    if not isinstance(value, chain.RawNumber) or not value.lstrip("-").isdigit():
        raise _Bad(f"{name} is not an integer")
    return int(value)


def _str(value: Any, name: str, *, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or isinstance(value, chain.RawNumber):
        raise _Bad(f"{name} is not a string")
    return value


def _bytes(value: Any, name: str, *, optional: bool = False) -> bytes | None:
    text = _str(value, name, optional=optional)
    if text is None:
        return None
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise _Bad(f"{name} is not hex") from None


def _time(value: Any, name: str) -> datetime:
    text = _str(value, name)
    assert text is not None
    try:
        return chain.parse_iso(text)
    except ValueError:
        raise _Bad(f"{name} is not an ISO time") from None


@dataclass
class _Checkpoint:
    body: chain.Checkpoint
    hash: bytes
    line: int
    heads: list[chain.Head] = field(default_factory=list)


@dataclass
class _Chain:
    entity: str
    entity_id: str
    first_seq: int
    seq: int
    hash: bytes
    line: int
    beyond_first: int = 0


class _Verifier:
    def __init__(self, key: Ed25519PublicKey) -> None:
        self.key = key
        self.fingerprint = public_key.fingerprint(public_key.raw_public(key))
        self.report = ExportReport()
        self.digest = hashlib.sha256()
        # The digest of the lines before the current one (what an end line states).
        self.before = self.digest.copy()
        self.phase = "header"
        self.header: dict[str, Any] | None = None
        self.window_start: datetime | None = None
        self.checkpoints: list[_Checkpoint] = []
        # (entity, id, seq) -> (hash, at, checkpoint number) of every head; which events met them.
        self.heads: dict[tuple[str, str, int], tuple[bytes, datetime, int]] = {}
        self.met: set[tuple[str, str, int]] = set()
        self.newest_head: dict[tuple[str, str], tuple[int, bytes]] = {}
        self.first_heads: dict[tuple[str, str], int] = {}
        self.chain: _Chain | None = None
        self.chains: dict[tuple[str, str], tuple[int, int]] = {}
        self.beyond_first = 0
        self.ended = False

    def problem(self, line: int, text: str) -> None:
        if len(self.report.problems) < MAX_PROBLEMS:
            self.report.problems.append(f"line {line}: {text}" if line else text)
        else:
            self.report.more += 1

    def feed(self, raw: bytes) -> None:
        self.report.lines += 1
        number = self.report.lines
        if self.ended:
            self.problem(number, "a line after the end line")
            return
        self.before = self.digest.copy()
        self.digest.update(raw)
        try:
            record = chain.loads(raw.decode())
            if not isinstance(record, dict) or record.get("type") not in KEYS:
                raise _Bad("not a record of the export")
            kind = record["type"]
            if tuple(record) != KEYS[kind]:
                raise _Bad(f"{kind} record with keys {', '.join(record)}")
            if encode_line(record.items()) != raw:
                raise _Bad("the line is not written as the exporter writes it (changed bytes)")
            getattr(self, "_" + kind.replace("-", "_"))(number, record)
        except (UnicodeDecodeError, ValueError) as exc:
            self.problem(number, str(exc) if isinstance(exc, _Bad) else f"not JSON ({exc})")

    def _expect(self, line: int, kind: str, allowed: tuple[str, ...]) -> None:
        if self.phase not in allowed:
            raise _Bad(f"a {kind} record where a {self.phase} record belongs (lines out of order?)")

    def _audit_export(self, line: int, record: dict[str, Any]) -> None:
        self._expect(line, "header", ("header",))
        if record["format"] != FORMAT:
            raise _Bad(f"format {record['format']!r}, expected {FORMAT!r}")
        if record["key"] != self.fingerprint:
            raise _Bad(f"exported with key {record['key']}, not the key given ({self.fingerprint})")
        since = record["since"]
        self.report.since = None if since is None else _int(since, "since")
        if record["window_start"] is not None:
            self.window_start = _time(record["window_start"], "window_start")
        self.header = record
        self.phase = "checkpoint"

    def _checkpoint(self, line: int, record: dict[str, Any]) -> None:
        self._expect(line, "checkpoint", ("checkpoint", "head"))
        self._close_checkpoint()
        body = chain.Checkpoint(
            number=_int(record["number"], "number"),
            at=_time(record["at"], "at"),
            cut=_time(record["cut"], "cut"),
            prev_hash=_bytes(record["prev_hash"], "prev_hash", optional=True),
            events=_int(record["events"], "events"),
            heads=_int(record["heads"], "heads"),
            heads_digest=_bytes(record["heads_digest"], "heads_digest") or b"",
        )
        stated = _bytes(record["hash"], "hash") or b""
        if body.hash() != stated:
            self.problem(line, f"checkpoint {body.number}: its hash is not the hash of its fields")
        if record["key"] != self.fingerprint:
            self.problem(line, f"checkpoint {body.number}: signed by key {record['key']}, not the key given")
        elif not public_key.verifies(self.key, _bytes(record["signature"], "signature") or b"", body.body()):
            self.problem(line, f"checkpoint {body.number}: the signature does not verify")
        if self.checkpoints:
            prev = self.checkpoints[-1]
            if body.number != prev.body.number + 1:
                self.problem(line, f"checkpoint {body.number} follows {prev.body.number}")
            elif body.prev_hash != prev.hash:
                self.problem(
                    line, f"checkpoint {body.number}: prev_hash is not checkpoint {prev.body.number}'s"
                )
        elif self.report.since is None and (body.number != 1 or body.prev_hash is not None):
            self.problem(line, f"an export from the beginning starts at checkpoint {body.number}, not 1")
        elif self.report.since is not None and body.number != self.report.since:
            self.problem(
                line, f"the export is since checkpoint {self.report.since} but starts at {body.number}"
            )
        self.checkpoints.append(_Checkpoint(body, stated, line))
        self.phase = "head"

    def _head(self, line: int, record: dict[str, Any]) -> None:
        self._expect(line, "head", ("head",))
        current = self.checkpoints[-1]
        if _int(record["checkpoint"], "checkpoint") != current.body.number:
            raise _Bad(f"a head of checkpoint {record['checkpoint']} under checkpoint {current.body.number}")
        head = chain.Head(
            entity=_str(record["entity"], "entity") or "",
            entity_id=_str(record["entity_id"], "entity_id") or "",
            seq=_int(record["seq"], "seq"),
            hash=_bytes(record["hash"], "hash") or b"",
            at=_time(record["at"], "at"),
        )
        if current.heads and chain.head_order(current.heads[-1]) >= chain.head_order(head):
            self.problem(line, "heads out of order")
        current.heads.append(head)
        key = (head.entity, head.entity_id)
        self.heads[(*key, head.seq)] = (head.hash, head.at, current.body.number)
        self.newest_head[key] = (head.seq, head.hash)
        if len(self.checkpoints) == 1:
            self.first_heads[key] = head.seq

    def _close_checkpoint(self) -> None:
        if not self.checkpoints:
            return
        current = self.checkpoints[-1]
        if len(current.heads) != current.body.heads or (
            chain.heads_digest(current.heads) != current.body.heads_digest
        ):
            self.problem(
                current.line,
                f"checkpoint {current.body.number}: the heads that follow it are not the ones it signed",
            )

    def _event(self, line: int, record: dict[str, Any]) -> None:
        self._expect(line, "event", ("head", "event"))
        if self.phase == "head":
            self._close_checkpoint()
            self.phase = "event"
        detail = record["detail"]
        if not isinstance(detail, dict):
            raise _Bad("detail is not an object")
        event = chain.Event(
            entity=_str(record["entity"], "entity") or "",
            entity_id=_str(record["entity_id"], "entity_id") or "",
            seq=_int(record["seq"], "seq"),
            prev_hash=_bytes(record["prev_hash"], "prev_hash", optional=True),
            from_state=_str(record["from_state"], "from_state", optional=True),
            to_state=_str(record["to_state"], "to_state") or "",
            event=_str(record["event"], "event") or "",
            actor_kind=_str(record["actor_kind"], "actor_kind") or "",
            actor_id=_str(record["actor_id"], "actor_id") or "",
            reason=_str(record["reason"], "reason", optional=True),
            detail=chain.jsonb_text(detail),
            request_id=_str(record["request_id"], "request_id", optional=True),
            state_version=_int(record["state_version"], "state_version"),
            at=_time(record["at"], "at"),
            hash=_bytes(record["hash"], "hash") or b"",
        )
        self.report.events += 1
        where = f"{event.entity} {event.entity_id} seq {event.seq}"
        key = (event.entity, event.entity_id)
        previous = self.chain
        if previous is not None and (previous.entity, previous.entity_id) == key:
            if event.seq != previous.seq + 1:
                self.problem(line, f"{where} follows seq {previous.seq}: lines removed or out of order")
            elif event.prev_hash != previous.hash:
                self.problem(line, f"{where}: prev_hash is not the hash of seq {previous.seq}")
        else:
            if previous is not None:
                self._close_chain()
                if (previous.entity, previous.entity_id) > key:
                    self.problem(
                        line, f"{where} comes after {previous.entity} {previous.entity_id}: out of order"
                    )
            if key in self.chains:
                self.problem(line, f"{where}: the chain's events are not together (lines out of order)")
            if self.report.since is None and (event.seq != 0 or event.prev_hash is not None):
                self.problem(line, f"{where}: an export from the beginning has each chain from seq 0")
            self.chain = _Chain(event.entity, event.entity_id, event.seq, event.seq, event.hash, line)
        if event.computed_hash() != event.hash:
            self.problem(line, f"{where}: the hash is not the hash of its fields (the line was changed)")
        head = self.heads.get((*key, event.seq))
        if head is not None:
            self.met.add((*key, event.seq))
            if head[0] != event.hash or head[1] != event.at:
                self.problem(
                    line, f"{where}: not the event checkpoint {head[2]} recorded as its chain's head"
                )
        assert self.chain is not None
        self.chain.seq, self.chain.hash = event.seq, event.hash
        if event.seq > self.first_heads.get(key, -1):
            self.chain.beyond_first += 1

    def _close_chain(self) -> None:
        current = self.chain
        if current is None:
            return
        key = (current.entity, current.entity_id)
        self.chains[key] = (current.first_seq, current.seq)
        self.beyond_first += current.beyond_first
        newest = self.newest_head.get(key)
        where = f"{current.entity} {current.entity_id}"
        if newest is None:
            self.problem(current.line, f"{where}: no checkpoint in the export covers this chain")
        elif newest != (current.seq, current.hash):
            self.problem(
                current.line,
                f"{where}: the chain ends at seq {current.seq}, but checkpoints recorded its head at seq "
                f"{newest[0]} (lines removed?)",
            )

    def _end(self, line: int, record: dict[str, Any]) -> None:
        self._expect(line, "end", ("head", "event"))
        self._close_checkpoint()
        self._close_chain()
        self.chain = None
        self.ended = True
        lines = _int(record["lines"], "lines")
        digest = _bytes(record["digest"], "digest") or b""
        if lines != line - 1:
            self.problem(line, f"the end line counts {lines} lines before it; there are {line - 1}")
        if digest != self.before.digest():
            self.problem(line, "the lines before the end line are not the ones exported (digest differs)")
        if not public_key.verifies(
            self.key, _bytes(record["signature"], "signature") or b"", end_body(lines, digest)
        ):
            self.problem(line, "the end line's signature does not verify")

    def finish(self) -> ExportReport:
        report = self.report
        if not self.ended:
            self._close_chain()
            self.problem(0, "the export has no end line: it is incomplete")
        if not self.checkpoints:
            self.problem(0, "the export has no checkpoint")
            return report
        first = self.checkpoints[0]
        report.checkpoints = (first.body.number, self.checkpoints[-1].body.number)
        report.chains = len(self.chains)
        for (entity, entity_id, seq), (_, at, number) in self.heads.items():
            if (entity, entity_id, seq) in self.met:
                continue
            span = self.chains.get((entity, entity_id))
            if number == first.body.number and report.since is not None:
                if span is None and (self.window_start is None or at < self.window_start):
                    continue  # before the window: not part of this export
                if span is not None and seq < span[0]:
                    continue
            recorded = f"recorded by checkpoint {number}"
            self.problem(0, f"{entity} {entity_id} seq {seq}, {recorded}, is missing from the export")
        named = [] if self.header is None else [_int(n, "checkpoints") for n in self.header["checkpoints"]]
        if self.header is not None and named != list(report.checkpoints):
            self.problem(
                1, f"the header names checkpoints {named}; the export has {list(report.checkpoints)}"
            )
        if report.since is None:
            stated, found = self.checkpoints[-1].body.events, report.events
        else:
            stated, found = self.checkpoints[-1].body.events - first.body.events, self.beyond_first
        if stated != found:
            scope = "in the log" if report.since is None else f"after checkpoint {first.body.number}"
            self.problem(0, f"the checkpoints count {stated} events {scope}; the export has {found}")
        return report


def verify_export(lines: Iterable[bytes], key: Ed25519PublicKey) -> ExportReport:
    """Check an export line by line against the public key; every problem found, with its line."""
    verifier = _Verifier(key)
    for raw in lines:
        verifier.feed(raw)
    return verifier.finish()
