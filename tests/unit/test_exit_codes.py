"""One mapping from the API's problem types to the CLI's exit codes, covering every type; the
direct paths' domain errors get the codes of their problem types; docs/api.md lists the codes."""

from __future__ import annotations

from controlplane.api.problems import DOMAIN_KINDS, KINDS
from controlplane.core import exit_codes
from controlplane.core.refusals import DomainError
from tests.support import ROOT


def test_every_problem_type_has_an_exit_code() -> None:
    assert [kind for kind in KINDS if kind not in exit_codes.BY_PROBLEM] == []
    assert set(exit_codes.BY_PROBLEM.values()) <= set(exit_codes.CODES)


def test_the_codes_are_distinct_and_the_wait_ones_differ() -> None:
    names = [name for name, _ in exit_codes.CODES.values()]
    assert len(names) == len(set(names))
    assert len({exit_codes.TIMEOUT, exit_codes.FAILED, exit_codes.OTHER, exit_codes.USAGE}) == 4


def test_a_domain_error_exits_as_its_problem_type_does() -> None:
    for cls, kind in DOMAIN_KINDS:
        exc: DomainError = cls.__new__(cls)
        assert exit_codes.for_domain_error(exc) == exit_codes.BY_PROBLEM[kind], cls


def test_an_unknown_type_falls_back_to_its_status() -> None:
    assert exit_codes.for_problem(None, 404) == exit_codes.NOT_FOUND
    assert exit_codes.for_problem("something-new", 409) == exit_codes.CONFLICT
    assert exit_codes.for_problem(None, 503) == exit_codes.UNAVAILABLE
    assert exit_codes.for_problem(None, 418) == exit_codes.USAGE
    assert exit_codes.for_problem(None, 502) == exit_codes.UNAVAILABLE


def test_the_api_reference_lists_every_exit_code() -> None:
    text = (ROOT / "docs" / "api.md").read_text()
    for code, (name, _) in exit_codes.CODES.items():
        assert f"| {code} | {name} |" in text
