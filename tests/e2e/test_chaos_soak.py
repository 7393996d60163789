"""The short chaos soak: the whole control plane as processes, a mixed workload, every kind of fault
(worker, reconciler leader, API, the control plane's PostgreSQL, a single server, a data directory,
an HA instance's primary, standby and pooler), then every invariant checked on the converged end
state, with no acknowledged row lost across the HA faults and never two writable primaries. The
long soak is `python3 dev.py chaos --minutes 30`."""

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
                # Nine kinds at 4-12 s apart: two rounds of them, the first before instances are ready.
                minutes=3,
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
    rows = report.acknowledged_rows()
    assert rows["written"] > 0 and rows["checked"] > 0 and rows["missing"] == 0, rows
    assert report.primary_samples > 0 and report.double_primaries == []
    assert json.loads((tmp_path / "report.json").read_text())["invariant_violations"] == 0
