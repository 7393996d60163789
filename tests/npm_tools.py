"""Tools from the npm registry the tests run (client generators, linters): installed with npm into a
cached folder of their own, once per machine and set of versions, never into the project."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "controlplane-tests"


def npm_tools(packages: tuple[str, ...]) -> Path:
    """A cached folder with `packages` installed by npm (once per machine and set of versions): its
    node_modules. No silent skip: the test needs npm and the npm registry once per machine."""
    folder = cache_dir() / ("npm-" + "-".join(p.replace("/", "_").replace("@", "") for p in packages))
    ready = folder / ".installed"
    if ready.exists():
        return folder / "node_modules"
    npm = shutil.which("npm")
    if npm is None:
        pytest.fail("npm is missing: `apt-get install npm` (dev.py test installs it as root)", pytrace=False)
    folder.mkdir(parents=True, exist_ok=True)
    install = subprocess.run(
        [npm, "install", "--no-audit", "--no-fund", "--prefix", str(folder), *packages],
        capture_output=True,
        text=True,
        timeout=420,
        check=False,
    )
    if install.returncode != 0:
        pytest.fail(
            f"cannot install {packages} with npm into {folder}:\n{install.stderr[-2000:]}", pytrace=False
        )
    ready.write_text(" ".join(packages))
    return folder / "node_modules"
