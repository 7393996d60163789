"""Idempotency-Key for creating requests: per-organisation keys, stored answers, lazy expiry.

Every entry point that creates (the API's routes, the console's forms) runs its use case through
`once_per_key`, so a retried request answers the first one's stored answer instead of creating twice.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from psycopg_pool import AsyncConnectionPool

from controlplane.core.refusals import IdempotencyInFlight, IdempotencyMismatch, InvalidRequest
from controlplane.db import connection as db
from controlplane.db import sql
from controlplane.db.connection import AsyncConn

# Keys are kept at least this long; older ones are purged lazily by later requests.
RETENTION_S = 24 * 3600
PURGE_BATCH = 100
MAX_KEY_LENGTH = 255


@dataclass(frozen=True)
class StoredResponse:
    status_code: int
    body: Any
    headers: dict[str, str]


@dataclass(frozen=True)
class Keyed:
    """A creating request's Idempotency-Key (None: none) and the digest of what it asked."""

    key: str | None
    digest: str


@dataclass(frozen=True)
class Answer:
    """The answer to a creating request: the one its use case just gave, or (`replayed`) the one
    stored for its Idempotency-Key."""

    response: StoredResponse
    replayed: bool


async def once_per_key(
    pool: AsyncConnectionPool[AsyncConn],
    org_id: uuid.UUID,
    keyed: Keyed,
    run: Callable[[AsyncConn], Awaitable[StoredResponse]],
) -> Answer:
    """Run a creating use case (`run`, which answers) in one transaction with its key's record:
    the same key and request again answers what was stored. The transaction runs again if it
    loses a race. Without a key, `run` runs once."""
    key, digest = keyed.key, keyed.digest
    if key is not None:
        check_key(key)

    async def once(conn: AsyncConn) -> Answer:
        if key is not None:
            stored = await begin(conn, org_id, key, digest)
            if stored is not None:
                return Answer(stored, replayed=True)
        response = await run(conn)
        if key is not None:
            await save(conn, org_id, key, digest, response)
        return Answer(response, replayed=False)

    return await db.in_transaction(pool, once)


def request_hash(method: str, path: str, body: Mapping[str, Any]) -> str:
    canonical = json.dumps([method, path, body], sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def check_key(key: str) -> str:
    if not (1 <= len(key) <= MAX_KEY_LENGTH) or not key.isprintable() or not key.isascii():
        raise InvalidRequest(
            "idempotency-key", f"must be 1 to {MAX_KEY_LENGTH} printable ASCII characters", location="header"
        )
    return key


async def begin(conn: AsyncConn, org_id: uuid.UUID, key: str, digest: str) -> StoredResponse | None:
    """In the caller's transaction: claim the key, or return the response stored for it.

    A concurrent request holding the same key is refused (409); the same key with another
    request is refused (422). The claim is a transaction-scoped advisory lock, so it ends with
    the transaction whether it commits (and stores the response) or rolls back (and stores nothing).
    """
    cursor = await conn.execute(sql.TRY_IDEMPOTENCY_LOCK, {"lock": f"idempotency:{org_id}:{key}"})
    row = await cursor.fetchone()
    if row is None or not row["locked"]:
        raise IdempotencyInFlight("a request with this Idempotency-Key is still being processed")
    await _purge(conn)
    cursor = await conn.execute(sql.STORED_RESPONSE, {"org": org_id, "key": key, "retention_s": RETENTION_S})
    stored = await cursor.fetchone()
    if stored is None:
        return None
    if stored["request_hash"] != digest:
        raise IdempotencyMismatch("this Idempotency-Key was used with a different request body")
    return StoredResponse(stored["status_code"], stored["response"], dict(stored["headers"]))


async def save(conn: AsyncConn, org_id: uuid.UUID, key: str, digest: str, response: StoredResponse) -> None:
    await conn.execute(
        sql.SAVE_RESPONSE,
        {
            "org": org_id,
            "key": key,
            "hash": digest,
            "status": response.status_code,
            "response": json.dumps(response.body, default=str),
            "headers": json.dumps(response.headers),
        },
    )


async def _purge(conn: AsyncConn) -> None:
    """Delete a bounded batch of expired keys (skipping rows another purge holds)."""
    await conn.execute(sql.PURGE_IDEMPOTENCY_KEYS, {"retention_s": RETENTION_S, "limit": PURGE_BATCH})
