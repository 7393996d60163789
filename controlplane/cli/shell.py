"""Being at home in a shell: `login` (a key for a profile, read without echo, never printed back),
`completion bash|zsh|fish` (the scripts), and the hidden `__complete` the scripts call: commands
and flags from the parser itself, plans, states, and instance names from the API."""

from __future__ import annotations

import argparse
import getpass
import os
import sys
from pathlib import Path
from typing import Any

from controlplane.cli.common import CommandError
from controlplane.cli.config import (
    ADMIN_PROFILE,
    DEFAULT_PROFILE,
    DEFAULT_URL,
    config_dir,
    load_config,
    local_url,
    save_profile,
)
from controlplane.core import exit_codes, lifecycle, plans

EXAMPLE = "example:\n  {}"


def register(commands: Any) -> None:
    login = commands.add_parser(
        "login",
        help="store an API key for a profile (read without echo, never printed back)",
        description="Store an API key for a profile of the config file ($XDG_CONFIG_HOME/controlplane/"
        "config.toml). The key is read from the terminal without echo (or from standard input when it "
        "is not a terminal), checked against the API, and kept in a file of mode 0600 beside the "
        "config; it is never printed.",
        epilog=EXAMPLE.format("controlplane login --profile prod --url https://api.example.com"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    login.add_argument(
        "--profile",
        default=None,
        help="the profile to store it for (default: default, or admin for an admin key)",
    )
    login.add_argument(
        "--url",
        default=None,
        help=f"the API's URL (default: CONTROLPLANE_URL, else the profile's, else {DEFAULT_URL})",
    )
    login.add_argument(
        "--default",
        action="store_true",
        help="make this profile the one used when none is named (by admin commands, for an admin key)",
    )
    login.set_defaults(handler=cmd_login)

    completion = commands.add_parser(
        "completion",
        help="print the shell completion script for bash, zsh or fish",
        description="Print the completion script of a shell: commands, flags, plans, states and your "
        "databases' names complete with Tab.",
        epilog="examples:\n"
        "  controlplane completion bash > ~/.local/share/bash-completion/completions/controlplane\n"
        "  controlplane completion zsh > ~/.zfunc/_controlplane\n"
        "  controlplane completion fish > ~/.config/fish/completions/controlplane.fish",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    completion.add_argument("shell", choices=("bash", "zsh", "fish"), help="the shell to complete in")
    completion.set_defaults(handler=cmd_completion)

    # No `help`: argparse lists every sub-command given one, even `help=SUPPRESS` (as "==SUPPRESS==").
    hidden = commands.add_parser("__complete")
    hidden.add_argument("words", nargs=argparse.REMAINDER)
    hidden.set_defaults(handler=cmd_complete)


def _read_key() -> str:
    if sys.stdin.isatty():
        return getpass.getpass("API key (not shown): ").strip()
    return sys.stdin.readline().strip()


def cmd_login(args: argparse.Namespace) -> int:
    from controlplane.cli.client import Api, ApiError

    config = load_config()
    named = args.profile or os.environ.get("CONTROLPLANE_PROFILE")
    known = config.get("profiles", {}).get(named or "default", {})
    # As every command reads it: --url, else CONTROLPLANE_URL, else the profile's, else the local one.
    url = args.url or os.environ.get("CONTROLPLANE_URL") or known.get("url") or local_url()
    key = _read_key()
    if not key:
        raise CommandError("no key given", exit_codes.USAGE)
    # Checked before it is kept: an organisation's key lists instances, an admin key is refused
    # there as "not an organisation's key" (403), a bad key is 401.
    check = Api(argparse.Namespace(url=url, api_key=key, profile=None))
    admin = False
    try:
        check.request("GET", "/v1/instances", params={"limit": 1})
    except ApiError as exc:
        if exc.status != 403:
            raise
        admin = True
    name = named or ("admin" if admin else "default")
    keys = config_dir() / "keys"
    keys.mkdir(parents=True, exist_ok=True)
    os.chmod(keys, 0o700)
    key_file = keys / name
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(key + "\n")
    os.chmod(key_file, 0o600)
    path = save_profile(name, url, key_file, admin=admin, default=args.default)
    kind, which = ("an admin", ADMIN_PROFILE) if admin else ("an organisation", DEFAULT_PROFILE)
    chosen = " (its " + which + ")" if load_config().get(which) == name else ""
    print(f"profile {name}{chosen}: {kind} key for {url}, kept in {key_file} (mode 0600); config {path}")
    return 0


# ---- completion ----------------------------------------------------------------------------------

BASH = """# controlplane completion for bash: source it, or put it in bash-completion's completions directory
_controlplane() {
    local IFS=$'\\n'
    COMPREPLY=($(controlplane __complete "${COMP_WORDS[@]:1:COMP_CWORD}" 2>/dev/null))
}
complete -o default -F _controlplane controlplane
"""

ZSH = """#compdef controlplane
# controlplane completion for zsh: put it as _controlplane in a directory of $fpath
_controlplane() {
    local -a candidates
    candidates=(${(f)"$(controlplane __complete "${(@)words[2,CURRENT]}" 2>/dev/null)"})
    compadd -a candidates
}
compdef _controlplane controlplane
"""

FISH = """# controlplane completion for fish: put it in ~/.config/fish/completions/controlplane.fish
function __controlplane_complete
    set -l words (commandline -opc) (commandline -ct)
    controlplane __complete $words[2..-1] 2>/dev/null
end
complete -c controlplane -f -a '(__controlplane_complete)'
"""

SCRIPTS = {"bash": BASH, "zsh": ZSH, "fish": FISH}


def cmd_completion(args: argparse.Namespace) -> int:
    sys.stdout.write(SCRIPTS[args.shell])
    return 0


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {k: v for k, v in action.choices.items() if not k.startswith("__")}
    return {}


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {
        option: action
        for action in parser._actions
        if action.help != argparse.SUPPRESS
        for option in action.option_strings
    }


def _instance_names(args: argparse.Namespace) -> list[str]:
    """The caller's live databases' names (nothing when no API or key answers)."""
    from controlplane.cli.client import Api

    try:
        api = Api(args, timeout=2.0)
        return [str(i["name"]) for i in api.all_items("/v1/instances", {"limit": 100})]
    except CommandError:
        return []


def _values_of(action: argparse.Action) -> list[str]:
    if action.dest == "plan":
        return list(plans.plan_names())
    if action.dest in ("state", "to_state") or action.dest == "states":
        return list(lifecycle.INSTANCE.states)
    if action.choices:
        return [str(c) for c in action.choices]
    return []


def complete(parser: argparse.ArgumentParser, words: list[str]) -> list[str]:
    """The candidates for the last of `words` (the words after `controlplane`, the last one being
    typed), from the parser: sub-commands, then flags, a flag's values, instance names."""
    current = words[-1] if words else ""
    before = words[:-1]
    node = parser
    seen = argparse.Namespace(url=None, api_key=None, profile=None)
    expecting: argparse.Action | None = None
    positionals = 0
    for word in before:
        flags = _flags(node)
        if expecting is not None:
            if expecting.dest in ("url", "api_key", "profile"):
                setattr(seen, expecting.dest, word)
            expecting = None
            continue
        if word.startswith("-"):
            action = flags.get(word.split("=", 1)[0])
            if action is not None and action.nargs != 0 and "=" not in word:
                expecting = action
            continue
        children = _subcommands(node)
        if word in children:
            node = children[word]
            positionals = 0
        else:
            positionals += 1
    if expecting is not None:
        candidates = _values_of(expecting)
    elif current.startswith("-"):
        candidates = sorted(_flags(node))
    elif _subcommands(node):
        candidates = list(_subcommands(node))
    else:
        candidates = []
        wanted = [a for a in node._actions if not a.option_strings and a.help != argparse.SUPPRESS]
        if positionals < len(wanted):
            action = wanted[positionals]
            named = action.metavar == "NAME_OR_ID"
            candidates = _instance_names(seen) if named else _values_of(action)
    return [c for c in candidates if c.startswith(current)]


def cmd_complete(args: argparse.Namespace) -> int:
    from controlplane.cli import build_parser

    words = [w for w in args.words if w != "--"] or [""]
    for candidate in complete(build_parser(), words):
        print(candidate)
    return 0


__all__ = ["SCRIPTS", "Path", "complete", "register"]
