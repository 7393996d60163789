"""A command line that starts fast: what a command needs is imported when it runs, not before.

`controlplane --help` builds the parser of every command, so the modules that register commands
import only argparse, the pure core and the CLI's light helpers (`common`, `config`). Two things
are left until a command is chosen:

- the flags of the settings (`common.add_settings_flags`), whose model needs pydantic: a `Parser`
  keeps them as `defer`red fillers, run when argparse enters that command (or its help is shown);
- the handlers: `LazyHandler("module:function")` imports the module when the command runs, so the
  HTTP client, the database driver or the web framework is imported only by the commands using it.

`build_parser()` (tests, completion) fills every command at once; `main` fills only the chosen one.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Sequence
from typing import Any

Handler = Callable[[argparse.Namespace], int]


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose sub-command parsers are Parsers too, each filled in when used."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fillers: list[Callable[[Parser], None]] = []

    def defer(self, filler: Callable[[Parser], None]) -> None:
        """Run `filler(self)` once this command is used (parsed, or its help printed)."""
        self._fillers.append(filler)

    def fill(self) -> None:
        while self._fillers:
            self._fillers.pop(0)(self)

    def fill_all(self) -> None:
        """This parser and every sub-command's, filled (for what walks them all: tests, completion)."""
        self.fill()
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    if isinstance(child, Parser):
                        child.fill_all()

    def format_usage(self) -> str:
        self.fill()
        return super().format_usage()

    def format_help(self) -> str:
        self.fill()
        return super().format_help()

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        # argparse enters a sub-command by calling this on its parser: the one place to fill it.
        self.fill()
        return super().parse_known_args(args, namespace)


class LazyHandler:
    """The handler `module:function`, imported when first called."""

    def __init__(self, spec: str) -> None:
        self.spec = spec

    def resolve(self) -> Handler:
        module_name, _, name = self.spec.partition(":")
        function: Handler = getattr(importlib.import_module(module_name), name)
        return function

    def __call__(self, args: argparse.Namespace) -> int:
        return self.resolve()(args)
