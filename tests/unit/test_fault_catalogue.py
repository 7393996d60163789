"""The fault catalogue of docs/operations.md names, for each fault, a test that exists in the suite."""

from __future__ import annotations

import re

from tests.support import ROOT

ROW = re.compile(r"^\| (F\d+) \|.*\| `(test_\w+)` \|$", re.M)


def _catalogue() -> dict[str, str]:
    text = (ROOT / "docs" / "operations.md").read_text()
    return dict(ROW.findall(text.split("## Fault catalogue", 1)[1]))


def _tests_in_suite() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        names |= set(re.findall(r"^(?:async )?def (test_\w+)\(", path.read_text(), re.M))
    return names


def test_every_fault_of_the_catalogue_has_its_test() -> None:
    catalogue = _catalogue()
    assert sorted(catalogue, key=lambda f: int(f[1:])) == [f"F{n}" for n in range(1, 30)]
    missing = {fault: test for fault, test in catalogue.items() if test not in _tests_in_suite()}
    assert missing == {}


def test_the_faults_automated_here_are_named_after_their_fault() -> None:
    named = {f"F{m}" for m in re.findall(r"\btest_f(\d+)_", " ".join(_tests_in_suite()))}
    assert named <= set(_catalogue())
    for fault, test in _catalogue().items():
        if fault in named:
            assert test.startswith(f"test_{fault.lower()}_"), (fault, test)
