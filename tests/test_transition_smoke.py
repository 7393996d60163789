from __future__ import annotations

import pytest

from controlplane import audit
from controlplane.db import AsyncConn
from controlplane.jobs import NewJob, enqueue
from controlplane.transitions import Conflict, transition
from tests.factories import TEST_ACTOR, make_instance


async def test_instance_moves_and_audits(conn: AsyncConn) -> None:
    inst = await make_instance(conn)
    row = await transition(
        conn,
        "instance",
        inst["id"],
        "start_provisioning",
        0,
        expected_state="pending",
        actor=TEST_ACTOR,
        reason="go",
        patch={"progress": "allocate_storage"},
    )
    assert row["state"] == "provisioning" and row["state_version"] == 1
    assert row["progress"] == "allocate_storage"
    with pytest.raises(Conflict):
        await transition(
            conn, "instance", inst["id"], "start_provisioning", 0, expected_state="pending", actor=TEST_ACTOR
        )
    job = await enqueue(conn, NewJob("provision", inst["id"]), TEST_ACTOR)
    again = await enqueue(conn, NewJob("provision", inst["id"]), TEST_ACTOR)
    assert job.created and not again.created and again.job["id"] == job.job["id"]
    assert await audit.verify(conn) == []
