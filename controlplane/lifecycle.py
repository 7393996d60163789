"""The two lifecycles (instance and job) as data, and the one pure function that applies an event."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Literal

EntityKind = Literal["instance", "job"]


class IllegalTransition(Exception):
    """An event that the lifecycle table does not allow from the entity's current state."""

    def __init__(self, entity: str, entity_id: object, state: str, event: str) -> None:
        self.entity = entity
        self.entity_id = entity_id
        self.state = state
        self.event = event
        super().__init__(
            f"illegal transition: {entity} {entity_id} is {state!r}; event {event!r} is not allowed"
        )


@dataclass(frozen=True)
class Lifecycle:
    """A finite state machine: states, the initial one, the terminal ones and the legal moves."""

    entity: EntityKind
    states: tuple[str, ...]
    initial: str
    terminal: frozenset[str]
    transitions: Mapping[tuple[str, str], str]
    creation_event: str
    # States that work is expected to leave within a deadline (the reconciler's per-state deadlines).
    transitional: frozenset[str] = field(default_factory=frozenset)

    def apply(self, state: str, event: str, entity_id: object = None) -> str:
        """Return the state reached by `event` from `state`, or raise IllegalTransition."""
        try:
            return self.transitions[(state, event)]
        except KeyError:
            raise IllegalTransition(self.entity, entity_id, state, event) from None

    def allowed_events(self, state: str) -> tuple[str, ...]:
        """Events that are legal from `state`, in table order (empty for terminal states)."""
        return tuple(event for (src, event) in self.transitions if src == state)

    def live_states(self) -> tuple[str, ...]:
        """The states that are not terminal, in table order."""
        return tuple(state for state in self.states if state not in self.terminal)

    def states_allowing(self, *events: str) -> tuple[str, ...]:
        """The states from which any of `events` is legal, in table order."""
        return tuple(s for s in self.states if any((s, e) in self.transitions for e in events))

    def targets_of(self, *events: str) -> tuple[str, ...]:
        """The states that any of `events` leads to, in table order."""
        reached = {dst for (_, event), dst in self.transitions.items() if event in events}
        return tuple(s for s in self.states if s in reached)

    def settled_states(self) -> tuple[str, ...]:
        """Live states that are not transitional: where an entity stays until someone acts."""
        return tuple(s for s in self.live_states() if s not in self.transitional)

    def reachable_from(self, state: str) -> frozenset[str]:
        """States reachable from `state` (itself included) along the table."""
        return self._reachable[state]

    @cached_property
    def _reachable(self) -> Mapping[str, frozenset[str]]:
        reach: dict[str, frozenset[str]] = {}
        for start in self.states:
            seen = {start}
            frontier = [start]
            while frontier:
                current = frontier.pop()
                for event in self.allowed_events(current):
                    nxt = self.transitions[(current, event)]
                    if nxt not in seen:
                        seen.add(nxt)
                        frontier.append(nxt)
            reach[start] = frozenset(seen)
        return MappingProxyType(reach)

    def can_still(self, event: str, state: str) -> bool:
        """`event` is legal from `state` or from a state it can still reach."""
        return any((s, event) in self.transitions for s in self.reachable_from(state))

    def events(self) -> tuple[str, ...]:
        """Every event name of this lifecycle, in table order, without repeats."""
        return tuple(dict.fromkeys(event for (_, event) in self.transitions))

    def edges(self) -> frozenset[tuple[str, str]]:
        """The (from, to) pairs of the table: what the database trigger enforces."""
        return frozenset((src, dst) for (src, _), dst in self.transitions.items())

    def as_dict(self) -> dict[str, object]:
        return {
            "states": list(self.states),
            "initial": self.initial,
            "terminal": sorted(self.terminal),
            "transitions": [
                {"from": src, "event": event, "to": dst} for (src, event), dst in self.transitions.items()
            ],
        }

    def mermaid(self) -> str:
        lines = ["stateDiagram-v2", f"    [*] --> {self.initial}: {self.creation_event}"]
        lines += [f"    {src} --> {dst}: {event}" for (src, event), dst in self.transitions.items()]
        lines += [f"    {state} --> [*]" for state in self.states if state in self.terminal]
        return "\n".join(lines)


def _table(rows: list[tuple[str, str, str]]) -> Mapping[tuple[str, str], str]:
    table = {(src, event): dst for src, event, dst in rows}
    assert len(table) == len(rows), "duplicate (state, event) in a lifecycle table"
    return MappingProxyType(table)


