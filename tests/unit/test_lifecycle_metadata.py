"""The lifecycle's metadata, the failure reasons and the progress computed from step records (pure)."""

from __future__ import annotations

import re
import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import get_args

import pytest

from controlplane.core import failures, lifecycle, progress, reference
from controlplane.core.faultspec import parse_faults
from controlplane.core.kinds import DEPROVISION, OPERATION_STEPS, PROVISION, STEP_LABELS, UPDATE
from controlplane.core.lifecycle import INSTANCE, JOB, EdgeInfo, Lifecycle, StateInfo
from controlplane.core.records import Instance, StepRecord
from controlplane.core.step_errors import PermanentError
from controlplane.runtime.settings import Settings
from provisioners.base import STEPS, InstanceSpec
from provisioners.faults import FaultyProvisioner
from provisioners.noop import NoopProvisioner

T0 = datetime(2026, 5, 1, 10, 0, tzinfo=UTC)


def test_every_instance_state_and_edge_has_its_metadata() -> None:
    assert set(INSTANCE.state_info) == set(INSTANCE.states)
    assert set(INSTANCE.edge_info) == set(INSTANCE.transitions)
    for state, info in INSTANCE.state_info.items():
        assert info.label and info.description.endswith("."), state
        assert info.severity in get_args(lifecycle.Severity) and info.billing in get_args(lifecycle.Billing)
    assert set(lifecycle.SEVERITIES) == set(get_args(lifecycle.Severity))
    assert set(lifecycle.BILLING_CLASSES) == set(get_args(lifecycle.Billing))
    # The classes follow the table: transitional states are waits, the terminal ones end it.
    for state in INSTANCE.transitional:
        assert INSTANCE.state_info[state].severity == "transient"
    assert INSTANCE.state_info["deleted"].severity == "terminal"
    # Billing as RDS publishes it per status: running billed, stopped storage only, the rest not.
    billed = {s for s, i in INSTANCE.state_info.items() if i.billing == "billed"}
    assert billed == {"ready", "updating", "degraded"}
    assert INSTANCE.state_info["suspended"].billing == "storage_only"
    # Exactly the moves into failed or degraded alert.
    alerting = {edge for edge, info in INSTANCE.edge_info.items() if info.alerts}
    assert alerting == {edge for edge, dst in INSTANCE.transitions.items() if dst in ("failed", "degraded")}
    assert all(info.label for info in INSTANCE.edge_info.values())
    assert JOB.state_info == {} and JOB.alerts("running", "error") is False


def test_metadata_that_misses_a_state_or_an_edge_is_refused() -> None:
    info = dict(INSTANCE.state_info)
    del info["failed"]
    with pytest.raises(ValueError, match="state metadata"):
        replace(INSTANCE, state_info=info)
    edges = {k: v for k, v in INSTANCE.edge_info.items() if k != ("pending", "fail")}
    with pytest.raises(ValueError, match="edge metadata"):
        replace(INSTANCE, edge_info=edges)
    assert isinstance(replace(INSTANCE, edge_info={**INSTANCE.edge_info}), Lifecycle)
    assert StateInfo("x", "y.", "healthy", "billed").as_dict()["label"] == "x" and EdgeInfo("z", True).alerts


def test_every_transitional_state_has_the_deadline_the_reconciler_enforces() -> None:
    settings = Settings()
    document = reference.lifecycle_document(settings.reconciler.deadline_s)
    for state, info in document["instance"]["state_info"].items():
        enforced = settings.reconciler.deadline_s(state)
        assert info["transitional"] == (state in INSTANCE.transitional)
        assert info["deadline_s"] == (enforced if info["transitional"] else None), state
        assert (enforced is not None) == info["transitional"], state
    alerts = {(t["from"], t["event"]): t["alerts"] for t in document["instance"]["transitions"]}
    assert alerts[("provisioning", "fail")] and not alerts[("ready", "suspend")]
    assert {r["code"] for r in document["failure_reasons"]} == set(failures.REASONS)
    assert [s["name"] for s in document["steps"]["provision"]] == list(OPERATION_STEPS[PROVISION])


