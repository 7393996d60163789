"""The chaos soak's pure parts: its schedule, its invariants (each one can fail), its report."""

from __future__ import annotations

import itertools
import json
import uuid
from collections import Counter
from typing import Any

import pytest

from controlplane.chaos import plan


def test_the_schedule_is_seeded_bounded_and_gives_every_kind_its_turn() -> None:
    faults = plan.schedule(7, 600, 5, 40)
    assert faults == plan.schedule(7, 600, 5, 40)
    assert faults != plan.schedule(8, 600, 5, 40)
    gaps = [b.at_s - a.at_s for a, b in itertools.pairwise(faults)]
    assert all(5 - 0.01 <= gap <= 40 + 0.01 for gap in gaps) and 5 <= faults[0].at_s <= 40
    assert faults[-1].at_s < 600
    for start in range(0, len(faults) - len(plan.FAULT_KINDS) + 1, len(plan.FAULT_KINDS)):
        window = faults[start : start + len(plan.FAULT_KINDS)]
        assert sorted(f.kind for f in window) == sorted(plan.FAULT_KINDS)
    assert plan.schedule(1, 3, 5, 40) == []
    with pytest.raises(ValueError, match="0 < min <= max"):
        plan.schedule(1, 60, 10, 5)
    with pytest.raises(ValueError, match="no fault kinds"):
        plan.schedule(1, 60, kinds=())


def test_percentile_is_nearest_rank() -> None:
    assert plan.percentile([], 95) is None
    assert plan.percentile([3.0], 95) == 3.0
    values = [float(v) for v in range(1, 21)]
    assert plan.percentile(values, 95) == 19.0 and plan.percentile(values, 100) == 20.0
    assert plan.percentile(values, 50) == 10.0


ORG = str(uuid.uuid4())


def _instance(state: str = "ready", plan_name: str = "dev", **extra: Any) -> dict[str, Any]:
    row = {
        "id": str(uuid.uuid4()),
        "org_id": ORG,
        "state": state,
        "plan": plan_name,
        "spec_generation": 1,
        "observed_generation": 1,
        "failed_generation": None,
        "suspended_by_billing": False,
        "failure_reason": None,
    }
    return row | extra


def _world(*instances: dict[str, Any], hold: bool = False) -> tuple[plan.Ledger, dict[str, Any]]:
    """A consistent ledger and snapshot: every instance created by a key, its resources held."""
    ledger = plan.Ledger()
    idempotency, inventory, events = [], [], []
    for row in instances:
        key = f"key-{row['id']}"
        ledger.creates[key] = row["id"]
        ledger.plans[row["id"]] = row["plan"]
        idempotency.append({"org_id": ORG, "key": key, "status_code": 202, "instance_id": row["id"]})
        events.append({"instance_id": row["id"], "event": "create"})
        if row["state"] == "deleted":
            ledger.deletes.add(row["id"])
        else:
            inventory += [(kind, row["id"]) for kind in sorted(plan.RESOURCES_OF_A_LIVE_INSTANCE)]
    ledger.billing[ORG] = (5, hold)
    snapshot = {
        "instances": list(instances),
        "jobs": [{"id": 1, "kind": "provision", "state": "completed", "instance_id": instances[0]["id"]}],
        "organisations": [{"id": ORG, "billing_hold": hold}],
        "idempotency": idempotency,
        "stripe_events": [{"id": "evt_1"}],
        "inventory": inventory,
        "audit_mismatches": [],
        "instance_events": events,
    }
    ledger.webhook_deliveries["evt_1"] = 2
    return ledger, snapshot


def _check(ledger: plan.Ledger, snapshot: dict[str, Any]) -> list[str]:
    return plan.violations(ledger, plan.Snapshot(**snapshot))


def test_a_consistent_end_state_has_no_violation() -> None:
    ledger, snapshot = _world(_instance(), _instance("deleted"))
    assert _check(ledger, snapshot) == []
    assert plan.converged(plan.Snapshot(**snapshot))
    held_ledger, held = _world(_instance("suspended", suspended_by_billing=True), hold=True)
    assert _check(held_ledger, held) == []