INSTANCE = Lifecycle(
    entity="instance",
    states=(
        "pending",
        "provisioning",
        "ready",
        "updating",
        "degraded",
        "suspended",
        "deprovisioning",
        "deleted",
        "failed",
    ),
    initial="pending",
    terminal=frozenset({"deleted", "failed"}),
    creation_event="create",
    transitional=frozenset({"pending", "provisioning", "updating", "deprovisioning"}),
    transitions=_table(
        [
            ("pending", "start_provisioning", "provisioning"),
            ("pending", "fail", "failed"),
            ("provisioning", "provisioned", "ready"),
            ("provisioning", "fail", "failed"),
            ("ready", "update", "updating"),
            ("ready", "degrade", "degraded"),
            ("ready", "suspend", "suspended"),
            ("ready", "deprovision", "deprovisioning"),
            ("updating", "updated", "ready"),
            ("updating", "degrade", "degraded"),
            ("updating", "fail", "failed"),
            ("degraded", "recover", "ready"),
            ("degraded", "deprovision", "deprovisioning"),
            ("degraded", "fail", "failed"),
            ("suspended", "resume", "ready"),
            ("suspended", "deprovision", "deprovisioning"),
            ("deprovisioning", "deprovisioned", "deleted"),
            ("deprovisioning", "fail", "failed"),
        ]
    ),
)

JOB = Lifecycle(
    entity="job",
    states=("queued", "claimed", "running", "paused", "completed", "failed", "abandoned"),
    initial="queued",
    terminal=frozenset({"completed", "abandoned"}),
    creation_event="enqueue",
    transitions=_table(
        [
            ("queued", "claim", "claimed"),
            ("claimed", "start", "running"),
            ("claimed", "reclaim", "queued"),
            ("running", "finish", "completed"),
            ("running", "error", "failed"),
            ("running", "pause", "paused"),
            ("running", "reclaim", "queued"),
            ("paused", "resume", "running"),
            ("paused", "abandon", "abandoned"),
            ("failed", "retry", "queued"),
            ("failed", "abandon", "abandoned"),
        ]
    ),
)

LIFECYCLES: Mapping[str, Lifecycle] = MappingProxyType({"instance": INSTANCE, "job": JOB})


def _in_table_order(table: Lifecycle, states: frozenset[str] | tuple[str, ...]) -> tuple[str, ...]:
    return tuple(s for s in table.states if s in states)


# ---- state sets derived from the tables: the code names these, it never retypes the states ----

# Instances a deletion can start from now: the sources of `deprovision`.
DEPROVISIONABLE = INSTANCE.states_allowing("deprovision")
# Instances that stay where they are until someone acts (not transitional, not terminal): the
# reconciler observes their health.
SETTLED = INSTANCE.settled_states()
# Instances the provision job drives: the sources of its two events.
PROVISIONING = INSTANCE.states_allowing("start_provisioning", "provisioned")
# Instances gone or going away: terminal, or deprovisioning.
GONE_OR_GOING = _in_table_order(INSTANCE, INSTANCE.terminal | frozenset(INSTANCE.targets_of("deprovision")))
# Live instances that have had a server (every live state reachable from `ready`).
WITH_SERVER = _in_table_order(INSTANCE, frozenset(INSTANCE.live_states()) & INSTANCE.reachable_from("ready"))
# Instances whose server runs and serves their data (read-only while suspended): the sources and
# the target of `suspend`. They are backed up, by the plan's schedule or on demand.
BACKED_UP = _in_table_order(
    INSTANCE, frozenset(INSTANCE.states_allowing("suspend")) | frozenset(INSTANCE.targets_of("suspend"))
)
# Instances a restore can bring back to ready (with `recover`), once their data is lost.
RESTORABLE = INSTANCE.states_allowing("recover")
# Terminal job states, in table order (the partial indexes' predicate).
JOB_TERMINAL = _in_table_order(JOB, JOB.terminal)
# Jobs a worker holds: claimed or running, heartbeated, watched by the supervisor.
JOB_HELD = JOB.targets_of("claim", "start")


def lifecycle(entity: str) -> Lifecycle:
    try:
        return LIFECYCLES[entity]
    except KeyError:
        raise ValueError(f"unknown entity kind {entity!r}; expected 'instance' or 'job'") from None


def apply(entity: str, state: str, event: str, entity_id: object = None) -> str:
    """The one transition function: the new state of `entity` after `event`, or IllegalTransition."""
    return lifecycle(entity).apply(state, event, entity_id)


def allowed_events(entity: str, state: str) -> tuple[str, ...]:
    return lifecycle(entity).allowed_events(state)
