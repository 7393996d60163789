"""Signatures of webhook deliveries (pure), in two schemes each delivery carries both of.

Standard Webhooks (standardwebhooks.com): `webhook-id`, `webhook-timestamp` and
`webhook-signature: v1,<base64>`, the HMAC-SHA256 of "<id>.<timestamp>.<body>" keyed by the
base64-decoded part of the secret after `whsec_`: the event id is signed too, and any Standard
Webhooks library verifies it. The Stripe-like `Controlplane-Signature: t=<unix>,v1=<hex>`, the
HMAC-SHA256 of "<t>.<body>" keyed by the whole secret, which `verify` checks. Either way the
signature must match and the timestamp be within the tolerance, which stops a captured delivery
being replayed later.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets

SIGNATURE_HEADER = "Controlplane-Signature"
EVENT_ID_HEADER = "Controlplane-Event-Id"
EVENT_TYPE_HEADER = "Controlplane-Event-Type"
DELIVERY_ID_HEADER = "Controlplane-Delivery-Id"
TOLERANCE_S = 300
# The Standard Webhooks headers.
STANDARD_ID_HEADER = "webhook-id"
STANDARD_TIMESTAMP_HEADER = "webhook-timestamp"
STANDARD_SIGNATURE_HEADER = "webhook-signature"
SECRET_PREFIX = "whsec_"  # noqa: S105 (the prefix of every secret, not a secret)


class SignatureError(ValueError):
    """A delivery whose signature header is missing, malformed, wrong or too old."""


def new_secret() -> str:
    """An endpoint's signing secret: `whsec_` and 32 random bytes in base64, as Standard Webhooks
    libraries expect it."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def standard_key(secret: str) -> bytes:
    """The key Standard Webhooks signs with: the base64 after `whsec_`, decoded as its libraries
    decode it (padding added, other characters skipped). A secret that does not decode (some of
    those given before the scheme was adopted) signs with its own bytes."""
    try:
        return base64.b64decode(secret.removeprefix(SECRET_PREFIX) + "==")
    except binascii.Error:
        return secret.encode()


def signed_headers(secret: str, event_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """Both schemes' headers for `body`, the event `event_id`, sent at `timestamp`."""
    standard = hmac.new(standard_key(secret), f"{event_id}.{timestamp}.".encode() + body, hashlib.sha256)
    return {
        STANDARD_ID_HEADER: event_id,
        STANDARD_TIMESTAMP_HEADER: str(timestamp),
        STANDARD_SIGNATURE_HEADER: "v1," + base64.b64encode(standard.digest()).decode(),
        SIGNATURE_HEADER: sign(secret, timestamp, body),
    }


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """The signature header's value for `body` sent at `timestamp`."""
    return f"t={timestamp},v1={_mac(secret, timestamp, body)}"


def _mac(secret: str, timestamp: int, body: bytes) -> str:
    return hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


def verify(secret: str, header: str | None, body: bytes, now: float, tolerance_s: float = TOLERANCE_S) -> int:
    """Check a delivery's signature header against its raw body; return its timestamp.

    Raises SignatureError when the header is missing or malformed, no `v1` matches, or the
    timestamp is further than `tolerance_s` from `now` (unix seconds)."""
    if not header:
        raise SignatureError(f"no {SIGNATURE_HEADER} header")
    timestamp: int | None = None
    candidates: list[str] = []
    for part in header.split(","):
        key, _, value = part.strip().partition("=")
        if key == "t" and value.isdigit():
            timestamp = int(value)
        elif key == "v1" and value:
            candidates.append(value)
    if timestamp is None or not candidates:
        raise SignatureError("the signature header has no timestamp or no v1 signature")
    expected = _mac(secret, timestamp, body)
    if not any(hmac.compare_digest(expected, candidate) for candidate in candidates):
        raise SignatureError("no signature matches the body with this secret")
    if abs(now - timestamp) > tolerance_s:
        raise SignatureError(
            f"the timestamp is {abs(now - timestamp):.0f} s away from now (over {tolerance_s} s)"
        )
    return timestamp