# A server path (API paths are fine), an address, an exception's class name or a provider's
# words: none is for customers.
INTERNAL = re.compile(r"(^|\s)/(?!v1/)\w|\w+Error|\w+Exception|\d+\.\d+\.\d+\.\d+|injected|kubernetes|pg_")


def test_failure_reasons_are_complete_and_say_nothing_internal() -> None:
    for code, reason in failures.REASONS.items():
        assert reason.code == code and re.fullmatch(r"[a-z_]+", code)
        assert reason.message.endswith(".") and reason.hint.endswith(".")
        assert not INTERNAL.search(reason.message) and not INTERNAL.search(reason.hint), code
        assert set(reason.states) <= {"failed", "degraded", "suspended"}
    assert failures.reason("no-such-code") == failures.reason(None) == failures.REASONS[failures.UNKNOWN]
    # A retry cannot help a quota, a spec that cannot be provisioned, or a deletion.
    refused = {c for c, r in failures.REASONS.items() if "failed" in r.states and not r.retryable}
    assert refused == {
        "quota_exceeded",
        "invalid_spec",
        "restore_unsupported",
        "restore_source_unavailable",
        "final_backup_failed",
        "deprovision_failed",
        "deprovision_timeout",
    }


@pytest.mark.parametrize(
    ("operation", "step", "error_code", "by_operator", "code"),
    [
        (PROVISION, "allocate_storage", None, False, "storage_allocation_failed"),
        (PROVISION, "configure_network", None, True, "network_configuration_failed"),
        (PROVISION, "initialize_database", None, False, "database_initialization_failed"),
        (PROVISION, "allocate_storage", "quota_exceeded", False, "quota_exceeded"),
        (PROVISION, None, None, False, "retries_exhausted"),
        (PROVISION, None, None, True, "abandoned_by_operator"),
        (PROVISION, None, "invalid_spec", False, "invalid_spec"),
        (UPDATE, "apply_plan", None, False, "plan_change_failed"),
        ("suspend", "suspend", None, False, "suspend_failed"),
        ("resume", "resume", None, False, "resume_failed"),
        ("heal", "configure_network", None, False, "heal_failed"),
        ("restore", "restore", None, False, "data_lost"),
        (DEPROVISION, "final_backup", None, False, "final_backup_failed"),
        (DEPROVISION, "deprovision", None, False, "deprovision_failed"),
        (DEPROVISION, None, "unheard_of", False, "deprovision_failed"),
    ],
)
def test_a_job_given_up_is_named_by_its_error_then_its_step_then_its_operation(
    operation: str, step: str | None, error_code: str | None, by_operator: bool, code: str
) -> None:
    assert failures.given_up(operation, step=step, error_code=error_code, by_operator=by_operator) == code
    assert code in failures.REASONS


def test_deadline_codes_and_coded_errors() -> None:
    assert [
        failures.deadline_missed(s) for s in ("pending", "provisioning", "updating", "deprovisioning")
    ] == [
        "init_timeout",
        "init_timeout",
        "update_timeout",
        "deprovision_timeout",
    ]
    with pytest.raises(PermanentError) as raised:
        InstanceSpec.from_row({"plan": "gigantic"})
    assert raised.value.code == "invalid_spec"
    assert set(STEPS) == set(STEP_LABELS) and "final_backup" in parse_faults("final_backup:fail")[0].step


async def test_the_quota_fault_raises_a_coded_permanent_error() -> None:
    faulty = FaultyProvisioner(NoopProvisioner(), parse_faults("allocate_storage:quota"))
    with pytest.raises(PermanentError) as raised:
        await faulty.allocate_storage(uuid.uuid4(), InstanceSpec(), 1)
    assert raised.value.code == failures.QUOTA_EXCEEDED


