"""Audit checks: the replay (every current row rebuilt from its event log) and the hash chains
(every event hashed again in Python, every link and sequence number checked, every chain's end
compared with its row's head), over the whole log or incrementally since a checkpoint.

The hashes are recomputed here, not by `cp_event_hash`: a role able to rewrite events could
also replace a function in the database it is checked against.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from controlplane.audit import chain, checkpoints, public_key
from controlplane.core import lifecycle
from controlplane.db import sql
from controlplane.db.connection import AsyncConn


@dataclass(frozen=True)
class Mismatch:
    entity: str
    entity_id: Any
    problem: str
    # The chain position of a broken link (None: a replay mismatch about the whole entity).
    seq: int | None = None

    def __str__(self) -> str:
        where = "" if self.seq is None else f" seq {self.seq}"
        return f"{self.entity} {self.entity_id}{where}: {self.problem}"


@dataclass
class Replay:
    """The state rebuilt from one entity's events, and what was wrong on the way."""

    state: str | None = None
    version: int | None = None
    problems: list[str] | None = None

    def fail(self, problem: str) -> None:
        self.problems = [*(self.problems or []), problem]

    def resume(self, event: dict[str, Any]) -> None:
        """Start from the state this event leaves (an incremental check does not see the start)."""
        self.state, self.version = event["from_state"], event["state_version"] - 1

    def step(self, table: lifecycle.Lifecycle, event: dict[str, Any]) -> None:
        if self.state is None:
            if event["from_state"] is not None or event["to_state"] != table.initial:
                self.fail(f"first event {event['id']} is not a creation in {table.initial!r}")
            if event["state_version"] != 0:
                self.fail(f"creation event {event['id']} has state_version {event['state_version']}")
            self.state, self.version = event["to_state"], event["state_version"]
            return
        assert self.version is not None
        if event["from_state"] != self.state:
            self.fail(f"event {event['id']} leaves {event['from_state']!r} but the log was at {self.state!r}")
        try:
            expected = table.apply(event["from_state"], event["event"])
        except lifecycle.IllegalTransition:
            self.fail(f"event {event['id']} ({event['from_state']} --{event['event']}->) is illegal")
            expected = event["to_state"]
        if expected != event["to_state"]:
            self.fail(f"event {event['id']} records {event['to_state']!r}; the table gives {expected!r}")
        if event["state_version"] != self.version + 1:
            self.fail(
                f"event {event['id']} has state_version {event['state_version']}, expected {self.version + 1}"
            )
        self.state, self.version = event["to_state"], event["state_version"]


def short(value: bytes | None) -> str:
    return "none" if value is None else bytes(value).hex()[:16] + "…"


@dataclass
class ChainWalk:
    """One entity's chain as its events arrive in order; the first broken link is kept."""

    entity: str
    entity_id: Any
    # An incremental check starts within the chain: the head a checkpoint recorded, if any.
    start: tuple[int, bytes] | None = None
    windowed: bool = False
    seq: int | None = None
    hash: bytes | None = None
    broken: Mismatch | None = None
    events: int = 0

    def _break(self, seq: int, problem: str) -> None:
        if self.broken is None:
            self.broken = Mismatch(self.entity, self.entity_id, problem, seq)

    def step(self, row: dict[str, Any]) -> None:
        self.events += 1
        if self.broken is not None:
            return
        event = chain.Event(
            entity=self.entity,
            entity_id=str(self.entity_id),
            seq=row["seq"],
            prev_hash=None if row["prev_hash"] is None else bytes(row["prev_hash"]),
            from_state=row["from_state"],
            to_state=row["to_state"],
            event=row["event"],
            actor_kind=row["actor_kind"],
            actor_id=row["actor_id"],
            reason=row["reason"],
            detail=row["detail_text"],
            request_id=row["request_id"],
            state_version=row["state_version"],
            at=row["at"],
            hash=bytes(row["hash"]),
        )
        if self.seq is None:
            self._first(event, row["id"])
        elif event.seq != self.seq + 1:
            what = "repeated" if event.seq <= self.seq else f"events {self.seq + 1}..{event.seq - 1} missing"
            self._break(event.seq, f"event {row['id']} follows seq {self.seq} ({what})")
        elif event.prev_hash != self.hash:
            self._break(
                event.seq,
                f"event {row['id']}: prev_hash {short(event.prev_hash)} is not the hash of seq "
                f"{self.seq} ({short(self.hash)}): the event before it was changed or replaced",
            )
        self._check_own_hash(event, row["id"])
        self.seq, self.hash = event.seq, event.hash

    def _first(self, event: chain.Event, event_id: int) -> None:
        if not self.windowed:
            if event.seq != 0:
                self._break(event.seq, f"event {event_id}: the chain starts at seq {event.seq}, not 0")
            elif event.prev_hash is not None:
                self._break(0, f"event {event_id}: the first event has a prev_hash")
            return
        if self.start is None:
            return
        seq, digest = self.start
        if seq == event.seq - 1 and event.prev_hash != digest:
            self._break(
                event.seq,
                f"event {event_id}: prev_hash {short(event.prev_hash)} is not the head the checkpoint "
                f"recorded at seq {seq} ({short(digest)})",
            )
        elif seq < event.seq - 1:
            self._break(event.seq, f"event {event_id}: events {seq + 1}..{event.seq - 1} missing")

    def _check_own_hash(self, event: chain.Event, event_id: int) -> None:
        computed = event.computed_hash()
        if computed != event.hash:
            self._break(
                event.seq,
                f"event {event_id}: stored hash {short(event.hash)}, its fields hash to "
                f"{short(computed)}: the row was changed after it was written",
            )
        elif self.start is not None and self.start[0] == event.seq and self.start[1] != event.hash:
            self._break(
                event.seq,
                f"event {event_id}: hash {short(event.hash)} is not the head the checkpoint recorded "
                f"({short(self.start[1])}): the chain was rewritten",
            )

    def finish(self, chain_seq: int | None, chain_head: bytes | None) -> None:
        """The row's head must be the last event seen."""
        if self.broken is not None:
            return
        head = None if chain_head is None else bytes(chain_head)
        if self.start is not None and self.seq is not None and self.start[0] > self.seq:
            self._break(
                self.seq,
                f"the log ends at seq {self.seq} but a checkpoint recorded its head at seq {self.start[0]}",
            )
        elif self.seq is None:
            if chain_seq is not None:
                self._break(chain_seq, f"the row's chain head is seq {chain_seq} but it has no events")
        elif chain_seq != self.seq:
            self._break(
                self.seq,
                f"the log ends at seq {self.seq} but the row's chain head is seq {chain_seq}"
                + (": events were removed" if chain_seq is not None and chain_seq > self.seq else ""),
            )
        elif head != self.hash:
            self._break(
                self.seq,
                f"the last event's hash {short(self.hash)} is not the row's chain head {short(head)}",
            )


