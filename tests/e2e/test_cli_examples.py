"""Every command example of README.md and of each command's `--help`, run against `up` (the local
provisioner) as a person would: the README's in its order, in the shell its quick start sets up
(no key or URL exported: the profiles `up` and `login` write), then the help examples in an order
where each one applies. An example that is changed or added without a place here fails the test
(tests/unit/test_cli_examples.py parses them all, without a server).

What an example answers when run here is 0 unless HELP_STEPS or README_CODES says otherwise, with
the reason; `<placeholders>`, the sample id 5b1e0c52-… and the example hosts (cp.example.com,
api.example.com) are replaced by what this run made and by its API."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import pytest

from controlplane.core import exit_codes
from tests.cli_examples import Example, help_examples, readme_examples
from tests.support import ROOT, eventually_sync
from tests.up_support import running_up, scratch_dir, up_env

SAMPLE_ID = "5b1e0c52-8d4f-4c7e-9a51-0d2f6b3f9e10"
EXAMPLE_HOSTS = ("https://cp.example.com", "https://api.example.com")

# README examples that cannot answer 0 when run in the README's order, and why.
README_CODES: dict[tuple[str, ...], int] = {
    # No job is `failed` after the quick start (a failed job waits seconds for its next attempt):
    # the example is run on a completed job, which the API refuses as a conflict.
    ("jobs", "retry"): exit_codes.CONFLICT,
}

# The help examples not already run as README examples, in an order where each applies, with their
# exit code and how they run: HELPER steps are no example (they put the database where the next
# example needs it); a BACKGROUND one runs until the next step has ended (it follows that step).
EXAMPLE, HELPER, BACKGROUND = "example", "helper", "background"
HELP_STEPS: list[tuple[str, int, str]] = [
    ("instances create orders --plan dev --wait", 0, HELPER),  # again: the README deleted it
    ("instances list --all --columns name,state,plan --limit 20", 0, EXAMPLE),
    ("instances show orders", 0, EXAMPLE),
    ("instances wait orders --for ready --timeout 10m", 0, EXAMPLE),
    ("instances events orders", 0, EXAMPLE),
    ("instances metrics orders --step 60", 0, EXAMPLE),
    ("instances resize orders --plan small --wait", 0, EXAMPLE),
    # An SRE's command, run with the admin profile `up` wrote: orders is on an HA plan now.
    ("instances switchover orders --reason maintenance", 0, EXAMPLE),
    # Its data is not lost, and it did not fail: a restore and a retry are refused as conflicts.
    ("instances restore orders --newest --wait", exit_codes.CONFLICT, EXAMPLE),
    ("instances retry orders --wait", exit_codes.CONFLICT, EXAMPLE),
    ("instances protection orders on", 0, EXAMPLE),
    ("instances delete orders", exit_codes.CONFLICT, HELPER),  # protected
    ("instances protection orders off", 0, HELPER),
    ("instances watch orders", 0, BACKGROUND),  # follows the deletion, ends when it is deleted
    ("instances delete orders --wait", 0, EXAMPLE),
    ("ca --file ca.pem", 0, EXAMPLE),
    ("webhooks list", 0, EXAMPLE),
    (f"webhooks deliveries {SAMPLE_ID}", 0, EXAMPLE),
    (f"webhooks delete {SAMPLE_ID}", 0, EXAMPLE),
    ("events --to-state failed --since 2026-01-31T00:00:00Z", 0, EXAMPLE),
    ("login --profile prod --url https://api.example.com", 0, EXAMPLE),  # the admin key, for the SRE
    ("stuck --profile prod", 0, EXAMPLE),
    (f"jobs events {SAMPLE_ID} --url https://cp.example.com", 0, EXAMPLE),
    ("orgs list", 0, EXAMPLE),
    ("keys create --name ci", 0, EXAMPLE),
    ("keys list", 0, EXAMPLE),
    (f"keys revoke {SAMPLE_ID}", 0, EXAMPLE),
    ("completion bash", 0, EXAMPLE),
    ("completion zsh", 0, EXAMPLE),
    ("completion fish", 0, EXAMPLE),
]


@dataclass
class Shell:
    """The person's shell after the quick start: the worktree's CLI, their config directory."""

    env: dict[str, str]
    cwd: Path
    api: str
    admin_key: str
    # What earlier commands made, for the placeholders of later ones.
    made: dict[str, str] = field(default_factory=dict)
    ran: list[str] = field(default_factory=list)

    def start(self, argv: list[str]) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "controlplane.cli", *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env,
            cwd=self.cwd,
        )

    def run(self, argv: list[str], code: int = 0, stdin: str | None = None) -> str:
        return self.ended(argv, self.start(argv), code, stdin)

    def ended(
        self, argv: list[str], process: subprocess.Popen[str], code: int = 0, stdin: str | None = None
    ) -> str:
        out, err = process.communicate(stdin, timeout=900)
        line = " ".join(argv)
        self.ran.append(line)
        print(f"$ controlplane {line}  -> {process.returncode}\n{out}{err}")
        assert process.returncode == code, f"controlplane {line}: exit {process.returncode}\n{err}"
        if code and code != exit_codes.USAGE:
            assert err.count("\n") == 1, err  # a refusal is one line
        return out

    def filled(self, words: list[str]) -> list[str]:
        """The example's words with what stands for a value of this run replaced by it."""
        out = []
        for word in words:
            for host in EXAMPLE_HOSTS:
                word = word.replace(host, self.api)
            if word == SAMPLE_ID:
                word = self.sample_for(words)
            out.append(word)
        return out

    def sample_for(self, words: list[str]) -> str:
        kind = {"webhooks": "endpoint_id", "keys": "key_id", "jobs": "job_id"}[words[0]]
        return self.made[kind]

    def stdin_for(self, words: list[str]) -> str | None:
        if words[0] != "login":
            return None
        # The customer logs in with the organisation's key; `--profile prod`, an SRE with the admin key.
        return (self.admin_key if "prod" in words else self.made["org_key"]) + "\n"

    def example(self, words: list[str], code: int = 0) -> str:
        out = self.run(self.argv(words), code, stdin=self.stdin_for(words))
        self.remember(words, out)
        return out

    def argv(self, words: list[str]) -> list[str]:
        return self.filled(Example("", tuple(words)).filled(self.made))

    def remember(self, words: list[str], out: str) -> None:
        found = {
            ("orgs", "create"): ("org_key", r"(cpk_\S+)"),
            ("webhooks", "create"): ("endpoint_id", r"endpoint ([0-9a-f-]{36}) registered"),
            ("keys", "create"): ("key_id", r"API key ([0-9a-f-]{36}) created"),
        }.get((words[0], words[1] if len(words) > 1 else ""))
        if found:
            match = re.search(found[1], out)
            assert match is not None, out
            self.made[found[0]] = match.group(1)


