"""The audit log's signing key (Ed25519): made on first use, its private half stored encrypted by
the secret box, its public half exportable for auditors."""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.runtime.secretbox import SecretBox


class BadPublicKey(ValueError):
    """A public key file that is not an Ed25519 public key."""


def fingerprint(public_raw: bytes) -> str:
    """How checkpoints and exports name the key: the first 16 bytes of SHA-256 of its raw bytes, hex."""
    return hashlib.sha256(public_raw).hexdigest()[:32]


def raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def public_pem(public_raw: bytes) -> str:
    key = Ed25519PublicKey.from_public_bytes(public_raw)
    return key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()


def load_public_pem(data: bytes) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError as exc:
        raise BadPublicKey(f"not a PEM public key: {exc}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise BadPublicKey("not an Ed25519 public key")
    return key


def verifies(key: Ed25519PublicKey, signature: bytes, message: bytes) -> bool:
    try:
        key.verify(bytes(signature), message)
    except InvalidSignature:
        return False
    return True


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
