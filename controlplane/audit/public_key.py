"""The audit log's public key, pure: its fingerprint, its PEM, and checking a signature with it.

What an auditor needs to check checkpoints and exports: no database, no secret key. The private
half, made and stored once, is `controlplane.audit.signing_key`'s."""

from __future__ import annotations

import hashlib

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey


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
