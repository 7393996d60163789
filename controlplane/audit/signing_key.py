"""The audit log's signing key (Ed25519) as stored: made on first use, its private half encrypted by
the secret box; the public halves stored, by fingerprint (checking with one: `public_key`)."""

from __future__ import annotations

import base64
from dataclasses import dataclass

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from controlplane.audit.public_key import fingerprint, raw_public
from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.runtime.secretbox import SecretBox


@dataclass(frozen=True)
class SigningKey:
    fingerprint: str
    private: Ed25519PrivateKey

    @property
    def public_raw(self) -> bytes:
        return raw_public(self.private.public_key())

    def sign(self, message: bytes) -> bytes:
        return self.private.sign(message)


async def ensure_key(conn: AsyncConn, box: SecretBox) -> SigningKey:
    """The signing key, made and stored the first time (two processes racing store one: the
    table holds a single key)."""
    private = Ed25519PrivateKey.generate()
    raw = private.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    public = raw_public(private.public_key())
    await conn.execute(
        sql.STORE_SIGNING_KEY,
        {
            "fingerprint": fingerprint(public),
            "public": public,
            "private": box.encrypt(base64.b64encode(raw).decode()),
        },
    )
    cursor = await conn.execute(sql.SIGNING_KEY)
    row = await cursor.fetchone()
    assert row is not None
    stored = Ed25519PrivateKey.from_private_bytes(base64.b64decode(box.decrypt(row["private_key"])))
    if (
        raw_public(stored.public_key()) != bytes(row["public_key"])
        or fingerprint(bytes(row["public_key"])) != row["fingerprint"]
    ):
        raise ValueError(f"the stored signing key {row['fingerprint']} does not match its public key")
    return SigningKey(row["fingerprint"], stored)


async def public_keys(conn: AsyncConn) -> dict[str, Ed25519PublicKey]:
    """Every stored public key by fingerprint (what a verification trusts unless given its own)."""
    cursor = await conn.execute(sql.PUBLIC_KEYS)
    return {
        row["fingerprint"]: Ed25519PublicKey.from_public_bytes(bytes(row["public_key"]))
        for row in await cursor.fetchall()
    }