def test_every_readme_and_help_example_runs_against_up() -> None:
    readme = [list(e.argv) for e in readme_examples()]
    readme_lines = {" ".join(w) for w in readme}
    steps = {line for line, _, how in HELP_STEPS if how != HELPER}
    unplaced = {" ".join(e.argv) for e in help_examples()} - readme_lines - steps
    assert unplaced == set(), "place each new help example in HELP_STEPS"
    with scratch_dir("cp-examples-") as root:
        data_dir, work = root / "data", root / "work"
        work.mkdir()
        env = up_env(root, notify_allow_private="true")  # example.com is not resolved here
        with running_up(data_dir, env, launcher=False) as (_up, output):
            banner = "".join(output)
            api = f"http://127.0.0.1:{env['CONTROLPLANE_API_PORT']}"
            assert "use it: profile local-admin" in banner
            # The person's other terminal: no key or URL exported; the data directory named.
            shell_env = {
                k: v for k, v in env.items() if k not in ("CONTROLPLANE_API_KEY", "CONTROLPLANE_URL")
            }
            shell_env |= {"CONTROLPLANE_DATA_DIR": str(data_dir), "PYTHONPATH": str(ROOT)}
            shell = Shell(shell_env, work, api, (data_dir / "admin.key").read_text().strip())
            run_readme(shell, readme)
            # With CONTROLPLANE_URL exported (a banner once said to), the SRE commands go through
            # the admin API, with the admin key of the profile `up` wrote.
            exported = Shell(shell_env | {"CONTROLPLANE_URL": api}, work, api, shell.admin_key)
            for sre in (["events"], ["stuck"], ["stats", "dwell"], ["jobs", "list"], ["orgs", "list"]):
                exported.run(sre)
            run_help(shell)


def run_readme(shell: Shell, readme: list[list[str]]) -> None:
    for words in readme:
        if "<job_id>" in words and "job_id" not in shell.made:
            jobs = shell.run(["jobs", "list", "--columns", "id", "--limit", "1", "-o", "json"])
            shell.made["job_id"] = re.findall(r'"id": "([0-9a-f-]{36})"', jobs)[0]
        if "<moment>" in words:
            shell.made["moment"] = restorable_moment(shell, words[words.index("--restore-from") + 1])
        out = shell.example(words, README_CODES.get(tuple(words[:2]), 0))
        if words[:2] == ["instances", "show"]:
            assert out.startswith("postgresql://") and "sslrootcert=" in out


def restorable_moment(shell: Shell, source: str) -> str:
    """The latest moment of `source`'s recoverable window, as `instances backups` shows it, once
    there is one: its first backup is taken as soon as it is ready, and the archive then reaches
    past that backup's end (until it does, the window's latest moment precedes its earliest)."""
    window: dict[str, str | None] = {}

    def restorable() -> bool:
        window.update(json.loads(shell.run(["instances", "backups", source, "-o", "json"])))
        earliest, latest = window["earliest"], window["latest"]
        return bool(earliest and latest) and moment(str(earliest)) <= moment(str(latest))

    eventually_sync(restorable, f"a recoverable window of {source}", timeout_s=300)
    return str(window["latest"])


def moment(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


@pytest.fixture(autouse=True)
def _no_inherited_cli_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("CONTROLPLANE_")]:
        monkeypatch.delenv(name)


def run_help(shell: Shell) -> None:
    following: tuple[list[str], subprocess.Popen[str], int] | None = None
    for line, code, how in HELP_STEPS:
        words = line.split()
        if how == BACKGROUND:
            following = (words, shell.start(shell.argv(words)), code)
            # Following before the next step starts: its first line is the instance as it is.
            assert following[1].stdout is not None
            print(following[1].stdout.readline(), end="")
            continue
        shell.example(words, code)
        if following is not None:
            shell.ended(*following)
            following = None
