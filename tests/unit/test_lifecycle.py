"""The two lifecycle tables: every edge, every refusal, reachability, and a stateful model check."""

from __future__ import annotations

import uuid
from collections import deque

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from controlplane.core import lifecycle
from controlplane.core.lifecycle import INSTANCE, JOB, IllegalTransition, Lifecycle

# The tables of DESIGN.md section 3, written out by hand per state: event -> target.
# Deliberately a different shape from controlplane.core.lifecycle so that a slip in one shows up.
INSTANCE_MODEL: dict[str, dict[str, str]] = {
    "pending": {"start_provisioning": "provisioning", "fail": "failed"},
    "provisioning": {"provisioned": "ready", "fail": "failed"},
    "ready": {
        "update": "updating",
        "degrade": "degraded",
        "suspend": "suspended",
        "deprovision": "deprovisioning",
    },
    "updating": {"updated": "ready", "degrade": "degraded", "fail": "failed"},
    "degraded": {"recover": "ready", "deprovision": "deprovisioning", "fail": "failed"},
    "suspended": {"resume": "ready", "deprovision": "deprovisioning"},
    "deprovisioning": {"deprovisioned": "deleted", "fail": "failed"},
    "deleted": {},
    "failed": {},
}

JOB_MODEL: dict[str, dict[str, str]] = {
    "queued": {"claim": "claimed"},
    "claimed": {"start": "running", "reclaim": "queued"},
    "running": {"finish": "completed", "error": "failed", "pause": "paused", "reclaim": "queued"},
    "paused": {"resume": "running", "abandon": "abandoned"},
    "failed": {"retry": "queued", "abandon": "abandoned"},
    "completed": {},
    "abandoned": {},
}

MODELS: dict[str, tuple[Lifecycle, dict[str, dict[str, str]]]] = {
    "instance": (INSTANCE, INSTANCE_MODEL),
    "job": (JOB, JOB_MODEL),
}


def model_events(model: dict[str, dict[str, str]]) -> set[str]:
    return {event for moves in model.values() for event in moves}


def all_pairs(entity: str) -> list[tuple[str, str]]:
    """Every (state, event) pair of one lifecycle, from both the table and the model."""
    table, model = MODELS[entity]
    states = set(table.states) | set(model)
    events = set(table.events()) | model_events(model)
    return sorted((state, event) for state in states for event in events)


EDGES = [
    (entity, src, event, dst)
    for entity, (_, model) in MODELS.items()
    for src, moves in model.items()
    for event, dst in moves.items()
]

ILLEGAL = [
    (entity, state, event)
    for entity in MODELS
    for state, event in all_pairs(entity)
    if event not in MODELS[entity][1].get(state, {})
]


@pytest.mark.parametrize(("entity", "src", "event", "dst"), EDGES)
def test_every_edge_applies(entity: str, src: str, event: str, dst: str) -> None:
    assert lifecycle.apply(entity, src, event) == dst
    assert MODELS[entity][0].apply(src, event, uuid.uuid4()) == dst


@pytest.mark.parametrize(("entity", "state", "event"), ILLEGAL)
def test_every_other_pair_is_illegal(entity: str, state: str, event: str) -> None:
    entity_id = uuid.uuid4()
    with pytest.raises(IllegalTransition) as caught:
        lifecycle.apply(entity, state, event, entity_id)
    message = str(caught.value)
    for part in (entity, str(entity_id), state, event):
        assert part in message
    assert (caught.value.entity, caught.value.entity_id) == (entity, entity_id)
    assert (caught.value.state, caught.value.event) == (state, event)


def test_illegal_pairs_cover_everything_but_the_edges() -> None:
    for entity, (table, _) in MODELS.items():
        edges = {(e[1], e[2]) for e in EDGES if e[0] == entity}
        illegal = {(e[1], e[2]) for e in ILLEGAL if e[0] == entity}
        assert edges | illegal == set(all_pairs(entity))
        assert not edges & illegal
        assert len(illegal) == len(table.states) * len(table.events()) - len(table.transitions)


@pytest.mark.parametrize("entity", MODELS)
def test_table_equals_the_design(entity: str) -> None:
    table, model = MODELS[entity]
    assert set(table.states) == set(model)
    assert dict(table.transitions) == {
        (src, event): dst for src, moves in model.items() for event, dst in moves.items()
    }
    assert set(table.events()) == model_events(model)


def test_exact_sizes() -> None:
    assert (len(INSTANCE.states), len(INSTANCE.transitions), len(INSTANCE.edges())) == (9, 18, 18)
    assert (len(JOB.states), len(JOB.transitions), len(JOB.edges())) == (7, 11, 11)
    assert len(set(INSTANCE.states)) == 9 and len(set(JOB.states)) == 7


