"""Replay check: rebuilding every instance and job from its event log must give the current row."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from controlplane import lifecycle, sql
from controlplane.db import AsyncConn


@dataclass(frozen=True)
class Mismatch:
    entity: str
    entity_id: Any
    problem: str

    def __str__(self) -> str:
        return f"{self.entity} {self.entity_id}: {self.problem}"


@dataclass
class Replay:
    """The state rebuilt from one entity's events, and what was wrong on the way."""

    state: str | None = None
    version: int | None = None
    problems: list[str] | None = None

    def fail(self, problem: str) -> None:
        self.problems = [*(self.problems or []), problem]

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


async def _rows(conn: AsyncConn, entity: str) -> AsyncIterator[dict[str, Any]]:
    async with conn.cursor(name=f"replay_{entity}") as cursor:
        await cursor.execute(sql.REPLAY_LOG[entity])
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


async def verify(conn: AsyncConn) -> list[Mismatch]:
    """Replay every instance's and job's events; return each mismatch with its current row.

    Runs in one read-only repeatable-read transaction so the rows and the logs agree in time.
    """
    mismatches: list[Mismatch] = []
    async with conn.transaction():
        await conn.execute(sql.READ_ONLY_SNAPSHOT)
        for entity, table in lifecycle.LIFECYCLES.items():
            current_id: Any = None
            current: tuple[str, int] = ("", 0)
            replay = Replay()
            async for row in _rows(conn, entity):
                if row["entity_id"] != current_id:
                    if current_id is not None:
                        mismatches += _finish(entity, current_id, replay, current)
                    current_id, replay = row["entity_id"], Replay()
                    current = (row["current_state"], row["current_version"])
                if row["id"] is not None:
                    replay.step(table, row)
            if current_id is not None:
                mismatches += _finish(entity, current_id, replay, current)
    return mismatches
