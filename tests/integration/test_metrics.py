"""Metrics written by the transition path: moves, time in state, provisioning duration."""

from __future__ import annotations

from prometheus_client import REGISTRY

from controlplane.db.connection import AsyncConn
from controlplane.db.transitions import transition
from tests.factories import TEST_ACTOR, make_instance


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_transitions_feed_the_histograms(conn: AsyncConn) -> None:
    moves = sample(
        "controlplane_transitions_total",
        entity="instance",
        from_state="provisioning",
        to_state="ready",
        event="provisioned",
    )
    pending_stays = sample("controlplane_time_in_state_seconds_count", entity="instance", state="pending")
    provisioned = sample("controlplane_provisioning_duration_seconds_count")
    inst = await make_instance(conn)
    row = await transition(
        conn, "instance", inst["id"], "start_provisioning", 0, expected_state="pending", actor=TEST_ACTOR
    )
    await transition(
        conn, "instance", inst["id"], "provisioned", 1, expected_state=row["state"], actor=TEST_ACTOR
    )
    assert (
        sample(
            "controlplane_transitions_total",
            entity="instance",
            from_state="provisioning",
            to_state="ready",
            event="provisioned",
        )
        == moves + 1
    )
    assert sample("controlplane_time_in_state_seconds_count", entity="instance", state="pending") == (
        pending_stays + 1
    )
    assert sample("controlplane_provisioning_duration_seconds_count") == provisioned + 1
