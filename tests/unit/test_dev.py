"""The launcher's decisions (dev.py, beside the project): what it installs with apt-get (pgBackRest for
every command that runs local instances; Chromium and libfaketime for the tests)."""

from __future__ import annotations

import importlib.util
from types import ModuleType

from tests.support import ROOT


def _dev() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dev", ROOT / "dev.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_chromium_is_installed_with_apt_get_only_when_missing_and_root() -> None:
    dev = _dev()
    assert dev.browser_install(chromium_present=True, is_root=True) is None
    assert dev.browser_install(chromium_present=True, is_root=False) is None
    assert dev.browser_install(chromium_present=False, is_root=True) == [
        ["apt-get", "update"],
        ["apt-get", "install", "-y", "chromium", "fonts-liberation"],
    ]
    line = dev.browser_install(chromium_present=False, is_root=False)
    assert isinstance(line, str) and "\n" not in line
    assert "apt-get install -y chromium" in line and str(dev.CHROMIUM) in line


def test_pgbackrest_is_installed_for_every_command_that_runs_local_instances() -> None:
    dev = _dev()
    assert dev.missing_packages(dev.RUNTIME_PACKAGES, lambda found_by: True) == ()
    assert dev.missing_packages(dev.RUNTIME_PACKAGES, lambda found_by: False) == ("pgbackrest",)
    assert dev.PGBACKREST.as_posix() == "/usr/bin/pgbackrest"
    everything = dev.missing_packages(dev.TEST_PACKAGES, lambda found_by: False)
    assert everything == ("pgbackrest", "chromium", "fonts-liberation", "libfaketime")
    only_browser = dev.missing_packages(dev.TEST_PACKAGES, lambda found_by: found_by != str(dev.CHROMIUM))
    assert only_browser == ("chromium", "fonts-liberation")
    assert dev.debian_install(everything, True, "why") == [
        ["apt-get", "update"],
        ["apt-get", "install", "-y", *everything],
    ]