def instance_in(state: str, *, entered: datetime = T0, deadline_s: float = 600, **extra: object) -> Instance:
    values: dict[str, object] = {
        "id": uuid.uuid4(),
        "org_id": uuid.uuid4(),
        "name": "orders",
        "spec": {"plan": "dev"},
        "spec_generation": 1,
        "observed_generation": 0,
        "failed_generation": None,
        "observed_spec": None,
        "state": state,
        "state_version": 1,
        "state_entered_at": entered,
        "deadline_at": entered + timedelta(seconds=deadline_s),
        "deadline_retries": 0,
        "failure_reason": None,
        "failure_code": None,
        "progress": None,
        "deletion_protection": False,
        "deletion_requested_at": None,
        "skip_final_backup": False,
        "suspended_by_billing": False,
        "connection": None,
        "secret": None,
        "heal_failures": 0,
        "heal_given_up_at": None,
        "created_at": entered,
        "updated_at": entered,
        **extra,
    }
    return Instance(**values)  # type: ignore[arg-type]


def record(
    step: str,
    event: str,
    at_s: float,
    *,
    started_s: float | None = None,
    attempt: int = 1,
    code: str | None = None,
    kind: str = PROVISION,
    job: uuid.UUID | None = None,
) -> StepRecord:
    return StepRecord(
        id=int(at_s * 1000) + attempt,
        job_id=job or JOB_ID,
        instance_id=uuid.uuid4(),
        kind=kind,
        step=step,
        event=event,
        attempt=attempt,
        fence=attempt,
        worker="w",
        started_at=None if started_s is None else T0 + timedelta(seconds=started_s),
        code=code,
        error=None if code is None else "raw",
        at=T0 + timedelta(seconds=at_s),
    )


JOB_ID = uuid.uuid4()
USUAL = {
    (PROVISION, "allocate_storage"): 1.0,
    (PROVISION, "configure_network"): 1.0,
    (PROVISION, "initialize_database"): 2.0,
    (PROVISION, "configure_archive"): 1.0,
}


def test_progress_shows_each_step_with_its_state_and_times() -> None:
    inst = instance_in("provisioning")
    records = [
        record("allocate_storage", "started", 0.1),
        record("allocate_storage", "finished", 0.6, started_s=0.1),
        record("configure_network", "started", 0.7),
    ]
    running = progress.LiveJob(JOB_ID, PROVISION, 1, "running")
    now = T0 + timedelta(seconds=1.0)
    doc = progress.progress(inst, records, running, USUAL, now)
    assert doc is not None
    assert (doc["operation"], doc["job_id"], doc["attempt"], doc["current_step"]) == (
        PROVISION,
        JOB_ID,
        1,
        "configure_network",
    )
    states = [(s["name"], s["state"], s["attempts"], s["duration_s"]) for s in doc["steps"]]
    assert states == [
        ("allocate_storage", "done", 1, 0.5),
        ("configure_network", "running", 1, 0.3),
        ("initialize_database", "pending", 0, None),
        ("configure_archive", "pending", 0, None),
    ]
    assert doc["steps"][0]["finished_at"] == T0 + timedelta(seconds=0.6)
    assert [s["label"] for s in doc["steps"]] == [
        "Allocate storage",
        "Configure the network",
        "Initialize the database",
        "Start continuous backup",
    ]
    # Expected: from the running step's start, its usual second and the 3 s still to go, plus 2 s of slack.
    assert doc["expected_by"] == T0 + timedelta(seconds=0.7 + 1.0 + 3.0 + 2.0)
    assert doc["overdue"] is False and doc["deadline_at"] == inst.deadline_at
    assert progress.progress(instance_in("ready"), records, running, USUAL, now) is None


