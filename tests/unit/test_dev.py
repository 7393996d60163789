"""The launcher's decisions (dev.py, beside the project): what it installs with apt-get (pgBackRest for
every command that runs local instances; Chromium, libfaketime, npm and promtool for the tests), and
what `up` and `test` install into the venv."""

from __future__ import annotations

import importlib.util
import json
from types import ModuleType

import pytest

from tests.support import ROOT


def _dev() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dev", ROOT / "dev.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# What installs each Debian package the tests need: its function in dev.py, the file that shows it
# is there, the packages and options apt-get gets.
INSTALLS = {
    "chromium": ("browser_install", "CHROMIUM", ["chromium", "fonts-liberation"]),
    # promtool comes only with Debian's Prometheus server package; not its recommendations.
    "promtool": ("promtool_install", "PROMTOOL", ["--no-install-recommends", "prometheus"]),
}


@pytest.mark.parametrize("tool", sorted(INSTALLS))
def test_a_missing_tool_is_installed_with_apt_get_only_as_root(tool: str) -> None:
    dev = _dev()
    function, path, packages = INSTALLS[tool]
    install = getattr(dev, function)
    assert install(True, is_root=True) is None
    assert install(True, is_root=False) is None
    assert install(False, is_root=True) == [["apt-get", "update"], ["apt-get", "install", "-y", *packages]]
    line = install(False, is_root=False)
    assert isinstance(line, str) and "\n" not in line
    assert f"sudo apt-get install -y {' '.join(packages)}" in line and str(getattr(dev, path)) in line


def test_up_installs_the_runtime_and_test_adds_the_dev_extra_to_the_same_venv() -> None:
    dev = _dev()
    runtime, tests = dev.NEEDS["up"], dev.NEEDS["test"]
    assert runtime == frozenset() and tests == frozenset({"dev"})
    assert {dev.NEEDS[c] for c in ("chaos", "bench", "shell")} == {runtime} and dev.NEEDS["check"] == tests

    def stamp(lock: str, *extras: str) -> str:
        return json.dumps({"lock": lock, "extras": sorted(extras)})

    # A fresh venv: up installs the runtime alone; test, the dev extra.
    assert dev.to_install(None, "L1", runtime) == frozenset()
    assert dev.to_install(None, "L1", tests) == {"dev"}
    # Then: up again installs nothing; test adds the dev extra; up after test installs nothing.
    assert dev.to_install(stamp("L1"), "L1", runtime) is None
    assert dev.to_install(stamp("L1"), "L1", tests) == {"dev"}
    assert dev.to_install(stamp("L1", "dev"), "L1", runtime) is None
    assert dev.to_install(stamp("L1", "dev"), "L1", tests) is None
    # A changed lock installs again, keeping what the venv had; the embedded fallback is an extra too.
    assert dev.to_install(stamp("L1", "dev"), "L2", runtime) == {"dev"}
    assert dev.to_install(stamp("L1"), "L1", {"embedded-fallback"}) == {"embedded-fallback"}
    # The stamp of an earlier dev.py (a bare digest) installs again.
    assert dev.to_install("0123abcd", "L1", runtime) == frozenset()


def test_pgbackrest_and_pgbouncer_are_installed_for_every_command_that_runs_local_instances() -> None:
    dev = _dev()
    assert dev.missing_packages(dev.RUNTIME_PACKAGES, lambda found_by: True) == ()
    assert dev.missing_packages(dev.RUNTIME_PACKAGES, lambda found_by: False) == ("pgbackrest", "pgbouncer")
    assert dev.PGBACKREST.as_posix() == "/usr/bin/pgbackrest"
    assert dev.PGBOUNCER.as_posix() == "/usr/sbin/pgbouncer"
    pgbouncer = str(dev.PGBOUNCER)
    only_pgbouncer = dev.missing_packages(dev.RUNTIME_PACKAGES, lambda found_by: found_by != pgbouncer)
    assert only_pgbouncer == ("pgbouncer",)
    everything = dev.missing_packages(dev.TEST_PACKAGES, lambda found_by: False)
    assert everything == ("pgbackrest", "pgbouncer", "chromium", "fonts-liberation", "libfaketime", "npm")
    only_browser = dev.missing_packages(dev.TEST_PACKAGES, lambda found_by: found_by != str(dev.CHROMIUM))
    assert only_browser == ("chromium", "fonts-liberation")
    assert dev.debian_install(everything, True, "why") == [
        ["apt-get", "update"],
        ["apt-get", "install", "-y", *everything],
    ]
