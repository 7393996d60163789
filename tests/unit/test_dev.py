"""The launcher's decisions (dev.py, beside the project): what `test` installs for the browser tests
and the alert rules' tests."""

from __future__ import annotations

import importlib.util
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
