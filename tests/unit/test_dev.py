"""The launcher's decisions (dev.py, beside the project): what `test` installs for the browser tests
and the alert rules' tests."""

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


def test_promtool_comes_from_debians_prometheus_package_without_its_recommendations() -> None:
    dev = _dev()
    assert dev.promtool_install(promtool_present=True, is_root=True) is None
    assert dev.promtool_install(promtool_present=True, is_root=False) is None
    assert dev.promtool_install(promtool_present=False, is_root=True) == [
        ["apt-get", "update"],
        ["apt-get", "install", "-y", "--no-install-recommends", "prometheus"],
    ]
    line = dev.promtool_install(promtool_present=False, is_root=False)
    assert isinstance(line, str) and "\n" not in line
    assert "sudo apt-get install -y --no-install-recommends prometheus" in line
    assert str(dev.PROMTOOL) in line
