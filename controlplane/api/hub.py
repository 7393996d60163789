"""The API process's one LISTEN connection on the cp_instance_<state> channels and the step channel,
fanned out to the queues of its watch streams (`controlplane.api.watch`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
from psycopg.conninfo import make_conninfo

from controlplane.db import connection as db
from controlplane.db import sql

log = logging.getLogger(__name__)

# How the LISTEN connection shows in pg_stat_activity.
APPLICATION_NAME = "controlplane-watch"
# Notifications a stream may fall behind by before it reads the audit log instead.
QUEUE_SIZE = 256
# How long a new stream waits for the process's LISTEN connection (else it is told to come back).
LISTENING_WAIT_S = 5.0


@dataclass(frozen=True)
class Transitioned:
    """An instance reached `state` at `state_version` (a transition notification)."""

    state: str
    state_version: int


@dataclass(frozen=True)
class Stepped:
    """A step record of the instance was written (a step notification)."""

    step_id: int


@dataclass(frozen=True)
class Changed:
    """Some instance moved (what a follower of every instance gets: an organisation's list)."""

    instance_id: str
    state: str
    state_version: int


class Signal:
    """Not a transition: RESYNC (notifications may have been missed: read the audit log) or
    CLOSED (the process shuts down: end the stream, the client reconnects)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


RESYNC = Signal("RESYNC")
CLOSED = Signal("CLOSED")
Note = Transitioned | Stepped | Changed | Signal


class Closed(Exception):
    """The hub is closed: the process is shutting down."""


def parse_notification(channel: str, payload: str) -> tuple[str, str, int] | None:
    """(instance id, state, state_version) of a transition notification, or None if malformed."""
    instance_id, _, version = payload.partition(":")
    if not channel.startswith(sql.INSTANCE_CHANNEL_PREFIX) or not version.isdigit():
        return None
    return instance_id, channel.removeprefix(sql.INSTANCE_CHANNEL_PREFIX), int(version)


def parse_step_notification(channel: str, payload: str) -> tuple[str, int] | None:
    """(instance id, step record id) of a step notification, or None if it is not one."""
    instance_id, _, step_id = payload.partition(":")
    if channel != sql.STEP_CHANNEL or not step_id.isdigit():
        return None
    return instance_id, int(step_id)


class Hub:
    """The process's one LISTEN connection (opened with the first stream, kept until `close`), and
    the queues of the streams that follow each instance. A lost connection is opened again; the
    streams then read what they missed from the audit log."""

    def __init__(self, database_url: str) -> None:
        self.conninfo = make_conninfo(database_url, application_name=APPLICATION_NAME)
        self._queues: dict[str, set[asyncio.Queue[Note]]] = {}
        # The queues of the streams that follow every instance (each picks its organisation's).
        self._everything: set[asyncio.Queue[Note]] = set()
        self._listening = asyncio.Event()
        self._closed = False
        self._task: asyncio.Task[None] | None = None

    @property
    def streams(self) -> int:
        return sum(len(queues) for queues in self._queues.values()) + len(self._everything)

    async def _started(self) -> None:
        """Listening (the connection opened with the first stream), else Closed or TimeoutError."""
        if self._closed:
            raise Closed
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._listen(), name="watch-listen")
        async with asyncio.timeout(LISTENING_WAIT_S):
            await self._listening.wait()

    @contextlib.asynccontextmanager
    async def follow_all(self) -> AsyncIterator[asyncio.Queue[Note]]:
        """A queue of every instance's transitions (`Changed`) from now on, once the process listens."""
        await self._started()
        queue = asyncio.Queue[Note](QUEUE_SIZE)
        self._everything.add(queue)
        try:
            yield queue
        finally:
            self._everything.discard(queue)

    @contextlib.asynccontextmanager
    async def follow(self, instance_id: uuid.UUID) -> AsyncIterator[asyncio.Queue[Note]]:
        """A queue of the instance's transitions from now on (once the process listens)."""
        await self._started()
        key, queue = str(instance_id), asyncio.Queue[Note](QUEUE_SIZE)
        self._queues.setdefault(key, set()).add(queue)
        try:
            yield queue
        finally:
            queues = self._queues.get(key, set())
            queues.discard(queue)
            if not queues:
                self._queues.pop(key, None)

    async def close(self) -> None:
        """End every stream now (each is told CLOSED) and stop listening; no stream starts after."""
        self._closed = True
        self._to_all(CLOSED)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _listen(self) -> None:
        delay = 0.1
        while not self._closed:
            try:
                conn = await db.connect(self.conninfo)
                try:
                    await conn.execute(sql.LISTEN_INSTANCE_CHANNELS + "; " + sql.LISTEN_STEP_CHANNEL)
                    self._listening.set()
                    delay = 0.1
                    self._to_all(RESYNC)  # what moved while nobody listened is in the audit log
                    async for notification in conn.notifies():
                        self._dispatch(notification.channel, notification.payload)
                finally:
                    self._listening.clear()
                    with anyio.CancelScope(shield=True):
                        await conn.close()
            except Exception as exc:  # streams read the audit log once it listens again
                log.warning("watch: the LISTEN connection was lost (%s); listening again", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _dispatch(self, channel: str, payload: str) -> None:
        note: Note
        stepped = parse_step_notification(channel, payload)
        if stepped is not None:
            instance_id, note = stepped[0], Stepped(stepped[1])
        else:
            parsed = parse_notification(channel, payload)
            if parsed is None:
                return
            instance_id, note = parsed[0], Transitioned(parsed[1], parsed[2])
            for queue in self._everything:
                _put(queue, Changed(instance_id, parsed[1], parsed[2]))
        for queue in self._queues.get(instance_id, ()):
            _put(queue, note)

    def _to_all(self, note: Note) -> None:
        for queues in [*self._queues.values(), self._everything]:
            for queue in queues:
                _put(queue, note)


def _put(queue: asyncio.Queue[Note], note: Note) -> None:
    """Queue a note; a stream that fell behind gets RESYNC instead (it reads the audit log)."""
    if queue.full():
        closing = any(item is CLOSED for item in queue._queue)  # type: ignore[attr-defined]
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(CLOSED if closing or note is CLOSED else RESYNC)
        return
    queue.put_nowait(note)
