"""Typed records, patches, payloads and the state sets derived from the lifecycle tables (pure)."""

from __future__ import annotations

import dataclasses
import re
import uuid

import pytest

import provisioners
from controlplane.core import kinds, lifecycle
from controlplane.core.records import KEEP, Instance, InstancePatch, Job, JobPatch
from controlplane.core.step_errors import PermanentError
from controlplane.db import sql
from controlplane.runtime.settings import Settings
from controlplane.services.policy import Policy

KINDS = ("local", "kubernetes", "noop")


def test_the_derived_state_sets_are_the_ones_the_design_names() -> None:
    assert lifecycle.DEPROVISIONABLE == ("ready", "degraded", "suspended")
    assert lifecycle.SETTLED == ("ready", "degraded", "suspended")
    assert lifecycle.PROVISIONING == ("pending", "provisioning")
    assert set(lifecycle.GONE_OR_GOING) == {"deprovisioning", "deleted", "failed"}
    assert lifecycle.WITH_SERVER == ("ready", "updating", "degraded", "suspended", "deprovisioning")
    assert lifecycle.JOB_HELD == ("claimed", "running") and lifecycle.JOB_TERMINAL == (
        "completed",
        "abandoned",
    )
    assert sql.HELD == "('claimed', 'running')" and sql.FINISHED == "('completed', 'abandoned')"
    assert lifecycle.BACKED_UP == ("ready", "suspended") and lifecycle.RESTORABLE == ("degraded",)


def test_what_a_provisioner_can_do_is_known_by_name_from_its_class() -> None:
    # The use cases' Policy reads these without building a provisioner.
    assert [
        (provisioners.supports_restore(k), provisioners.supports_backups(k), provisioners.reports_windows(k))
        for k in KINDS
    ] == [
        (True, True, True),
        (True, False, True),
        (False, False, False),
    ]
    policy = Policy.from_settings(Settings(provisioner="kubernetes"))
    assert (policy.provisioner, policy.supports_restore, policy.supports_backups) == (
        "kubernetes",
        True,
        False,
    )


@pytest.mark.parametrize(("patch", "table"), [(InstancePatch, sql.INSTANCE_TABLE), (JobPatch, sql.JOB_TABLE)])
def test_every_patch_field_is_a_key_the_transition_sql_reads(patch: type, table: sql.EntityTable) -> None:
    read = set(re.findall(r"m\.patch(?:->>?| \?) ?'(\w+)'", " ".join(table.sets)))
    assert {f.name for f in dataclasses.fields(patch)} == read


def test_a_patch_renders_set_fields_and_leaves_kept_ones_out() -> None:
    assert InstancePatch().to_json() == {}
    assert InstancePatch("apply_plan", 60.0, failure_reason=None).to_json() == {
        "progress": "apply_plan",
        "deadline_s": 60.0,
        "failure_reason": None,
    }
    assert InstancePatch(observed_spec={"plan": "dev"}, secret=KEEP).to_json() == {
        "observed_spec": {"plan": "dev"}
    }
    assert JobPatch(delay_s=0).to_json() == {"delay_s": 0}


def test_records_are_read_from_rows_and_a_missing_column_is_refused() -> None:
    row = {f.name: None for f in dataclasses.fields(Job)} | {"id": uuid.uuid4(), "kind": "noop", "extra": 1}
    assert Job.from_row(row).kind == "noop"
    with pytest.raises(KeyError, match="no column"):
        Instance.from_row({"id": uuid.uuid4()})


def test_payloads_round_trip_and_a_wrong_type_is_permanent() -> None:
    for cls in kinds.PAYLOADS.values():
        assert cls.from_json(cls(reason="why").to_json()) == cls(reason="why")
    suspend = kinds.SuspendPayload(billing=True)
    assert (
        suspend.to_json() == {"billing": True}
        and kinds.SuspendPayload.from_json({"billing": True}) == suspend
    )
    cleanup = kinds.DeprovisionPayload(skip_final_backup=True, cleanup=True)
    assert kinds.DeprovisionPayload.from_json(cleanup.to_json()) == cleanup
    assert kinds.UpdatePayload.from_json({"spec_generation": 3, "unknown": "kept aside"}).spec_generation == 3
    with pytest.raises(PermanentError, match="spec_generation"):
        kinds.UpdatePayload.from_json({"spec_generation": True})
