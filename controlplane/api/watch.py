"""Server-Sent Events of one instance's transitions and steps: one LISTEN connection per API
process (`Hub`) fans the cp_instance_<state> and step notifications out to every watch stream of
the process.

A stream ends after a terminal state, when its client leaves, and at once when the process shuts
down (`Hub.close`): the client reconnects, to this process or another, with `Last-Event-ID` (the
last state_version it saw) and gets the transitions it missed from the audit log, then live ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic_core import to_jsonable_python
from starlette.requests import Request
from starlette.responses import StreamingResponse

from controlplane.api import views
from controlplane.api.hub import APPLICATION_NAME, CLOSED, Changed, Closed, Note, Stepped, Transitioned
from controlplane.api.state import AppState, app_state
from controlplane.core import failures, lifecycle
from controlplane.core.kinds import STEP_LABELS
from controlplane.core.records import Instance, StepRecord
from controlplane.db import sql
from controlplane.queue import steps
from controlplane.services import instances

__all__ = [
    "APPLICATION_NAME",
    "instance_stream",
    "org_response",
    "org_stream",
    "parse_last_event_id",
    "response",
    "sse",
]

KEEPALIVE_S = 15.0
# How many instance ids an organisation's stream remembers as its own or another's.
KNOWN_IDS = 10_000
# How a client waits before it reconnects after a stream ended without a terminal state (ms).
RECONNECT_MS = 1000


def sse(event: str, data: Any, event_id: int | None = None) -> bytes:
    lines = [f"event: {event}"]
    if event_id is not None:
        lines.append(f"id: {event_id}")
    # As the REST answers write them (pydantic's JSON): times in RFC 3339 (`2026-12-02T02:29:42Z`).
    lines.append("data: " + json.dumps(to_jsonable_python(data), separators=(",", ":")))
    return ("\n".join(lines) + "\n\n").encode()


def parse_last_event_id(header: str | None) -> int | None:
    """The state_version a reconnecting client saw last (its Last-Event-ID), if it is one."""
    value = (header or "").strip()
    return int(value) if value.isdigit() and len(value) < 19 else None


async def _snapshot(app: AppState, instance_id: uuid.UUID, org_id: uuid.UUID) -> Any:
    async with app.pool.connection() as conn:
        cursor = await conn.execute(sql.ORG_INSTANCE, {"id": instance_id, "org": org_id})
        row = await cursor.fetchone()
        return None if row is None else await views.one_instance(conn, Instance.from_row(row), app.box)


async def _step_event(
    app: AppState, instance_id: uuid.UUID, org_id: uuid.UUID, step_id: int
) -> dict[str, Any] | None:
    """The `step` event of one step record: what happened, and the instance's progress after it."""
    async with app.pool.connection() as conn:
        cursor = await conn.execute(sql.STEP_BY_ID, {"id": step_id, "instance_id": instance_id})
        row = await cursor.fetchone()
        cursor = await conn.execute(sql.ORG_INSTANCE, {"id": instance_id, "org": org_id})
        found = await cursor.fetchone()
        if row is None or found is None:
            return None
        inst = Instance.from_row(found)
        # As of this step: the records after it are left out (the state may have moved on since).
        moving = await steps.progress_of(conn, [inst], through_step=step_id)
    step = StepRecord.from_row(row)
    code = step.code if step.event == "failed" else None
    return {
        "instance_id": step.instance_id,
        "job_id": step.job_id,
        "operation": step.kind,
        "step": step.step,
        "label": STEP_LABELS.get(step.step, step.step),
        "event": step.event,
        "attempt": step.attempt,
        "at": step.at,
        "duration_s": None
        if step.started_at is None
        else round((step.at - step.started_at).total_seconds(), 3),
        "failure": None if code is None else failures.reason(code).as_dict(),
        "progress": moving.get(inst.id),
    }


async def _missed(app: AppState, instance_id: uuid.UUID, org_id: uuid.UUID, after: int) -> list[Transitioned]:
    """The instance's transitions after state_version `after`, from its audit log."""
    async with app.pool.connection() as conn:
        cursor = await conn.execute(
            sql.ORG_INSTANCE_MOVES_AFTER, {"id": instance_id, "org": org_id, "after": after}
        )
        return [Transitioned(row["to_state"], row["state_version"]) for row in await cursor.fetchall()]


def _transition(instance_id: uuid.UUID, moved: Transitioned) -> bytes:
    data = {"id": str(instance_id), "state": moved.state, "state_version": moved.state_version}
    return sse("transition", data, moved.state_version)


