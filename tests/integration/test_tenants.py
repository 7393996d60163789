"""Organisations and API keys: generation, hashing, constant-time authentication, revocation, CLI."""

from __future__ import annotations

import hashlib

import pytest

from controlplane.db.connection import AsyncConn
from controlplane.services import tenants


def test_keys_have_a_prefix_and_256_random_bits() -> None:
    prefix, key = tenants.generate_key()
    scheme, key_prefix, secret = key.split("_", 2)
    assert scheme == "cpk" and key_prefix == prefix and len(prefix) == 12
    assert len(secret) >= 43  # 32 bytes of urlsafe base64
    assert tenants.split_key(key) == prefix
    assert tenants.generate_key()[1] != key
    for bad in ("", "cpk", "cpk_short_x", "xyz_" + prefix + "_abc", f"cpk_{prefix}_"):
        assert tenants.split_key(bad) is None


async def test_org_and_first_key_are_stored_hashed_and_authenticate(conn: AsyncConn) -> None:
    org, key = await tenants.create_org(conn, "acme", "cus_123")
    assert org["name"] == "acme" and org["stripe_customer_id"] == "cus_123" and not org["billing_hold"]
    cursor = await conn.execute(
        "SELECT prefix, key_hash, is_admin FROM api_keys WHERE org_id = %s", (org["id"],)
    )
    row = await cursor.fetchone()
    assert row is not None and not row["is_admin"]
    assert bytes(row["key_hash"]) == hashlib.sha256(key.plaintext.encode()).digest()
    assert key.plaintext.encode() not in bytes(row["key_hash"])
    who = await tenants.authenticate(conn, key.plaintext)
    assert who == tenants.Principal(key.id, org["id"], False)
    assert await tenants.authenticate(conn, key.plaintext[:-1] + "x") is None
    assert await tenants.authenticate(conn, "cpk_000000000000_nope") is None


async def test_duplicate_org_name_or_customer_is_refused(conn: AsyncConn) -> None:
    await tenants.create_org(conn, "acme", "cus_1")
    with pytest.raises(tenants.OrgExists, match="name"):
        await tenants.create_org(conn, "acme", "cus_2")
    with pytest.raises(tenants.OrgExists, match="Stripe customer"):
        await tenants.create_org(conn, "other", "cus_1")


async def test_revoked_key_no_longer_authenticates(conn: AsyncConn) -> None:
    org, key = await tenants.create_org(conn, "acme")
    other, _ = await tenants.create_org(conn, "globex")
    assert not await tenants.revoke_key(conn, key.id, other["id"])  # not another org's key
    assert await tenants.revoke_key(conn, key.id, org["id"])
    assert await tenants.authenticate(conn, key.plaintext) is None
    assert not await tenants.revoke_key(conn, key.id, org["id"])


async def test_ensure_admin_key_creates_one_only_on_first_start(conn: AsyncConn) -> None:
    first = await tenants.ensure_admin_key(conn)
    assert first is not None
    assert await tenants.ensure_admin_key(conn) is None
    who = await tenants.authenticate(conn, first)
    assert who is not None and who.is_admin and who.org_id is None
