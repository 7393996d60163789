from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from controlplane.core.faultspec import Fault, FaultSpecError, parse_faults
from controlplane.core.step_errors import PermanentError, TemporaryError
from controlplane.runtime.settings import Settings, load
from provisioners import build
from provisioners.base import JOB_ATTEMPT, InstanceSpec
from provisioners.faults import FaultyProvisioner
from provisioners.local import LocalProvisioner
from provisioners.noop import NoopProvisioner


def test_fault_descriptions_parse() -> None:
    assert parse_faults("initialize_database:kill:1:after, apply_plan:fail_permanent:*") == [
        Fault("initialize_database", "kill", 1, "after"),
        Fault("apply_plan", "fail_permanent", None, "before"),
    ]
    assert parse_faults("allocate_storage:hang:2:0.5")[0].during_s == 0.5
    assert parse_faults("") == [] and parse_faults(None) == []
    for bad in ("nowhere:kill", "suspend:explode", "suspend", "suspend:kill:1:soon"):
        with pytest.raises(FaultSpecError):
            parse_faults(bad)


def test_build_picks_the_provisioner_and_wraps_it_in_faults(tmp_path: Path) -> None:
    assert isinstance(build(Settings(provisioner="noop")), NoopProvisioner)
    assert isinstance(build(Settings(provisioner="local", data_dir=tmp_path)), LocalProvisioner)
    faulty = build(load({"CONTROLPLANE_PROVISIONER": "noop", "CONTROLPLANE_FAULTS": "suspend:fail"}))
    assert isinstance(faulty, FaultyProvisioner) and isinstance(faulty.inner, NoopProvisioner)
    from_settings = build(Settings(provisioner="noop", faults="resume:kill"))
    assert isinstance(from_settings, FaultyProvisioner)


async def test_faults_fire_on_their_step_and_attempt_only() -> None:
    killed: list[int] = []
    faulty = FaultyProvisioner(
        NoopProvisioner(),
        parse_faults("suspend:fail:1,resume:fail_permanent:*,apply_plan:kill:2,deprovision:hang"),
        kill=lambda: killed.append(1),
    )
    iid, spec = uuid.uuid4(), InstanceSpec()
    with pytest.raises(TemporaryError, match="injected fault at suspend"):
        await faulty.suspend(iid, spec, 1)
    JOB_ATTEMPT.set(2)
    assert await faulty.suspend(iid, spec, 1) is False  # attempt 2: the fault is for attempt 1
    with pytest.raises(PermanentError):
        await faulty.resume(iid, spec, 1)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(faulty.apply_plan(iid, spec, 1), timeout=0.05)
    assert killed == [1]
    JOB_ATTEMPT.set(1)
    with pytest.raises(TimeoutError):  # hangs until cancelled
        await asyncio.wait_for(faulty.deprovision(iid, spec, 1), timeout=0.05)
    assert (await faulty.initialize_database(iid, spec, 1)).port == 5432
    assert faulty.fired == [("suspend", 1), ("resume", 2), ("apply_plan", 2), ("deprovision", 1)]