def test_initial_and_terminal_states() -> None:
    assert (INSTANCE.initial, INSTANCE.terminal) == ("pending", frozenset({"deleted", "failed"}))
    assert (JOB.initial, JOB.terminal) == ("queued", frozenset({"completed", "abandoned"}))


@pytest.mark.parametrize(
    ("entity", "state"),
    [(entity, state) for entity, (table, _) in MODELS.items() for state in sorted(table.terminal)],
)
def test_terminal_states_reject_every_event(entity: str, state: str) -> None:
    table, _ = MODELS[entity]
    assert table.allowed_events(state) == ()
    for event in table.events():
        with pytest.raises(IllegalTransition):
            table.apply(state, event, "x")


@pytest.mark.parametrize("entity", MODELS)
def test_only_terminal_states_have_no_way_out(entity: str) -> None:
    table, _ = MODELS[entity]
    dead_ends = {state for state in table.states if not table.allowed_events(state)}
    assert dead_ends == table.terminal


@pytest.mark.parametrize("entity", MODELS)
def test_every_state_is_reachable_from_the_initial_one(entity: str) -> None:
    table, _ = MODELS[entity]
    seen = {table.initial}
    frontier = deque([table.initial])
    while frontier:
        state = frontier.popleft()
        for event in table.allowed_events(state):
            target = table.apply(state, event)
            if target not in seen:
                seen.add(target)
                frontier.append(target)
    assert seen == set(table.states)


@pytest.mark.parametrize(
    ("entity", "state"),
    [(entity, state) for entity, (table, _) in MODELS.items() for state in table.states],
)
def test_allowed_events(entity: str, state: str) -> None:
    table, model = MODELS[entity]
    allowed = lifecycle.allowed_events(entity, state)
    assert set(allowed) == set(model[state])
    assert len(allowed) == len(set(allowed))
    table_order = [event for (src, event) in table.transitions if src == state]
    assert list(allowed) == table_order


def test_unknown_entity_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown entity kind"):
        lifecycle.apply("database", "pending", "fail")


def test_unknown_state_or_event_is_illegal() -> None:
    with pytest.raises(IllegalTransition):
        lifecycle.apply("instance", "exploded", "fail")
    with pytest.raises(IllegalTransition):
        lifecycle.apply("job", "queued", "teleport")


def test_tables_are_read_only() -> None:
    with pytest.raises(TypeError):
        INSTANCE.transitions[("failed", "revive")] = "ready"  # type: ignore[index]


class LifecycleAgainstModel(RuleBasedStateMachine):
    """Random events against one lifecycle; `apply` must agree with the hand-written model."""

    entity: str = ""
    model: dict[str, dict[str, str]] = {}

    def __init__(self) -> None:
        super().__init__()
        self.table = lifecycle.lifecycle(self.entity)
        self.state = self.table.initial
        self.entity_id = uuid.uuid4()

    def fire(self, event: str) -> None:
        expected = self.model[self.state].get(event)
        if expected is None:
            before = self.state
            with pytest.raises(IllegalTransition) as caught:
                self.state = lifecycle.apply(self.entity, self.state, event, self.entity_id)
            assert self.state == before
            assert caught.value.state == before and caught.value.event == event
        else:
            self.state = lifecycle.apply(self.entity, self.state, event, self.entity_id)
            assert self.state == expected

    @rule(data=st.data())
    def send_an_allowed_event(self, data: st.DataObject) -> None:
        moves = sorted(self.model[self.state])
        if moves:
            self.fire(data.draw(st.sampled_from(moves)))

    @invariant()
    def state_is_known(self) -> None:
        assert self.state in self.model
        assert set(self.table.allowed_events(self.state)) == set(self.model[self.state])


class InstanceLifecycleMachine(LifecycleAgainstModel):
    entity = "instance"
    model = INSTANCE_MODEL

    @rule(event=st.sampled_from(sorted(model_events(INSTANCE_MODEL) | {"create", "resize"})))
    def send(self, event: str) -> None:
        self.fire(event)


class JobLifecycleMachine(LifecycleAgainstModel):
    entity = "job"
    model = JOB_MODEL

    @rule(event=st.sampled_from(sorted(model_events(JOB_MODEL) | {"enqueue", "cancel"})))
    def send(self, event: str) -> None:
        self.fire(event)


STATEFUL = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestInstanceLifecycleStateful = InstanceLifecycleMachine.TestCase
TestInstanceLifecycleStateful.settings = STATEFUL
TestJobLifecycleStateful = JobLifecycleMachine.TestCase
TestJobLifecycleStateful.settings = STATEFUL
