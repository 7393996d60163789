"""constraints.txt pins every dependency of pyproject.toml within its range, and this environment
(made by dev.py from it) has those versions: two machines get the same ones."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]


def pins() -> dict[str, str]:
    found: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep, f"not a pin: {line!r}"
            found[canonicalize_name(name.split("[")[0])] = version.strip()
    return found


def requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        listed += extra
    return [Requirement(r) for r in listed]


def test_every_dependency_is_pinned_within_its_range() -> None:
    pinned = pins()
    for requirement in requirements():
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{requirement} is not pinned in constraints.txt"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (
            f"constraints.txt pins {name}=={pinned[name]}, outside pyproject's {requirement}"
        )


def test_this_environment_has_the_pinned_versions() -> None:
    pinned = pins()
    for requirement in requirements():
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": "dev"}):
            continue
        name = canonicalize_name(requirement.name)
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # an extra this machine does not need (embedded-fallback with a system server)
        assert installed == pinned[name], f"{name} {installed} installed, constraints.txt pins {pinned[name]}"