async def instance_stream(
    app: AppState,
    request: Request,
    instance_id: uuid.UUID,
    org_id: uuid.UUID,
    *,
    resume_after: int | None = None,
    keepalive_s: float = KEEPALIVE_S,
) -> AsyncIterator[bytes]:
    """A snapshot event (or, resuming after `resume_after`, the transitions since), then one
    `transition` event per state change and one `step` event per step record; ends after a
    terminal state, when the client leaves, and when the process shuts down.

    The stream follows the instance before it reads the snapshot, so no transition falls between
    the two; a notification at or below the last state_version sent is skipped. A step event
    carries the progress as of its reading (a reconnecting client gets it in the snapshot).
    """
    async with contextlib.AsyncExitStack() as stack:
        try:
            assert app.watchers is not None, "the application's lifespan makes its hub"
            queue = await stack.enter_async_context(app.watchers.follow(instance_id))
        except (Closed, TimeoutError):  # shutting down, or not listening yet: come back shortly
            yield f"retry: {RECONNECT_MS}\n\n".encode()
            return
        snapshot = await _snapshot(app, instance_id, org_id)
        yield f"retry: {RECONNECT_MS}\n\n".encode()
        if snapshot is None:
            return
        state, last = str(snapshot["state"]), int(snapshot["state_version"])
        if resume_after is None or resume_after > last:
            yield sse("instance", snapshot, last)
        else:
            state, last, sent = await _catch_up(app, instance_id, org_id, state, resume_after)
            for chunk in sent:
                yield chunk
        if state in lifecycle.INSTANCE.terminal:
            return
        async for note in _notes(queue, request, keepalive_s):
            if isinstance(note, bytes):
                yield note
            elif isinstance(note, Stepped):
                event = await _step_event(app, instance_id, org_id, note.step_id)
                if event is not None:
                    yield sse("step", event)
            elif isinstance(note, Transitioned):
                if note.state_version > last:
                    state, last = note.state, note.state_version
                    yield _transition(instance_id, note)
            else:
                state, last, sent = await _catch_up(app, instance_id, org_id, state, last)
                for chunk in sent:
                    yield chunk
            if state in lifecycle.INSTANCE.terminal:
                return


async def _notes(
    queue: asyncio.Queue[Note], request: Request, keepalive_s: float
) -> AsyncIterator[Note | bytes]:
    """A stream's notes, and a keepalive comment after each `keepalive_s` without one; ends when
    the client has gone or the process shuts down (CLOSED)."""
    while True:
        try:
            async with asyncio.timeout(keepalive_s):
                note = await queue.get()
        except TimeoutError:
            if await request.is_disconnected():
                return
            yield b": keepalive\n\n"
            continue
        if note is CLOSED:
            return
        yield note


async def _catch_up(
    app: AppState, instance_id: uuid.UUID, org_id: uuid.UUID, state: str, last: int
) -> tuple[str, int, list[bytes]]:
    """The events of the transitions after `last` (from the audit log), and where they leave it."""
    chunks = []
    for moved in await _missed(app, instance_id, org_id, last):
        state, last = moved.state, moved.state_version
        chunks.append(_transition(instance_id, moved))
    return state, last, chunks


async def response(
    request: Request, org_id: uuid.UUID, instance_id: uuid.UUID, last_event_id: str | None = None
) -> StreamingResponse:
    """The watch stream of an organisation's instance (NotFound if it has none of that id), from
    after `last_event_id` when a client resumes."""
    app = app_state(request)
    async with app.pool.connection() as conn:
        await instances.load(conn, org_id, instance_id)
    resume_after = parse_last_event_id(last_event_id)
    return _events(instance_stream(app, request, instance_id, org_id, resume_after=resume_after))


async def org_stream(
    app: AppState, request: Request, org_id: uuid.UUID, *, keepalive_s: float = KEEPALIVE_S
) -> AsyncIterator[bytes]:
    """The changes of an organisation's instances: a `list` event first (and again whenever
    notifications may have been missed: read the list again), then one `transition` event per state
    change of any of its instances, a new one's creation included. Ends when the client leaves or
    the process shuts down (the client reconnects and gets `list` again)."""
    async with contextlib.AsyncExitStack() as stack:
        try:
            assert app.watchers is not None, "the application's lifespan makes its hub"
            queue = await stack.enter_async_context(app.watchers.follow_all())
        except (Closed, TimeoutError):
            yield f"retry: {RECONNECT_MS}\n\n".encode()
            return
        yield f"retry: {RECONNECT_MS}\n\n".encode()
        yield sse("list", {})
        ours: dict[str, bool] = {}  # instance id -> whether it is this organisation's
        async for note in _notes(queue, request, keepalive_s):
            if isinstance(note, bytes):
                yield note
                continue
            if not isinstance(note, Changed):  # notifications were missed: the list, read again
                yield sse("list", {})
                continue
            if note.instance_id not in ours:
                if len(ours) >= KNOWN_IDS:
                    ours.clear()
                ours[note.instance_id] = await _is_of(app, note.instance_id, org_id)
            if ours[note.instance_id]:
                data = {"id": note.instance_id, "state": note.state, "state_version": note.state_version}
                yield sse("transition", data)


async def _is_of(app: AppState, instance_id: str, org_id: uuid.UUID) -> bool:
    try:
        wanted = uuid.UUID(instance_id)
    except ValueError:
        return False
    async with app.pool.connection() as conn:
        cursor = await conn.execute(sql.ORG_INSTANCE, {"id": wanted, "org": org_id})
        return await cursor.fetchone() is not None


def org_response(request: Request, org_id: uuid.UUID) -> StreamingResponse:
    """The stream of an organisation's instances' changes (the console's list follows it)."""
    return _events(org_stream(app_state(request), request, org_id))


def _events(stream: AsyncIterator[bytes]) -> StreamingResponse:
    """A stream of Server-Sent Events, past any proxy's buffer and never cached."""
    return StreamingResponse(
        stream,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
