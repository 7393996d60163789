"""The notification use cases: an organisation's webhook endpoints and email addresses (register,
list, remove) and the delivery log of an endpoint. Addresses are checked here (the endpoint's
URL against server-side request forgery, the event types against the published list); an
endpoint's signing secret is generated here, stored encrypted and returned once."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from psycopg.rows import DictRow

from controlplane.core import webhook_signatures as signatures
from controlplane.core.refusals import NotFound
from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.runtime.secretbox import SecretBox
from controlplane.runtime.settings import NotificationSettings
from controlplane.services import notices

Kind = Literal["webhook", "email"]
NAMES = {"webhook": "webhook endpoint", "email": "notification email"}


@dataclass(frozen=True)
class NewTarget:
    org_id: uuid.UUID
    kind: Kind
    address: str
    event_types: Sequence[str]
    description: str = ""


@dataclass(frozen=True)
class Registered:
    target: DictRow
    # The webhook endpoint's signing secret: returned by the registration only.
    secret: str | None


async def register(
    conn: AsyncConn, asked: NewTarget, box: SecretBox, policy: NotificationSettings
) -> Registered:
    types = sorted(set(asked.event_types))
    notices.check_event_types(types)
    secret = None
    if asked.kind == "webhook":
        await asyncio.to_thread(notices.check_url, asked.address, policy)
        secret = signatures.new_secret()
    else:
        notices.check_email(asked.address)
    cursor = await conn.execute(
        sql.CREATE_NOTIFICATION_TARGET,
        {
            "org": asked.org_id,
            "kind": asked.kind,
            "address": asked.address,
            "event_types": types,
            "description": asked.description,
            "secret": box.encrypt(secret) if secret is not None else None,
        },
    )
    row = await cursor.fetchone()
    assert row is not None
    return Registered(row, secret)


async def page(
    conn: AsyncConn, org_id: uuid.UUID, kind: Kind, limit: int, after: tuple[datetime, uuid.UUID] | None
) -> list[DictRow]:
    cursor = await conn.execute(
        sql.NOTIFICATION_TARGETS_PAGE, {"org": org_id, "kind": kind, **_cursor(after), "limit": limit}
    )
    return await cursor.fetchall()


def _cursor(at: tuple[datetime, uuid.UUID] | None) -> dict[str, Any]:
    """The page statements' cursor parameters (both NULL: from the first row)."""
    return {"after_created": at[0] if at else None, "after_id": at[1] if at else None}


async def get(conn: AsyncConn, org_id: uuid.UUID, kind: Kind, target_id: uuid.UUID) -> DictRow:
    cursor = await conn.execute(sql.NOTIFICATION_TARGET, {"id": target_id, "org": org_id, "kind": kind})
    row = await cursor.fetchone()
    if row is None:
        raise NotFound(f"no {NAMES[kind]} {target_id}")
    return row


async def remove(conn: AsyncConn, org_id: uuid.UUID, kind: Kind, target_id: uuid.UUID) -> None:
    """Remove a target: nothing more is delivered to it (deliveries queued for it are dropped)."""
    cursor = await conn.execute(
        sql.DELETE_NOTIFICATION_TARGET, {"id": target_id, "org": org_id, "kind": kind}
    )
    if await cursor.fetchone() is None:
        raise NotFound(f"no {NAMES[kind]} {target_id}")


async def deliveries(
    conn: AsyncConn,
    org_id: uuid.UUID,
    target_id: uuid.UUID,
    limit: int,
    before: tuple[datetime, uuid.UUID] | None,
) -> list[DictRow]:
    """The delivery log of one of the organisation's webhook endpoints, newest first."""
    await get(conn, org_id, "webhook", target_id)
    cursor = await conn.execute(
        sql.DELIVERIES_PAGE, {"target": target_id, "org": org_id, **_cursor(before), "limit": limit}
    )
    return await cursor.fetchall()
