"""The two lifecycles (instance and job) as data, and the one pure function that applies an event."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Literal

from controlplane.core.failures import DATA_LOST

EntityKind = Literal["instance", "job"]

# What a state asks of the person looking at it (the console's colour, the CLI's marker).
Severity = Literal["healthy", "transient", "fault", "suspended", "terminal"]
SEVERITIES: Mapping[str, str] = MappingProxyType(
    {
        "healthy": "running as asked: nothing to do",
        "transient": "work is under way: wait, it moves on by itself",
        "fault": "something is wrong: read the reason, then act (retry, delete, restore) or wait",
        "suspended": "kept but read-only (a billing hold): resolve the hold to resume",
        "terminal": "over: it never changes again",
    }
)
# What an instance in the state is billed for (as RDS publishes per DB instance status).
Billing = Literal["billed", "storage_only", "not_billed"]
BILLING_CLASSES: Mapping[str, str] = MappingProxyType(
    {
        "billed": "compute and storage are billed",
        "storage_only": "only the storage (and backups) are billed: the server serves no writes",
        "not_billed": "nothing is billed",
    }
)


@dataclass(frozen=True)
class StateInfo:
    """What people and systems need to know of one state, beside the table's moves."""

    label: str
    # One sentence for the customer.
    description: str
    severity: Severity
    billing: Billing
    # Another class while the failure code of the move into the state is one of these: time lost
    # to the service's own fault (lost data) is not billed as compute.
    billing_by_failure: Mapping[str, Billing] = field(default_factory=lambda: MappingProxyType({}))

    def billing_for(self, failure_code: str | None) -> Billing:
        """The class of time in this state entered with `failure_code` (None: no failure)."""
        return self.billing_by_failure.get(failure_code or "", self.billing)

    def as_dict(self, failure_code: str | None = None) -> dict[str, object]:
        """The metadata; `billing` as it is for `failure_code` (an instance's current one)."""
        return {
            "label": self.label,
            "description": self.description,
            "severity": self.severity,
            "billing": self.billing_for(failure_code),
            "billing_by_failure": dict(self.billing_by_failure),
        }


@dataclass(frozen=True)
class EdgeInfo:
    """What one move means to the people watching: its label in a timeline, and whether it alerts."""

    label: str
    alerts: bool


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
    # Per state and per (state, event) edge: labels, severity, billing class, alerting (the
    # instance lifecycle has them for every state and edge; the job lifecycle has none).
    state_info: Mapping[str, StateInfo] = field(default_factory=lambda: MappingProxyType({}))
    edge_info: Mapping[tuple[str, str], EdgeInfo] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        if self.state_info and set(self.state_info) != set(self.states):
            raise ValueError(f"{self.entity} lifecycle: state metadata must cover exactly its states")
        if self.edge_info and set(self.edge_info) != set(self.transitions):
            raise ValueError(f"{self.entity} lifecycle: edge metadata must cover exactly its edges")

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

    def alerts(self, state: str, event: str) -> bool:
        """Whether the move `event` from `state` alerts (False for a lifecycle without edge metadata)."""
        info = self.edge_info.get((state, event))
        return info is not None and info.alerts

    def as_dict(self) -> dict[str, object]:
        """The table as data (the API and the CLI publish it), with its metadata where it has some."""
        transitions: list[dict[str, object]] = []
        for (src, event), dst in self.transitions.items():
            move: dict[str, object] = {"from": src, "event": event, "to": dst}
            info = self.edge_info.get((src, event))
            if info is not None:
                move |= {"label": info.label, "alerts": info.alerts}
            transitions.append(move)
        table: dict[str, object] = {
            "states": list(self.states),
            "initial": self.initial,
            "terminal": sorted(self.terminal),
            "transitions": transitions,
        }
        if self.state_info:
            table["state_info"] = {
                state: {**self.state_info[state].as_dict(), "transitional": state in self.transitional}
                for state in self.states
            }
        return table

    def mermaid(self) -> str:
        lines = ["stateDiagram-v2", f"    [*] --> {self.initial}: {self.creation_event}"]
        lines += [f"    {src} --> {dst}: {event}" for (src, event), dst in self.transitions.items()]
        lines += [f"    {state} --> [*]" for state in self.states if state in self.terminal]
        return "\n".join(lines)


