"""The command examples people copy: README.md's and those of every command's `--help` epilogue,
as argument lists (shared by the test that parses them all and the one that runs them)."""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass

from controlplane.cli import build_parser
from tests.support import ROOT

README = ROOT / "README.md"
# How the README starts the installed command.
README_PREFIX = ".venv/bin/controlplane"
# Placeholders the README writes in angle brackets (`<job id>`), one word once read (`<job_id>`).
WRITTEN_PLACEHOLDER = re.compile(r"<([a-z ]+)>")
PLACEHOLDER = re.compile(r"<([a-z_]+)>")


@dataclass(frozen=True)
class Example:
    """One example: where it is written, and the words after `controlplane`."""

    where: str
    argv: tuple[str, ...]

    def placeholders(self) -> list[str]:
        return [m.group(1) for word in self.argv for m in PLACEHOLDER.finditer(word)]

    def filled(self, values: dict[str, str]) -> list[str]:
        """The arguments with each `<placeholder>` replaced by its value in `values`."""
        return [PLACEHOLDER.sub(lambda m: values[m.group(1)], word) for word in self.argv]


def _code_blocks(text: str) -> Iterator[str]:
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        yield from block.splitlines()


def readme_examples() -> list[Example]:
    """Every `.venv/bin/controlplane ...` of the README's shell blocks, also inside `$(...)`."""
    found = []
    for number, line in enumerate(_code_blocks(README.read_text()), 1):
        inner = re.search(r"\$\((" + re.escape(README_PREFIX) + r" [^)]*)\)", line)
        command = inner.group(1) if inner else line
        if not command.startswith(README_PREFIX + " "):
            continue
        one_word = WRITTEN_PLACEHOLDER.sub(lambda m: f"<{m.group(1).replace(' ', '_')}>", command)
        words = shlex.split(one_word, comments=True)
        found.append(Example(f"README.md, shell line {number}: {line.strip()}", tuple(words[1:])))
    return found


def _parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, (*path, name))


def help_examples() -> list[Example]:
    """Every `controlplane ...` line under `example:` or `examples:` in a command's --help."""
    found = []
    for path, parser in _parsers(build_parser()):
        lines = (parser.epilog or "").splitlines()
        start = next((i for i, line in enumerate(lines) if line.startswith("example")), None)
        for line in lines[start + 1 :] if start is not None else []:
            text = line.strip()
            if text.startswith("controlplane "):
                words = shlex.split(text.split(" > ")[0], comments=True)
                found.append(Example(f"controlplane {' '.join(path)} --help: {text}", tuple(words[1:])))
    return found


def all_examples() -> list[Example]:
    return readme_examples() + help_examples()
