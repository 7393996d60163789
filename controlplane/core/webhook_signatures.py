"""Signatures of webhook deliveries (pure), the way Stripe signs its own: `t=<unix>,v1=<hex>`.

`v1` is the HMAC-SHA256 of "<t>.<body>" keyed by the endpoint's whole secret. A receiver checks
it with `verify` (or the same few lines in its language): the signature must match and the
timestamp be within the tolerance, which stops a captured delivery being replayed later.
"""

from __future__ import annotations

import hashlib
import hmac

SIGNATURE_HEADER = "Controlplane-Signature"
EVENT_ID_HEADER = "Controlplane-Event-Id"
EVENT_TYPE_HEADER = "Controlplane-Event-Type"
DELIVERY_ID_HEADER = "Controlplane-Delivery-Id"
TOLERANCE_S = 300


class SignatureError(ValueError):
    """A delivery whose signature header is missing, malformed, wrong or too old."""


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
