"""The short chaos soak: the whole control plane as processes, a mixed workload, every kind of fault
(worker, reconciler leader, API, the control plane's PostgreSQL, a customer's server), then every
invariant checked on the converged end state. The long soak is `python3 dev.py chaos --minutes 30`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controlplane.chaos import plan
from controlplane.chaos.soak import Options, run
from tests.provisioning_support import pg_bindir
from tests.up_support import scratch_dir


@pytest.mark.timeout(900)
def test_short_chaos_soak_keeps_every_invariant(tmp_path: Path) -> None:
    with scratch_dir("cp-chaos-") as root:
        report = run(
            Options(
                minutes=2,
                seed=18,
                apis=2,
                workers=2,
                reconcilers=2,
                max_instances=4,
                min_interval_s=4,
                max_interval_s=12,
                out=tmp_path / "report",
                root=root,
                pg_bindir=pg_bindir(),
            )
        )
    print(report.markdown())
    assert report.violations == []
    injected = {kind for kind, row in report.by_kind().items() if row["injected"]}
    assert injected == set(plan.FAULT_KINDS), report.by_kind()
    assert report.completed["create"] > 0 and report.completed["billing"] > 0
    assert json.loads((tmp_path / "report.json").read_text())["invariant_violations"] == 0