def test_each_invariant_is_seen_broken() -> None:
    ready, gone = _instance(), _instance("deleted")
    ledger, snapshot = _world(ready, gone)

    def broken(change: Any) -> list[str]:
        fresh_ledger, fresh = _world(dict(ready), dict(gone))
        change(fresh_ledger, fresh)
        return _check(fresh_ledger, fresh)

    assert broken(lambda _l, s: s["audit_mismatches"].append("job 1: replay says queued")) == [
        "audit: job 1: replay says queued"
    ]
    assert "job lost" in " ".join(broken(lambda _l, s: s["jobs"][0].update(state="running")))
    assert "did not converge" in " ".join(broken(lambda _l, s: s["instances"][0].update(state="updating")))
    assert "its deletion was accepted" in " ".join(
        broken(lambda _l, s: s["instances"][1].update(state="ready"))
    )
    assert "no deletion of it was accepted" in " ".join(broken(lambda led, _s: led.deletes.clear()))
    assert "last accepted change asked 'small'" in " ".join(
        broken(lambda led, _s: led.plans.update({ready["id"]: "small"}))
    )
    assert "never applied" in " ".join(broken(lambda _l, s: s["instances"][0].update(spec_generation=2)))
    assert "2 stored answers" in " ".join(
        broken(lambda _l, s: s["idempotency"].append(dict(s["idempotency"][0])))
    )
    assert "an orphan row" in " ".join(broken(lambda _l, s: s["instances"].append(_instance("deleted"))))
    assert "never recorded" in " ".join(broken(lambda _l, s: s["stripe_events"].clear()))
    assert "its newest event says True" in " ".join(
        broken(lambda led, _s: led.billing.update({ORG: (9, True)}))
    )
    assert "on a billing hold" in " ".join(
        broken(lambda _l, s: s["organisations"][0].update(billing_hold=True))
    )
    assert "orphan: data_directory of a deleted instance" in " ".join(
        broken(lambda _l, s: s["inventory"].append(("data_directory", gone["id"])))
    )
    assert "has no server" in " ".join(broken(lambda _l, s: s["inventory"].remove(("server", ready["id"]))))
    assert "holds 2 ports" in " ".join(broken(lambda _l, s: s["inventory"].append(("port", ready["id"]))))
    assert "provisioned 2 times" in " ".join(
        broken(
            lambda _l, s: s["instance_events"].extend(
                [{"instance_id": ready["id"], "event": "provisioned"}] * 2
            )
        )
    )
    assert _check(ledger, snapshot) == []


def test_the_report_tables_faults_operations_and_violations() -> None:
    report = plan.Report(seed=3, minutes=2, processes={"API": 2, "workers": 2})
    report.faults = [
        plan.FaultRecord("worker", 5.0, "w-1", 4.0),
        plan.FaultRecord("worker", 30.0, "w-2", 2.0),
        plan.FaultRecord("api", 12.0, "api-0", None),
    ]
    report.attempted = Counter({"create": 5})
    report.completed = Counter({"create": 4})
    report.refused = Counter({"create": 1})
    report.deferred = Counter({"worker": 1})
    report.skipped = Counter({"customer_server": 1})
    report.violations = ["api (api-0) not recovered within 180s"]
    by_kind = report.by_kind()
    assert by_kind["worker"] == {
        "injected": 2,
        "deferred": 1,
        "skipped": 0,
        "unrecovered": 0,
        "recovery_max_s": 4.0,
        "recovery_p95_s": 4.0,
    }
    assert by_kind["api"]["unrecovered"] == 1 and by_kind["api"]["recovery_max_s"] is None
    text = report.markdown()
    assert "| worker | 2 | 2 | 4.0 | 4.0 | 1 | 0 |" in text
    assert "| customer_server | 0 | 0 | n/a | n/a | 0 | 1 |" in text
    assert "| create | 5 | 4 | 1 |" in text and "**Invariant violations: 1**" in text
    data = json.loads(report.dumps())
    assert data["invariant_violations"] == 1 and data["operations"]["create"]["completed"] == 4


def test_not_converged_while_an_intent_waits_for_the_reconciler() -> None:
    def settled(**change: Any) -> bool:
        _, snapshot = _world(_instance(**change))
        return plan.converged(plan.Snapshot(**snapshot))

    assert settled()
    assert not settled(deletion_requested=True)  # ready, the deprovision not enqueued yet
    assert not settled(spec_generation=2)  # a plan change accepted, its update not enqueued yet
    assert settled(spec_generation=2, failed_generation=2)  # given up: nothing will retry it
    assert not settled(state="suspended", suspended_by_billing=True)  # the release not carried out
    assert not settled(state="provisioning")
    _, held = _world(_instance(), hold=True)
    assert not plan.converged(plan.Snapshot(**held))  # the hold not carried out
    ledger, recorded = _world(_instance(deletion_requested=True))
    assert "its deletion is recorded, but it is ready" in " ".join(_check(ledger, recorded))


