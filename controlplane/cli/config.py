"""Where the CLI's API is and which key it uses, without talking to it: the config file and its
profiles, the local `up`'s URL and admin key. Light (no HTTP client): the shell commands and
completion use it too."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controlplane.cli.common import CommandError
from controlplane.core import exit_codes

DEFAULT_URL = "http://127.0.0.1:8700"
PROFILE_ENV = "CONTROLPLANE_PROFILE"
# The config file's names of the profile used when none is named: by customer commands (an
# organisation's key), and by admin commands (orgs, keys --org, the SRE commands through the API).
DEFAULT_PROFILE = "default_profile"
ADMIN_PROFILE = "admin_profile"
# The profile `up` writes for the admin key it saved (docs/api.md, "The CLI").
UP_PROFILE = "local-admin"


def config_dir() -> Path:
    """$XDG_CONFIG_HOME/controlplane (~/.config/controlplane when unset)."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "controlplane"


def config_file() -> Path:
    return config_dir() / "config.toml"


@dataclass(frozen=True)
class Profile:
    """A named place to talk to: the API's URL and where its key is kept (a file of mode 0600, or
    the name of an environment variable); the key itself is never in the config file."""

    name: str
    url: str | None = None
    key_file: str | None = None
    key_env: str | None = None

    def key(self) -> str | None:
        if self.key_env:
            return os.environ.get(self.key_env) or None
        if self.key_file:
            path = Path(self.key_file).expanduser()
            if not path.exists():
                raise CommandError(
                    f"profile {self.name}: its key file {path} is missing (run `controlplane login"
                    f" --profile {self.name}`)",
                    exit_codes.UNAUTHORIZED,
                )
            return path.read_text().strip() or None
        return None


def load_config() -> dict[str, Any]:
    import tomllib

    path = config_file()
    if not path.exists():
        return {}
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise CommandError(f"{path} is not valid TOML: {exc}", exit_codes.USAGE) from None


def _toml_string(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def save_config(config: dict[str, Any]) -> Path:
    """Write the config file (top-level strings, then one [profiles.NAME] table per profile), in
    one rename: a command reading it meanwhile sees the old file or the new one."""
    lines = [f"{k} = {_toml_string(str(v))}" for k, v in config.items() if not isinstance(v, dict)]
    for name, values in sorted(config.get("profiles", {}).items()):
        lines += ["", f"[profiles.{_toml_string(name)}]"]
        lines += [f"{k} = {_toml_string(str(v))}" for k, v in values.items() if v is not None]
    path = config_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text("\n".join(lines) + "\n")
    partial.replace(path)
    return path


def chosen_profile_name(
    args: argparse.Namespace, config: dict[str, Any], *, admin: bool = False
) -> str | None:
    """--profile, else CONTROLPLANE_PROFILE, else (an admin command) the config file's admin_profile,
    else its default_profile."""
    name = (
        getattr(args, "profile", None)
        or os.environ.get(PROFILE_ENV)
        or (config.get(ADMIN_PROFILE) if admin else None)
        or config.get(DEFAULT_PROFILE)
    )
    return str(name) if name else None


def chosen_profile(args: argparse.Namespace, *, admin: bool = False) -> Profile | None:
    config = load_config()
    name = chosen_profile_name(args, config, admin=admin)
    if name is None:
        return None
    values = config.get("profiles", {}).get(name)
    if values is None:
        if getattr(args, "profile", None) or os.environ.get(PROFILE_ENV):
            raise CommandError(
                f"no profile {name!r} in {config_file()}"
                f" (create it with `controlplane login --profile {name}`)",
                exit_codes.USAGE,
            )
        return None
    return Profile(name, values.get("url"), values.get("key_file"), values.get("key_env"))


def save_profile(name: str, url: str, key_file: Path, *, admin: bool, default: bool = False) -> Path:
    """Keep a profile (its URL and key file); an admin key's becomes the admin profile, an
    organisation's the default one, when none is set yet or `default` asks for it."""
    config = load_config()
    profiles = config.setdefault("profiles", {})
    profiles[name] = {**profiles.get(name, {}), "url": url, "key_file": str(key_file)}
    which = ADMIN_PROFILE if admin else DEFAULT_PROFILE
    if default or which not in config:
        config[which] = name
    return save_config(config)


def local_url() -> str:
    """The URL a local `up` or `serve` is at: CONTROLPLANE_PUBLIC_URL, else CONTROLPLANE_API_HOST
    and CONTROLPLANE_API_PORT, else http://127.0.0.1:8700."""
    public = os.environ.get("CONTROLPLANE_PUBLIC_URL")
    if public:
        return public
    host = os.environ.get("CONTROLPLANE_API_HOST") or "127.0.0.1"
    port = os.environ.get("CONTROLPLANE_API_PORT") or "8700"
    return DEFAULT_URL if (host, port) == ("127.0.0.1", "8700") else f"http://{host}:{port}"


def local_admin_key(data_dir: str | None = None) -> str | None:
    """The admin key `up` saved in its data directory (--data-dir, else CONTROLPLANE_DATA_DIR, else
    .controlplane)."""
    path = Path(data_dir or os.environ.get("CONTROLPLANE_DATA_DIR") or ".controlplane") / "admin.key"
    try:
        return path.read_text().strip() or None
    except OSError:
        return None