def test_an_overdue_step_shows_overdue_before_the_deadline() -> None:
    inst = instance_in("provisioning", deadline_s=600)
    records = [record("allocate_storage", "started", 0.1)]
    running = progress.LiveJob(JOB_ID, PROVISION, 1, "running")
    on_time = progress.progress(inst, records, running, USUAL, T0 + timedelta(seconds=5))
    late = progress.progress(inst, records, running, USUAL, T0 + timedelta(seconds=30))
    assert on_time is not None and late is not None and inst.deadline_at is not None
    assert on_time["overdue"] is False
    assert inst.deadline_at is not None
    assert late["overdue"] is True and late["expected_by"] < T0 + timedelta(seconds=30) < inst.deadline_at
    # Without history there is nothing to expect but the deadline.
    blind = progress.progress(inst, records, running, {}, T0 + timedelta(seconds=30))
    assert blind is not None and blind["expected_by"] == inst.deadline_at and blind["overdue"] is False
    # Never expected later than the deadline.
    slow = {k: 1000.0 for k in USUAL}
    capped = progress.progress(inst, records, running, slow, T0 + timedelta(seconds=601))
    assert capped is not None and capped["expected_by"] == inst.deadline_at and capped["overdue"] is True


def test_a_failed_attempt_and_a_lost_worker_show_the_step_failed_with_its_reason() -> None:
    inst = instance_in("provisioning")
    failed = [
        record("allocate_storage", "started", 0.1),
        record("allocate_storage", "finished", 0.2, started_s=0.1),
        record("configure_network", "started", 0.3),
        record("configure_network", "failed", 0.4, started_s=0.3, code="quota_exceeded"),
    ]
    waiting = progress.LiveJob(JOB_ID, PROVISION, 1, "failed")
    doc = progress.progress(inst, failed, waiting, USUAL, T0 + timedelta(seconds=1))
    assert doc is not None and doc["current_step"] == "configure_network"
    network = doc["steps"][1]
    assert network["state"] == "failed" and network["failure"] == failures.REASONS["quota_exceeded"].as_dict()
    # Killed mid-step: the attempt ended without a word, the step counts as failed at that step.
    lost = [record("allocate_storage", "started", 0.1)]
    requeued = progress.LiveJob(JOB_ID, PROVISION, 1, "queued")
    doc = progress.progress(inst, lost, requeued, USUAL, T0 + timedelta(seconds=1))
    assert doc is not None and doc["steps"][0]["state"] == "failed"
    assert doc["steps"][0]["failure"]["code"] == "storage_allocation_failed"
    # Attempt 2 runs the first step again: it is running, with two attempts.
    again = [*lost, record("allocate_storage", "started", 5.0, attempt=2)]
    doc = progress.progress(inst, again, progress.LiveJob(JOB_ID, PROVISION, 2, "running"), USUAL, T0)
    assert doc is not None and (doc["steps"][0]["state"], doc["steps"][0]["attempts"], doc["attempt"]) == (
        "running",
        2,
        2,
    )


def test_a_pending_instance_and_a_deletion_without_final_backup() -> None:
    pending = instance_in("pending", deadline_s=300)
    queued = progress.LiveJob(JOB_ID, PROVISION, 0, "queued")
    doc = progress.progress(pending, [], queued, USUAL, T0 + timedelta(seconds=1))
    assert doc is not None and [s["state"] for s in doc["steps"]] == ["pending"] * 4
    assert doc["current_step"] is None and doc["expected_by"] == T0 + timedelta(seconds=5.0 + 2.0)
    deleting = instance_in("deprovisioning", skip_final_backup=True)
    doc = progress.progress(deleting, [], None, {}, T0)
    assert doc is not None and [s["name"] for s in doc["steps"]] == ["deprovision"]
    assert doc["job_id"] is None and doc["attempt"] is None
    kept = progress.steps_of(DEPROVISION)
    assert kept == ("final_backup", "deprovision")
    # Steps of an earlier stay (before the state was entered) are not this stay's.
    earlier = [record("allocate_storage", "finished", -5, started_s=-6)]
    doc = progress.progress(instance_in("provisioning"), earlier, None, USUAL, T0)
    assert doc is not None and doc["steps"][0]["state"] == "pending"
