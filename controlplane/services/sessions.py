"""Console sessions: an organisation's API key exchanged for a session kept in the database (ended
by signing out, by its expiry, or by revoking the key), named by a cookie sealed with a key derived
from the control plane's secret; and the CSRF tokens bound to it."""

from __future__ import annotations

import hmac
import secrets
import time
import uuid
from dataclasses import dataclass
from datetime import datetime

from cryptography.fernet import InvalidToken

from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.runtime.secretbox import SecretBox
from controlplane.services.tenants import Principal


@dataclass(frozen=True)
class Session:
    """A live console session: who signed in (their key and organisation) and until when."""

    id: uuid.UUID
    key_id: uuid.UUID
    org_id: uuid.UUID
    expires_at: datetime


class Seal:
    """Cookie values and form tokens, keyed by subkeys of the control plane's secret."""

    def __init__(self, box: SecretBox, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._cookie = box.fernet_for("console-session")
        self._csrf = box.subkey("console-csrf")
        self._sign_in = box.subkey("console-sign-in")

    def seal(self, session_id: uuid.UUID, now: float | None = None) -> str:
        """The cookie value naming `session_id`: encrypted and authenticated, with its time."""
        at = int(time.time() if now is None else now)
        return self._cookie.encrypt_at_time(session_id.bytes, at).decode()

    def open(self, value: str, now: float | None = None) -> uuid.UUID | None:
        """The session a cookie value names, None if it was not sealed here or is older than the ttl."""
        try:
            raw = self._cookie.decrypt_at_time(
                value.encode(), int(self.ttl_s), int(time.time() if now is None else now)
            )
        except (InvalidToken, ValueError, TypeError):
            return None
        return uuid.UUID(bytes=raw) if len(raw) == 16 else None

    def csrf_token(self, session_id: uuid.UUID) -> str:
        """The token every state-changing form of this session carries."""
        return hmac.new(self._csrf, session_id.bytes, "sha256").hexdigest()

    def csrf_valid(self, session_id: uuid.UUID, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(self.csrf_token(session_id), token)

    @staticmethod
    def sign_in_nonce() -> str:
        """A fresh value for the sign-in form's cookie (no session exists yet to bind a token to)."""
        return secrets.token_urlsafe(24)

    def sign_in_token(self, nonce: str) -> str:
        """The sign-in form's token: bound to the nonce its cookie carries."""
        return hmac.new(self._sign_in, nonce.encode(), "sha256").hexdigest()

    def sign_in_valid(self, nonce: str | None, token: str | None) -> bool:
        if not nonce or token is None:
            return False
        return hmac.compare_digest(self.sign_in_token(nonce), token)


def _session(row: object) -> Session:
    assert isinstance(row, dict)
    return Session(row["id"], row["key_id"], row["org_id"], row["expires_at"])


async def start(conn: AsyncConn, who: Principal, ttl_s: float) -> Session:
    """A new session of an organisation's key, live for `ttl_s`; sessions long over are purged."""
    if who.org_id is None:
        raise ValueError("a console session belongs to an organisation's key")
    async with conn.transaction():
        await conn.execute(sql.PURGE_CONSOLE_SESSIONS)
        cursor = await conn.execute(
            sql.START_CONSOLE_SESSION, {"key_id": who.key_id, "org_id": who.org_id, "ttl_s": ttl_s}
        )
        row = await cursor.fetchone()
    return _session(row)


async def resolve(conn: AsyncConn, session_id: uuid.UUID, now: datetime | None = None) -> Session | None:
    """The session if it is live at `now` (default: the database's time): not ended, not expired,
    and its key not revoked."""
    cursor = await conn.execute(sql.LIVE_CONSOLE_SESSION, {"id": session_id, "now": now})
    row = await cursor.fetchone()
    return None if row is None else _session(row)


async def end(conn: AsyncConn, session_id: uuid.UUID) -> None:
    """Sign-out: the session ends now (its cookie, wherever a copy is, names nothing from then on)."""
    await conn.execute(sql.END_CONSOLE_SESSION, {"id": session_id})