@dataclass
class Window:
    """An incremental check: the events at or after `since` (a checkpoint's cut), linked to the
    heads that checkpoint recorded."""

    since: datetime
    heads: dict[tuple[str, str], tuple[int, bytes]] = field(default_factory=dict)


@dataclass
class Result:
    mismatches: list[Mismatch] = field(default_factory=list)
    entities: int = 0
    events: int = 0

    @property
    def replay(self) -> list[Mismatch]:
        return [m for m in self.mismatches if m.seq is None]

    @property
    def breaks(self) -> list[Mismatch]:
        return [m for m in self.mismatches if m.seq is not None]


async def _rows(conn: AsyncConn, entity: str, window: Window | None) -> AsyncIterator[dict[str, Any]]:
    query = sql.AUDIT_LOG[entity] if window is None else sql.AUDIT_LOG_SINCE[entity]
    async with conn.cursor(name=f"audit_{entity}") as cursor:
        cursor.itersize = 5000
        await cursor.execute(query, {"since": None if window is None else window.since})
        async for row in cursor:
            yield row


def _finish(entity: str, entity_id: Any, replay: Replay, current: tuple[str, int]) -> list[Mismatch]:
    out = [Mismatch(entity, entity_id, p) for p in replay.problems or []]
    if replay.state is None:
        out.append(Mismatch(entity, entity_id, "has no events at all"))
    elif (replay.state, replay.version) != current:
        out.append(
            Mismatch(
                entity,
                entity_id,
                f"row is {current[0]!r} v{current[1]}, log replays to {replay.state!r} v{replay.version}",
            )
        )
    return out


@dataclass
class _Entity:
    """One entity's walk: its row as it is, its replay and its chain."""

    entity_id: Any
    current: tuple[str, int]
    head: tuple[int | None, bytes | None]
    replay: Replay
    chain: ChainWalk

    def finish(self, entity: str) -> list[Mismatch]:
        self.chain.finish(*self.head)
        out = _finish(entity, self.entity_id, self.replay, self.current)
        return [*out, *([self.chain.broken] if self.chain.broken else [])]


async def check(conn: AsyncConn, window: Window | None = None) -> Result:
    """Replay and chain check of every instance and job (or of those with events in `window`).

    Runs in one read-only repeatable-read transaction so the rows and the logs agree in time.
    """
    result = Result()
    async with conn.transaction():
        await conn.execute(sql.READ_ONLY_SNAPSHOT)
        for entity, table in lifecycle.LIFECYCLES.items():
            walk: _Entity | None = None
            async for row in _rows(conn, entity, window):
                if walk is None or row["entity_id"] != walk.entity_id:
                    if walk is not None:
                        result.mismatches += walk.finish(entity)
                    walk = _Entity(
                        row["entity_id"],
                        (row["current_state"], row["current_version"]),
                        (row["chain_seq"], row["chain_head"]),
                        Replay(),
                        ChainWalk(
                            entity,
                            row["entity_id"],
                            None if window is None else window.heads.get((entity, str(row["entity_id"]))),
                            windowed=window is not None,
                        ),
                    )
                    result.entities += 1
                    if window is not None and row["seq"] is not None and row["seq"] > 0:
                        walk.replay.resume(row)
                if row["id"] is not None:
                    walk.replay.step(table, row)
                    walk.chain.step(row)
                    result.events += 1
            if walk is not None:
                result.mismatches += walk.finish(entity)
    return result


