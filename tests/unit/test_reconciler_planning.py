"""The reconciler's pure planning: deadlines, health and drift, intents."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from reconciler.planning import (
    Enqueue,
    ExtendDeadline,
    InstanceView,
    NotePrimary,
    Observed,
    Transition,
    heal_backoff_s,
    plan,
)

NOW = datetime(2026, 1, 1, tzinfo=UTC)
HEALTHY = Observed(exists=True, running=True, healthy=True, read_only=False)


def view(state: str, **changes: object) -> InstanceView:
    base = InstanceView(
        state=state,
        spec_generation=1,
        observed_generation=1,
        deadline_at=None,
        deadline_retries=0,
        deletion_requested=False,
        billing_hold=False,
        suspended_by_billing=False,
        live_jobs=(),
        observed=HEALTHY if state in {"ready", "degraded", "suspended"} else None,
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def test_past_deadline_without_job_is_re_enqueued_then_failed() -> None:
    late = view("provisioning", deadline_at=NOW - timedelta(seconds=1))
    assert plan(late, NOW, max_retries=2) == [
        ExtendDeadline("provisioning past its deadline"),
        Enqueue("provision", "deadline re-enqueue"),
    ]
    exhausted = replace(late, deadline_retries=2)
    (action,) = plan(exhausted, NOW, max_retries=2)
    assert isinstance(action, Transition) and action.event == "fail"
    assert action.reason.startswith("timeout: provisioning") and action.code == "init_timeout"


def test_updating_past_deadline_degrades_instead_of_failing() -> None:
    late = view("updating", deadline_at=NOW - timedelta(seconds=1), deadline_retries=5)
    (action,) = plan(late, NOW, max_retries=2)
    assert action == Transition(
        "degrade", "timeout: updating exceeded its deadline after 5 re-enqueue(s)", code="update_timeout"
    )


def test_live_job_protects_an_instance_from_deadline_failure() -> None:
    late = view(
        "provisioning", deadline_at=NOW - timedelta(hours=1), deadline_retries=9, live_jobs=("provision",)
    )
    assert plan(late, NOW, max_retries=2) == []


def test_before_deadline_nothing_happens() -> None:
    assert plan(view("pending", deadline_at=NOW + timedelta(seconds=5)), NOW, 2) == []


def test_ready_but_down_is_degraded_and_healed() -> None:
    down = view("ready", observed=Observed(True, False, False, False, "server not running"))
    assert plan(down, NOW, 2) == [
        Transition("degrade", "observed server not running", code="unhealthy"),
        Enqueue("heal", "heal: server not running"),
    ]
    missing = view("ready", observed=Observed(False, False, False, False))
    assert plan(missing, NOW, 2)[0] == Transition("degrade", "observed missing", code="unhealthy")


def test_ready_but_down_under_a_suspend_or_resume_is_left_to_that_job() -> None:
    restarting = Observed(True, False, False, False, "server not running")
    for kind in ("suspend", "resume"):
        assert plan(view("ready", observed=restarting, live_jobs=(kind,)), NOW, 2) == []
    assert plan(view("ready", observed=restarting, live_jobs=("update",)), NOW, 2)[0] == Transition(
        "degrade", "observed server not running", code="unhealthy"
    )


def test_degraded_heals_or_recovers() -> None:
    broken = Observed(True, False, False, False, "down")
    assert plan(view("degraded", observed=broken), NOW, 2) == [Enqueue("heal", "heal: down")]
    assert plan(view("degraded", observed=broken, live_jobs=("heal",)), NOW, 2) == []
    assert plan(view("degraded"), NOW, 2) == [Transition("recover", "observed healthy again")]
    assert plan(view("degraded", live_jobs=("heal",)), NOW, 2) == []


def test_read_only_drift_both_ways() -> None:
    writable = view("suspended")
    assert plan(writable, NOW, 2) == [Enqueue("suspend", "suspended but writable: enforce read-only")]
    stuck_read_only = view("ready", observed=replace(HEALTHY, read_only=True))
    assert plan(stuck_read_only, NOW, 2) == [Enqueue("resume", "ready but read-only without a hold: resume")]
    held = replace(stuck_read_only, billing_hold=True)
    assert plan(held, NOW, 2) == [Enqueue("suspend", "billing hold")]


def test_a_suspended_instance_whose_server_stopped_is_suspended_again() -> None:
    stopped = Observed(True, False, False, False, "server not running")
    assert plan(view("suspended", observed=stopped), NOW, 2) == [
        Enqueue("suspend", "suspended but not running: restart read-only")
    ]
    assert plan(view("suspended", observed=stopped, live_jobs=("suspend",)), NOW, 2) == []
    assert plan(view("suspended", observed=Observed(False, False, False, False)), NOW, 2) == []


def test_intents() -> None:
    assert plan(view("ready", deletion_requested=True), NOW, 2) == [
        Enqueue("deprovision", "deletion requested")
    ]
    assert plan(view("provisioning", deletion_requested=True), NOW, 2) == []
    assert plan(view("ready", spec_generation=3, observed_generation=2), NOW, 2) == [
        Enqueue("update", "spec generation 3 not applied")
    ]
    assert plan(view("ready", spec_generation=3, observed_generation=2, live_jobs=("update",)), NOW, 2) == []
    suspended = view("suspended", suspended_by_billing=True, observed=replace(HEALTHY, read_only=True))
    assert plan(suspended, NOW, 2) == [Enqueue("resume", "billing hold released")]
    assert plan(replace(suspended, billing_hold=True), NOW, 2) == []


def test_a_degraded_instance_is_not_healed_again_before_its_heal_backoff_ends() -> None:
    down = Observed(True, False, False, False, "server not running")
    waiting = view("degraded", observed=down, heal_not_before=NOW + timedelta(seconds=1))
    assert plan(waiting, NOW, 2) == []
    due = replace(waiting, heal_not_before=NOW)
    assert plan(due, NOW, 2) == [Enqueue("heal", "heal: server not running")]
    # Healthy again, it recovers whatever the backoff says.
    assert plan(replace(waiting, observed=HEALTHY), NOW, 2) == [
        Transition("recover", "observed healthy again")
    ]


def test_the_heal_backoff_doubles_up_to_its_ceiling() -> None:
    assert [heal_backoff_s(n, 30.0, 3600.0) for n in (0, 1, 2, 3, 7, 8, 1000)] == [
        0.0,
        30.0,
        60.0,
        120.0,
        1920.0,
        3600.0,
        3600.0,
    ]


def test_an_archive_that_fails_degrades_a_ready_instance_and_only_a_working_one_recovers() -> None:
    failing = replace(HEALTHY, archive_failing=True, archive_detail="repo full")
    assert plan(view("ready", observed=failing), NOW, max_retries=2) == [
        Transition("degrade", "archive failing: repo full", code="archive_failing"),
        Enqueue("heal", "heal: archive failing: repo full"),
    ]
    # A queued backup (it would fail the same way) does not hold the degrade back; a suspend does.
    queued = plan(view("ready", observed=failing, live_jobs=("backup",)), NOW, max_retries=2)
    assert queued[0] == Transition("degrade", "archive failing: repo full", code="archive_failing")
    assert plan(view("ready", observed=failing, live_jobs=("suspend",)), NOW, max_retries=2) == []
    # Degraded: healed while it fails, recovered once the archive works again.
    assert plan(view("degraded", observed=failing, failure_code="archive_failing"), NOW, max_retries=2) == [
        Enqueue("heal", "heal: archive failing: repo full")
    ]
    assert plan(view("degraded", observed=HEALTHY, failure_code="archive_failing"), NOW, max_retries=2) == [
        Transition("recover", "observed healthy again")
    ]


def test_a_lost_primary_with_a_standby_to_take_over_is_a_failover_through_a_heal() -> None:
    lost = Observed(
        exists=True,
        running=False,
        healthy=False,
        read_only=False,
        detail="server not running",
        failover_to="member1",
    )
    why = "primary lost (server not running); member1 can take over"
    assert plan(view("ready", observed=lost), NOW, max_retries=2) == [
        Transition("degrade", f"failover: {why}", code="failover"),
        Enqueue("heal", f"failover: {why}"),
    ]
    # Without a standby to take over, the plain heal of a server that stopped.
    alone = replace(lost, failover_to=None)
    assert plan(view("ready", observed=alone), NOW, max_retries=2)[0] == Transition(
        "degrade", "observed server not running", code="unhealthy"
    )
    # Degraded with its heal (the failover) under way: nothing more; done, it recovers.
    assert plan(view("degraded", observed=lost, failure_code="failover", live_jobs=("heal",)), NOW, 2) == []
    assert plan(view("degraded", observed=HEALTHY, failure_code="failover"), NOW, 2) == [
        Transition("recover", "observed healthy again")
    ]


def test_a_failover_by_the_operator_is_recorded_and_left_to_it() -> None:
    failing = Observed(
        exists=True,
        running=True,
        healthy=False,
        read_only=False,
        detail="Failing over; 1/2 ready",
        failover_to="pg-x-2",
        primary="pg-x-1",
    )
    why = "primary pg-x-1 lost (Failing over; 1/2 ready); the operator promotes pg-x-2"
    # Degraded with the code, the lost and the promoted server named; no heal to fence or promote.
    assert plan(view("ready", observed=failing, fails_over_itself=True), NOW, max_retries=2) == [
        Transition(
            "degrade",
            f"failover: {why}",
            code="failover",
            detail={"primary": "pg-x-1", "failover_to": "pg-x-2"},
            operator_events=True,  # what the operator said of it goes with the record
        )
    ]
    degraded = view("degraded", observed=failing, failure_code="failover", fails_over_itself=True)
    assert plan(degraded, NOW, max_retries=2) == []  # the operator's work while it fails over
    # Its primary moved but a server is still not ready: a heal waits for the operator as ever.
    moved = replace(failing, failover_to=None, primary="pg-x-2")
    (action,) = plan(replace(degraded, observed=moved), NOW, max_retries=2)
    assert isinstance(action, Enqueue) and action.kind == "heal"
    # Healthy again: ready, the event naming the new primary (what the failover notice tells).
    done = replace(HEALTHY, primary="pg-x-2", primary_since="2026-01-01T00:00:05+00:00")
    (recover,) = plan(replace(degraded, observed=done), NOW, max_retries=2)
    assert isinstance(recover, Transition) and recover.event == "recover"
    assert recover.reason.startswith("failover: pg-x-2 promoted by the operator")
    assert recover.detail is not None and recover.detail["failover"]["promoted"] == "pg-x-2"
    assert recover.detail["failover"]["at"] == "2026-01-01T00:00:05+00:00"
    assert recover.operator_events
    # A failover the control plane carries out itself is its own heal's: no operator to ask.
    local = view("ready", observed=failing)
    assert not any(isinstance(a, Transition) and a.operator_events for a in plan(local, NOW, max_retries=2))


def test_a_failover_by_the_operator_between_two_observations_is_recorded_as_one() -> None:
    ready = view("ready", observed=replace(HEALTHY, primary="pg-x-1"), fails_over_itself=True)
    # First seen: remembered until the next state change (which forgets it).
    assert plan(ready, NOW, max_retries=2) == [NotePrimary("pg-x-1", "primary pg-x-1 seen")]
    assert plan(replace(ready, primary_seen="pg-x-1"), NOW, max_retries=2) == []
    # Another primary with no state change between: the failover no pass saw under way.
    moved = replace(ready, observed=replace(HEALTHY, primary="pg-x-2"), primary_seen="pg-x-1")
    why = "primary pg-x-1 replaced by pg-x-2 between two observations; the operator failed over"
    assert plan(moved, NOW, max_retries=2) == [
        Transition(
            "degrade",
            f"failover: {why}",
            code="failover",
            detail={"primary": "pg-x-1", "failover_to": "pg-x-2"},
            operator_events=True,  # what the operator said of it goes with the record
        )
    ]
    # Not while a job works on it (a switchover moves the primary), nor where the control plane
    # fails over itself (its failovers are its own heals), nor with nothing named.
    assert plan(replace(moved, live_jobs=("update",)), NOW, max_retries=2) == []
    assert plan(replace(moved, fails_over_itself=False), NOW, max_retries=2) == []
    assert plan(replace(moved, observed=HEALTHY), NOW, max_retries=2) == []


def test_a_standby_not_streaming_degrades_and_heals_until_it_streams_again() -> None:
    lagging = replace(HEALTHY, replication_degraded=True, replication_detail="0 of 1 standbys streaming")
    why = "replication degraded: 0 of 1 standbys streaming"
    assert plan(view("ready", observed=lagging), NOW, max_retries=2) == [
        Transition("degrade", why, code="replication_degraded"),
        Enqueue("heal", f"heal: {why}"),
    ]
    # Never recovered while it lags: healed again (after its backoff); recovered once it streams.
    degraded = view("degraded", observed=lagging, failure_code="replication_degraded")
    assert plan(degraded, NOW, max_retries=2) == [Enqueue("heal", f"heal: {why}")]
    assert plan(replace(degraded, live_jobs=("heal",)), NOW, max_retries=2) == []
    assert plan(replace(degraded, observed=HEALTHY), NOW, max_retries=2) == [
        Transition("recover", "observed healthy again")
    ]


def test_the_first_backup_is_taken_at_once_then_one_per_plan_interval() -> None:
    daily = view("ready", backup_interval_s=86400.0, created_at=NOW - timedelta(minutes=1))
    assert plan(daily, NOW, max_retries=2) == [Enqueue("backup", "first backup")]
    taken = replace(daily, newest_backup_at=NOW - timedelta(hours=23))
    assert plan(taken, NOW, max_retries=2) == []
    assert plan(taken, NOW + timedelta(hours=1), max_retries=2) == [Enqueue("backup", "scheduled backup")]
    # A suspended instance changes nothing: no scheduled backup.
    assert (
        plan(replace(daily, state="suspended", observed=replace(HEALTHY, read_only=True)), NOW, max_retries=2)
        == []
    )


def test_lost_data_recorded_without_a_restore_is_restored_unless_one_was_given_up() -> None:
    lost = Observed(exists=False, running=False, healthy=False, read_only=False, data_lost=True)
    backed_up = {"observed": lost, "failure_code": "data_lost", "newest_backup_at": NOW - timedelta(hours=1)}
    restore = Enqueue("restore", "data lost: restore from its backups and archive")
    # Recorded while suspended (no edge to degraded), then degraded by its failed resume: restored.
    assert plan(view("degraded", **backed_up), NOW, max_retries=2) == [restore]
    # A restore under way, one given up (left for a decision), or nothing held: nothing new.
    assert plan(view("degraded", **backed_up, live_jobs=("restore",)), NOW, max_retries=2) == []
    assert plan(view("degraded", **backed_up, restore_given_up=True), NOW, max_retries=2) == []
    assert plan(view("degraded", **(backed_up | {"newest_backup_at": None})), NOW, max_retries=2) == []
    # A backup the repository holds before its record is written (its window starts): restored too.
    in_window = backed_up | {"newest_backup_at": None, "window_held": True}
    assert plan(view("degraded", **in_window), NOW, max_retries=2) == [restore]
    degrade = Transition("degrade", "data lost: missing", code="data_lost")
    assert plan(view("ready", **in_window), NOW, max_retries=2) == [degrade, restore]
    # Suspended: recorded only.
    assert plan(view("suspended", **backed_up), NOW, max_retries=2) == []
