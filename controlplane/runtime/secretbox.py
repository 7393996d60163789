"""Encryption at rest for instance credentials (Fernet), with the key from settings or the data dir."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken

from controlplane.runtime.settings import FERNET_KEY_FORM, Settings, SettingsError, is_fernet_key


class SecretBox:
    def __init__(self, key: str | bytes) -> None:
        self._fernet = Fernet(key)
        self._key = key.encode() if isinstance(key, str) else bytes(key)

    def subkey(self, purpose: str) -> bytes:
        """A key for one other purpose (signing console cookies, CSRF tokens), derived from the
        secret key with HMAC-SHA256: the credentials' key itself is used for nothing else."""
        return hmac.new(self._key, b"controlplane:" + purpose.encode(), hashlib.sha256).digest()

    def fernet_for(self, purpose: str) -> Fernet:
        """A Fernet (encrypted, authenticated, timestamped tokens) keyed by `subkey(purpose)`."""
        return Fernet(base64.urlsafe_b64encode(self.subkey(purpose)))

    def encrypt(self, plaintext: str) -> bytes:
        return self._fernet.encrypt(plaintext.encode())

    def decrypt(self, token: bytes) -> str:
        try:
            return self._fernet.decrypt(bytes(token)).decode()
        except InvalidToken:
            raise ValueError("credential cannot be decrypted with the configured secret key") from None


def load_box(settings: Settings) -> SecretBox:
    """The configured key (CONTROLPLANE_SECRET_KEY), else one generated once into data_dir."""
    if settings.secret_key is not None:
        return SecretBox(settings.secret_key.get_secret_value())
    path = Path(settings.data_dir) / "secret.key"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(Fernet.generate_key())
    key = path.read_bytes().strip()
    if not is_fernet_key(key):
        raise SettingsError(f"{path} must hold {FERNET_KEY_FORM}")
    return SecretBox(key)
