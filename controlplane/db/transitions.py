"""The one transition path: every state change of an instance or a job goes through `transition_many`."""

from __future__ import annotations

import json
import logging
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from psycopg.rows import DictRow

from controlplane.core import lifecycle
from controlplane.core.records import InstancePatch, JobPatch
from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.runtime import metrics

log = logging.getLogger(__name__)

ACTOR_KINDS = frozenset(
    {"customer", "admin", "worker", "supervisor", "reconciler", "stripe", "operator", "system"}
)


@dataclass(frozen=True)
class Actor:
    """Who caused a transition: recorded in every audit row."""

    kind: str
    id: str

    def __post_init__(self) -> None:
        if self.kind not in ACTOR_KINDS:
            raise ValueError(f"unknown actor kind {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.kind}:{self.id}"


# What a move writes beside the state: a typed patch, or its JSON as a mapping.
Patch = InstancePatch | JobPatch | Mapping[str, Any]


@dataclass(frozen=True)
class Move:
    """One requested transition: the row as the caller last saw it and the event to apply."""

    id: uuid.UUID
    expected_state: str
    expected_version: int
    event: str
    reason: str | None = None
    detail: Mapping[str, Any] | None = None
    patch: Patch = field(default_factory=dict)

    def patch_json(self) -> str:
        patch = self.patch if isinstance(self.patch, Mapping) else self.patch.to_json()
        return json.dumps(dict(patch))


class TransitionError(Exception):
    """Base of the ways a legal transition can fail to apply."""


class VersionConflict(TransitionError):
    """Someone else moved the row first: its state_version is no longer the expected one."""

    def __init__(self, entity: str, move: Move, current_state: str | None, current_version: int | None):
        self.entity = entity
        self.move = move
        self.current_state = current_state
        self.current_version = current_version
        where = (
            "no longer exists"
            if current_state is None
            else f"is now {current_state!r} at version {current_version}"
        )
        super().__init__(
            f"conflict: {entity} {move.id} expected {move.expected_state!r} at version "
            f"{move.expected_version} for {move.event!r}, but {where}"
        )


class InvariantViolation(TransitionError):
    """Same state_version, different state: the row was changed outside the transition path."""

    def __init__(self, entity: str, move: Move, current_state: str):
        self.entity = entity
        self.move = move
        self.current_state = current_state
        super().__init__(
            f"invariant violation: {entity} {move.id} is {current_state!r} at version "
            f"{move.expected_version}, but the transition path recorded {move.expected_state!r}"
        )


@dataclass
class BatchResult:
    moved: list[DictRow]
    failed: list[TransitionError]


def _params(entity: str, moves: Sequence[Move], actor: Actor, request_id: str | None) -> dict[str, Any]:
    table = lifecycle.lifecycle(entity)
    return {
        "ids": [m.id for m in moves],
        "versions": [m.expected_version for m in moves],
        "from_states": [m.expected_state for m in moves],
        "to_states": [table.apply(m.expected_state, m.event, m.id) for m in moves],
        "events": [m.event for m in moves],
        "reasons": [m.reason for m in moves],
        "details": [json.dumps(dict(m.detail)) if m.detail else None for m in moves],
        "patches": [m.patch_json() for m in moves],
        "actor_kind": actor.kind,
        "actor_id": actor.id,
        "request_id": request_id,
    }


async def transition_many(
    conn: AsyncConn,
    entity: str,
    moves: Sequence[Move],
    actor: Actor,
    *,
    request_id: str | None = None,
) -> BatchResult:
    """Apply many moves in one statement; each either moves (with its event row) or fails alone.

    Legality is decided in Python (IllegalTransition is raised before any SQL for the batch);
    the statement guards each row on id, state_version and state.
    """
    if not moves:
        return BatchResult([], [])
    try:
        params = _params(entity, moves, actor, request_id)
    except lifecycle.IllegalTransition as exc:
        metrics.ILLEGAL_TRANSITIONS.labels(entity, exc.state, exc.event).inc()
        raise
    if len(moves) == 1:
        one = {key: value[0] if isinstance(value, list) else value for key, value in params.items()}
        cursor = await conn.execute(sql.TRANSITION_ONE[entity], one, prepare=True)
    else:
        cursor = await conn.execute(sql.TRANSITION[entity], params, prepare=True)
    moved = await cursor.fetchall()
    for row in moved:
        observe_transition(entity, row)
    if len(moved) == len(moves):
        return BatchResult(moved, [])
    return BatchResult(moved, await _explain_misses(conn, entity, moves, moved))


def observe_transition(entity: str, row: DictRow) -> None:
    """Metrics of one applied transition: the move (and whether the lifecycle says it alerts), the
    time spent in the state it left."""
    metrics.TRANSITIONS.labels(entity, row["_from_state"], row["state"], row["_event"]).inc()
    if entity == "instance" and lifecycle.INSTANCE.alerts(row["_from_state"], row["_event"]):
        metrics.ALERTING_TRANSITIONS.labels(
            row["state"], row["_event"], row.get("failure_code") or "none"
        ).inc()
    metrics.TIME_IN_STATE.labels(entity, row["_from_state"]).observe(max(0.0, row["_dwell_s"]))
    if entity == "instance" and row["_event"] == "provisioned":
        metrics.PROVISIONING_DURATION.observe(max(0.0, row["_age_s"]))


async def _explain_misses(
    conn: AsyncConn, entity: str, moves: Sequence[Move], moved: list[DictRow]
) -> list[TransitionError]:
    # Match moved rows to moves one for one, so that a second move of the same row in one batch
    # is reported as failed rather than lost.
    landed = Counter(
        (row["id"], row["_event"], row["_from_state"], row["state_version"] - 1) for row in moved
    )
    missed: list[Move] = []
    for move in moves:
        key = (move.id, move.event, move.expected_state, move.expected_version)
        if landed[key]:
            landed[key] -= 1
        else:
            missed.append(move)
    cursor = await conn.execute(sql.CURRENT_STATES[entity], {"ids": [m.id for m in missed]})
    current = {row["id"]: row for row in await cursor.fetchall()}
    failures: list[TransitionError] = []
    for move in missed:
        row = current.get(move.id)
        if row is not None and row["state_version"] == move.expected_version:
            violation = InvariantViolation(entity, move, row["state"])
            log.critical("%s", violation, extra={"entity": entity, "entity_id": str(move.id)})
            metrics.INVARIANT_VIOLATIONS.labels(entity).inc()
            failures.append(violation)
        else:
            metrics.CONFLICTS.labels(entity, move.event).inc()
            failures.append(
                VersionConflict(
                    entity,
                    move,
                    None if row is None else row["state"],
                    None if row is None else row["state_version"],
                )
            )
    return failures


async def transition(
    conn: AsyncConn,
    entity: str,
    entity_id: uuid.UUID,
    event: str,
    expected_version: int,
    *,
    expected_state: str,
    actor: Actor,
    reason: str | None = None,
    detail: Mapping[str, Any] | None = None,
    patch: Patch | None = None,
    request_id: str | None = None,
) -> DictRow:
    """Move one row; return it as it is now, or raise VersionConflict, InvariantViolation or
    IllegalTransition."""
    move = Move(entity_id, expected_state, expected_version, event, reason, detail, patch or {})
    result = await transition_many(conn, entity, [move], actor, request_id=request_id)
    if result.failed:
        raise result.failed[0]
    return result.moved[0]


async def heartbeat(conn: AsyncConn, worker: str, holdings: Mapping[uuid.UUID, int]) -> set[uuid.UUID]:
    """Touch heartbeat_at of the jobs `worker` holds (id -> fence); return those still held."""
    if not holdings:
        return set()
    cursor = await conn.execute(
        sql.HEARTBEAT_JOBS,
        {"ids": list(holdings), "fences": list(holdings.values()), "worker": worker},
        prepare=True,
    )
    return {row["id"] for row in await cursor.fetchall() if holdings.get(row["id"]) == row["fence"]}
