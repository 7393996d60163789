"""Organisations and their API keys: creation, hashing, authentication and revocation."""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import uuid
from dataclasses import dataclass
from datetime import datetime

from psycopg.rows import DictRow

from controlplane.core.refusals import Conflict, LimitReached, NotFound
from controlplane.core.refusals import OrgExists as OrgExists
from controlplane.db import connection as db
from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.db.constraints import unique_violations
from controlplane.services.billing import apply_on_mapping

log = logging.getLogger(__name__)

KEY_SCHEME = "cpk"
# The public part of a key (looked up in the database) and the secret part (256 random bits).
PREFIX_BYTES = 6
SECRET_BYTES = 32
# Serialises first-start admin key creation across replicas.
ADMIN_KEY_LOCK = 0x6370_6B65_7900_0001


class TenantError(Exception):
    """A tenant operation that cannot be carried out as asked."""


@dataclass(frozen=True)
class NewKey:
    """A freshly created key: its row and the plaintext, which is never shown again."""

    id: uuid.UUID
    prefix: str
    plaintext: str
    org_id: uuid.UUID | None
    is_admin: bool


@dataclass(frozen=True)
class Principal:
    """Who is calling: an organisation's key or an admin key."""

    key_id: uuid.UUID
    org_id: uuid.UUID | None
    is_admin: bool


def hash_key(plaintext: str) -> bytes:
    """SHA-256 of the whole key: enough for 256-bit random secrets (no dictionary to attack)."""
    return hashlib.sha256(plaintext.encode()).digest()


def generate_key() -> tuple[str, str]:
    """A new (prefix, plaintext) pair: `cpk_<prefix>_<secret>`."""
    prefix = secrets.token_hex(PREFIX_BYTES)
    plaintext = f"{KEY_SCHEME}_{prefix}_{secrets.token_urlsafe(SECRET_BYTES)}"
    return prefix, plaintext


def split_key(plaintext: str) -> str | None:
    """The prefix of a well-formed key, else None."""
    parts = plaintext.split("_", 2)
    if len(parts) != 3 or parts[0] != KEY_SCHEME or len(parts[1]) != 2 * PREFIX_BYTES or not parts[2]:
        return None
    return parts[1]


async def create_key(
    conn: AsyncConn,
    org_id: uuid.UUID | None,
    *,
    is_admin: bool = False,
    name: str = "",
    max_per_org: int | None = None,
) -> NewKey:
    """A new key of the organisation (or an admin key). With `max_per_org`, an organisation that
    holds that many live keys gets none (LimitReached), and one that does not exist NotFound."""
    if (org_id is None) != is_admin:
        raise TenantError("a key belongs to exactly one organisation, or is an admin key")
    if org_id is None or max_per_org is None:
        return await _insert_key(conn, org_id, is_admin, name)
    async with db.transaction(conn):
        # Locked first, counted after (a statement of its own, so it sees the key the previous
        # holder of the lock committed).
        if await (await conn.execute(sql.LOCK_ORGANISATION, {"id": org_id})).fetchone() is None:
            raise NotFound(f"no organisation {org_id}")
        row = await (await conn.execute(sql.COUNT_LIVE_KEYS, {"org": org_id})).fetchone()
        if row is not None and row["n"] >= max_per_org:
            raise LimitReached(
                f"the organisation holds {row['n']} live API keys, the most it may; revoke one first"
            )
        return await _insert_key(conn, org_id, is_admin, name)


async def _insert_key(conn: AsyncConn, org_id: uuid.UUID | None, is_admin: bool, name: str) -> NewKey:
    prefix, plaintext = generate_key()
    cursor = await conn.execute(
        sql.CREATE_API_KEY,
        {
            "org_id": org_id,
            "is_admin": is_admin,
            "prefix": prefix,
            "key_hash": hash_key(plaintext),
            "name": name,
        },
    )
    row = await cursor.fetchone()
    assert row is not None
    return NewKey(row["id"], prefix, plaintext, org_id, is_admin)


async def create_org(
    conn: AsyncConn, name: str, stripe_customer_id: str | None = None
) -> tuple[DictRow, NewKey]:
    """Create an organisation and its first key in one transaction (OrgExists if the name or the
    Stripe customer is taken)."""
    with unique_violations(name=name):
        async with conn.transaction():
            cursor = await conn.execute(
                sql.CREATE_ORGANISATION, {"name": name, "stripe_customer_id": stripe_customer_id}
            )
            org = await cursor.fetchone()
            assert org is not None
            key = await _insert_key(conn, org["id"], False, "first key")
            linked = stripe_customer_id is not None
            if linked and await apply_on_mapping(conn, org["id"], str(stripe_customer_id)) is not None:
                cursor = await conn.execute(sql.ORGANISATION_BY_ID, {"id": org["id"]})
                org = await cursor.fetchone()
                assert org is not None
    return org, key