def test_a_row_older_than_the_archive_timeout_must_survive_a_removed_data_directory() -> None:
    instances = [
        {"id": "a", "state": "ready"},
        {"id": "b", "state": "ready"},
        {"id": "c", "state": "deleted"},
    ]
    losses = [
        plan.DataLoss("a", 10.2, kept_present=True, late_present=False),  # the late row may go
        plan.DataLoss("b", 10.4, kept_present=False, late_present=False),
        plan.DataLoss("c", 10.0),  # deleted meanwhile: nothing to look at
    ]
    (violation,) = plan.durability_violations(losses, instances)
    assert violation.startswith("instance b: a row committed 10.4 s before its data directory")
    assert plan.durability_violations([plan.DataLoss("a", 10.0)], instances) == [
        "instance a: never seen restored after its data directory was removed"
    ]
    report = plan.Report(seed=1, minutes=1, processes={}, data_losses=losses)
    assert "Data directories removed: 3; the row older than the archive timeout survived 1 time(s)" in (
        report.markdown()
    )
    assert report.as_json()["data_losses"][1]["kept_present"] is False


def test_every_acknowledged_row_must_be_read_back_after_an_ha_fault() -> None:
    instances = [
        {"id": "a", "state": "ready"},
        {"id": "b", "state": "ready"},
        {"id": "c", "state": "deleted"},
        {"id": "d", "state": "suspended"},
    ]
    probes = [
        # Rows 4 and 5 were sent, never acknowledged: they may be there or not.
        plan.WriteProbe("a", plan.HA_PRIMARY, [1, 2, 3], attempted=5, errors=2, present=[1, 2, 3, 5]),
        plan.WriteProbe("b", plan.HA_STANDBY, [1, 2, 3, 4], present=[1, 3]),
        plan.WriteProbe("c", plan.POOLER, [1, 2]),  # deleted meanwhile: nothing to read
        plan.WriteProbe("d", plan.HA_PRIMARY, [1]),  # still there, never read back
        plan.WriteProbe("a", plan.POOLER, []),  # nothing acknowledged, nothing to read
    ]
    assert plan.acknowledged_row_violations(probes, instances) == [
        "instance b: 2 of 4 acknowledged rows lost across its ha_standby fault (ids 2, 4)",
        "instance d: the 1 rows acknowledged around its ha_primary fault were never read back",
    ]
    many = plan.WriteProbe("a", plan.HA_PRIMARY, list(range(1, 21)), present=[])
    (line,) = plan.acknowledged_row_violations([many], instances)
    assert "20 of 20" in line and line.endswith("(ids 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, ...)")
    assert plan.acknowledged_row_violations(probes[:1] + probes[2:3], instances) == []
    report = plan.Report(seed=1, minutes=1, processes={}, write_probes=probes, primary_samples=42)
    assert report.acknowledged_rows() == {"probes": 5, "written": 10, "checked": 7, "missing": 2}
    text = report.markdown()
    row = "| no acknowledged row lost (5 writers) | 7 of 10 acknowledged rows read back | 2 missing |"
    assert row in text
    assert "| never two writable primaries | 42 samples | 0 double primaries |" in text
    data = report.as_json()
    assert data["acknowledged_rows"]["missing"] == 2 and data["primary_samples"] == 42
    assert data["write_probes"][0] == {
        "instance_id": "a",
        "fault": "ha_primary",
        "acknowledged": 3,
        "attempted": 5,
        "errors": 2,
        "read_back": True,
    }


def _round(*samples: tuple[str, bool | None], instance: str = "i") -> list[plan.PrimarySample]:
    return [plan.PrimarySample(instance, server, writable) for server, writable in samples]


def test_two_writable_primaries_only_when_proven_by_one_round() -> None:
    def found(*samples: tuple[str, bool | None]) -> list[str]:
        return plan.double_primary_findings(_round(*samples))

    # A failover seen mid-round: A writable, then B writable, A no longer: not proven (A may have
    # been fenced before B was promoted).
    assert found(("m0", True), ("m1", True), ("m0", False)) == []
    assert found(("m0", True), ("m1", True), ("m0", None)) == []
    assert found(("m0", True), ("m1", False), ("m0", True)) == []
    assert found(("m0", None), ("m1", True), ("m0", True)) == []
    assert found() == []
    (line,) = found(("m0", True), ("m1", True), ("m0", True))
    assert line == (
        "instance i: two writable primaries at once (m0 was writable before and after m1 answered writable)"
    )
    # There and back over three servers: B and C both writable between two writable samples of B.
    (line,) = found(("m0", False), ("m1", True), ("m2", True), ("m1", True), ("m0", False))
    assert "m1 was writable before and after m2" in line
    # One finding per pair, however many times the round proves it.
    assert len(found(("m0", True), ("m1", True), ("m0", True), ("m1", True))) == 1
    # Other instances' servers do not pair with these.
    mixed = _round(("m0", True)) + _round(("m0", True), instance="j") + _round(("m0", True))
    assert plan.double_primary_findings(mixed) == []
    mixed = _round(("m0", True)) + _round(("m1", True), instance="j") + _round(("m0", True))
    assert plan.double_primary_findings(mixed) == []