def _table(rows: list[tuple[str, str, str]]) -> Mapping[tuple[str, str], str]:
    table = {(src, event): dst for src, event, dst in rows}
    assert len(table) == len(rows), "duplicate (state, event) in a lifecycle table"
    return MappingProxyType(table)


def _edges(
    rows: list[tuple[str, str, str, str, bool]],
) -> tuple[Mapping[tuple[str, str], str], Mapping[tuple[str, str], EdgeInfo]]:
    """A table whose rows carry their metadata: (from, event, to, label, alerts)."""
    moves = _table([(src, event, dst) for src, event, dst, _label, _alerts in rows])
    info = {(src, event): EdgeInfo(label, alerts) for src, event, _dst, label, alerts in rows}
    return moves, MappingProxyType(info)


_INSTANCE_EDGES = _edges(
    [
        ("pending", "start_provisioning", "provisioning", "Creation started", False),
        ("pending", "fail", "failed", "Creation failed", True),
        ("provisioning", "provisioned", "ready", "Created", False),
        ("provisioning", "fail", "failed", "Creation failed", True),
        ("ready", "update", "updating", "Change started", False),
        ("ready", "degrade", "degraded", "Degraded", True),
        ("ready", "suspend", "suspended", "Suspended", False),
        ("ready", "deprovision", "deprovisioning", "Deletion started", False),
        ("updating", "updated", "ready", "Change applied", False),
        ("updating", "degrade", "degraded", "Change given up", True),
        ("updating", "fail", "failed", "Change failed", True),
        ("degraded", "recover", "ready", "Recovered", False),
        ("degraded", "deprovision", "deprovisioning", "Deletion started", False),
        ("degraded", "fail", "failed", "Failed", True),
        ("suspended", "resume", "ready", "Resumed", False),
        ("suspended", "deprovision", "deprovisioning", "Deletion started", False),
        ("deprovisioning", "deprovisioned", "deleted", "Deleted", False),
        ("deprovisioning", "fail", "failed", "Deletion failed", True),
    ]
)


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
    transitions=_INSTANCE_EDGES[0],
    edge_info=_INSTANCE_EDGES[1],
    state_info=MappingProxyType(
        {
            "pending": StateInfo(
                "Queued",
                "The database has been accepted and waits for its creation to start.",
                "transient",
                "not_billed",
            ),
            "provisioning": StateInfo(
                "Creating",
                "The database is being created: its storage, its network endpoint, its server.",
                "transient",
                "not_billed",
            ),
            "ready": StateInfo(
                "Available", "The database is running and accepts connections.", "healthy", "billed"
            ),
            "updating": StateInfo(
                "Updating",
                "A change (a new plan) is being applied; the server may restart briefly.",
                "transient",
                "billed",
            ),
            "degraded": StateInfo(
                "Degraded",
                "Something is wrong with the database; the reason says what, and what is done about it.",
                "fault",
                "billed",
                # Its data is lost: no server serves it while a restore (or a decision) is awaited;
                # what the customer stored is kept in backups (docs/decisions.md).
                MappingProxyType({DATA_LOST: "storage_only"}),
            ),
            "suspended": StateInfo(
                "Suspended",
                "The database is read-only (a billing hold, or its data beyond its storage allocation):"
                " it serves reads, not writes; its data is kept.",
                "suspended",
                "storage_only",
            ),
            "deprovisioning": StateInfo(
                "Deleting",
                "The database is being deleted, after its final backup unless that was skipped.",
                "transient",
                "not_billed",
            ),
            "deleted": StateInfo("Deleted", "The database has been deleted.", "terminal", "not_billed"),
            "failed": StateInfo(
                "Failed",
                "The database could not be created (or removed); the reason says why. Retry it or remove it.",
                "fault",
                "not_billed",
            ),
        }
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

# The job events an operator may cause by hand (`controlplane jobs ACTION`, the admin API).
JOB_OPERATOR_ACTIONS = ("pause", "resume", "retry", "abandon")


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