async def link_stripe_customer(conn: AsyncConn, org_id: uuid.UUID, customer_id: str) -> DictRow:
    """Link an organisation made without one to its Stripe customer: from then on its usage is
    reported to that customer and the customer's subscription events apply to it, the newest
    decisive one recorded before the link included (as at creation). Linking the customer it has
    already changes nothing; NotFound without the organisation; Conflict when it is linked to
    another customer (a link is not moved: usage already reported stays with its customer);
    OrgExists when another organisation has this customer."""
    with unique_violations(stripe_customer_id=customer_id):
        async with conn.transaction():
            cursor = await conn.execute(sql.LOCK_ORGANISATION_FOR_LINK, {"id": org_id})
            org = await cursor.fetchone()
            if org is None:
                raise NotFound(f"no organisation {org_id}")
            linked = org["stripe_customer_id"]
            if linked == customer_id:
                return org
            if linked is not None:
                raise Conflict(
                    f"organisation {org['name']} is linked to Stripe customer {linked} already;"
                    " a link is not moved to another customer"
                )
            await conn.execute(sql.LINK_STRIPE_CUSTOMER, {"id": org_id, "customer": customer_id})
            await apply_on_mapping(conn, org_id, customer_id)
            cursor = await conn.execute(sql.ORGANISATION_BY_ID, {"id": org_id})
            org = await cursor.fetchone()
            assert org is not None
    log.info("organisation %s linked to Stripe customer %s", org["name"], customer_id)
    return org


async def create_admin_key(conn: AsyncConn, name: str = "admin") -> NewKey:
    return await create_key(conn, None, is_admin=True, name=name)


async def ensure_admin_key(conn: AsyncConn) -> str | None:
    """Create an admin key if none is live; return its plaintext only then (print it once)."""
    async with conn.transaction():
        await conn.execute(sql.LOCK_ADMIN_KEY_CREATION, {"key": ADMIN_KEY_LOCK})
        cursor = await conn.execute(sql.ANY_LIVE_ADMIN_KEY)
        if await cursor.fetchone() is not None:
            return None
        key = await create_admin_key(conn, name="first admin key")
    return key.plaintext


async def authenticate(conn: AsyncConn, plaintext: str) -> Principal | None:
    """The principal of a live key, compared in constant time; None for anything else."""
    prefix = split_key(plaintext)
    if prefix is None:
        return None
    cursor = await conn.execute(sql.LIVE_KEY_BY_PREFIX, {"prefix": prefix})
    row = await cursor.fetchone()
    presented = hash_key(plaintext)
    stored = bytes(row["key_hash"]) if row is not None else hash_key(secrets.token_hex(8))
    if not hmac.compare_digest(presented, stored) or row is None:
        return None
    return Principal(row["id"], row["org_id"], row["is_admin"])


async def revoke_key(conn: AsyncConn, key_id: uuid.UUID, org_id: uuid.UUID | None) -> bool:
    """Revoke a key of `org_id` (any key when org_id is None); False if there is no such live key."""
    cursor = await conn.execute(sql.REVOKE_API_KEY, {"id": key_id, "org": org_id})
    return await cursor.fetchone() is not None


async def list_keys(
    conn: AsyncConn,
    org_id: uuid.UUID,
    *,
    limit: int,
    after: tuple[datetime, uuid.UUID] | None = None,
) -> list[DictRow]:
    """Up to `limit` of the organisation's keys (revoked ones too), oldest first, after `after`
    (the created_at and id of the last key of the page before)."""
    after_created, after_id = after or (None, None)
    cursor = await conn.execute(
        sql.LIST_API_KEYS,
        {"org": org_id, "after_created": after_created, "after_id": after_id, "limit": limit},
    )
    return await cursor.fetchall()


async def get_org(conn: AsyncConn, org_id: uuid.UUID) -> DictRow | None:
    cursor = await conn.execute(sql.ORGANISATION_BY_ID, {"id": org_id})
    return await cursor.fetchone()


async def list_orgs(conn: AsyncConn, name: str | None = None, limit: int = 1000) -> list[DictRow]:
    """The organisations, oldest first (only the one named `name` when given)."""
    cursor = await conn.execute(sql.LIST_ORGANISATIONS, {"name": name, "limit": limit})
    return await cursor.fetchall()