async def verify(conn: AsyncConn) -> list[Mismatch]:
    """The whole log: each replay mismatch and each chain's first broken link."""
    return (await check(conn)).mismatches


@dataclass
class CheckpointResult:
    problems: list[str] = field(default_factory=list)
    first: int | None = None
    last: int | None = None
    heads: int = 0
    keys: set[str] = field(default_factory=set)

    @property
    def count(self) -> int:
        return 0 if self.first is None or self.last is None else self.last - self.first + 1


async def check_checkpoints(
    conn: AsyncConn, keys: dict[str, Any], since: int | None = None
) -> CheckpointResult:
    """Every checkpoint from `since` (all without it): its hash, its link to the one before, its
    signature (by one of `keys`, fingerprint -> Ed25519 public key), its heads' digest, and that each
    head it recorded is still in the log with that hash."""
    result = CheckpointResult()
    async with conn.transaction():
        await conn.execute(sql.READ_ONLY_SNAPSHOT)
        cursor = await conn.execute(sql.CHECKPOINTS_FROM, {"since": since or 0})
        rows = await cursor.fetchall()
        by_number = {}
        prev = None
        for row in rows:
            number = row["number"]
            by_number[number] = row
            body = checkpoints.as_checkpoint(row)
            if result.first is None:
                result.first = number
                if since is None and number != 1:
                    result.problems.append(
                        f"checkpoint {number} is the first: checkpoints 1..{number - 1} are missing"
                    )
            result.last = number
            if body.hash() != bytes(row["hash"]):
                result.problems.append(f"checkpoint {number}: its stored hash is not the hash of its fields")
            if prev is not None:
                if number != prev["number"] + 1:
                    result.problems.append(
                        f"checkpoint {number} follows {prev['number']}: checkpoints missing"
                    )
                elif body.prev_hash != bytes(prev["hash"]):
                    result.problems.append(
                        f"checkpoint {number}: prev_hash is not checkpoint {prev['number']}'s hash"
                    )
            key = keys.get(row["key_fingerprint"])
            if key is None:
                result.problems.append(
                    f"checkpoint {number}: signed by key {row['key_fingerprint']}, not a trusted key"
                )
            elif not public_key.verifies(key, bytes(row["signature"]), body.body()):
                result.problems.append(f"checkpoint {number}: the signature does not verify")
            else:
                result.keys.add(row["key_fingerprint"])
            prev = row
        await _check_heads(conn, since or 0, by_number, result)
        if since is None and prev is not None:
            covered = int(await _scalar(conn, sql.EVENTS_COVERED_BY_HEADS))
            if covered != prev["events"]:
                result.problems.append(
                    f"checkpoint {prev['number']} counts {prev['events']} events; its chains' recorded "
                    f"heads account for {covered}"
                )
    return result


async def _scalar(conn: AsyncConn, query: str) -> Any:
    cursor = await conn.execute(query)
    row = await cursor.fetchone()
    assert row is not None
    return next(iter(row.values()))


async def _check_heads(
    conn: AsyncConn, since: int, by_number: dict[int, Any], result: CheckpointResult
) -> None:
    digests: dict[int, Any] = {}
    counts: dict[int, int] = {}
    async with conn.cursor(name="audit_heads") as cursor:
        cursor.itersize = 5000
        await cursor.execute(sql.RECORDED_HEADS_IN_LOG, {"since": since})
        async for row in cursor:
            number = row["checkpoint"]
            head = chain.Head(row["entity"], str(row["entity_id"]), row["seq"], bytes(row["hash"]), row["at"])
            digests.setdefault(number, hashlib.sha256()).update(head.canonical() + b"\n")
            counts[number] = counts.get(number, 0) + 1
            result.heads += 1
            where = f"checkpoint {number}: the head of {head.entity} {head.entity_id} at seq {head.seq}"
            if row["event_hash"] is None:
                result.problems.append(f"{where} is no longer in the log (removed, or its time changed)")
            elif bytes(row["event_hash"]) != head.hash:
                result.problems.append(f"{where} has another hash in the log now: the chain was rewritten")
    for number, row in by_number.items():
        digest = digests[number].digest() if number in digests else hashlib.sha256().digest()
        if counts.get(number, 0) != row["heads"] or digest != bytes(row["heads_digest"]):
            result.problems.append(f"checkpoint {number}: its recorded heads are not the ones it signed")
