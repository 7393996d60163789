"""The chaos soak's pure parts: the fault schedule, the invariants checked at the end, the report.

Nothing here touches a process, a socket or a database: the soak (`controlplane.chaos.soak`) takes
a snapshot of what is (rows, the provisioner's inventory, the audit replay) and of what its
clients were told (the ledger), and these functions say what is wrong with it.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

# What the soak kills (each at random, by SIGKILL unless said otherwise).
WORKER = "worker"
RECONCILER_LEADER = "reconciler_leader"
API = "api"
CONTROL_PLANE_DB = "control_plane_db"
# The server of a single-server (`dev`) instance.
CUSTOMER_SERVER = "customer_server"
# A customer's data directory removed (rm -rf) behind the control plane's back.
DATA_DIRECTORY = "data_directory"
# An HA instance's current primary (whichever member it is after earlier failovers), one of its
# standbys, its pooler (PgBouncer): each while a writer commits through its pooled endpoint.
HA_PRIMARY = "ha_primary"
HA_STANDBY = "ha_standby"
POOLER = "pooler"
FAULT_KINDS = (
    WORKER,
    RECONCILER_LEADER,
    API,
    CONTROL_PLANE_DB,
    CUSTOMER_SERVER,
    DATA_DIRECTORY,
    HA_PRIMARY,
    HA_STANDBY,
    POOLER,
)
# The faults of an HA instance, under a writer whose acknowledged rows must all survive.
HA_FAULT_KINDS = frozenset({HA_PRIMARY, HA_STANDBY, POOLER})

# Instance states a converged soak may leave an instance in.
SETTLED = frozenset({"ready", "suspended", "deleted"})
LIVE_JOB_STATES = frozenset({"queued", "claimed", "running", "paused", "failed"})
RESOURCES_OF_A_LIVE_INSTANCE = frozenset({"data_directory", "server", "port"})


@dataclass(frozen=True)
class Fault:
    at_s: float  # seconds since the soak started
    kind: str


def schedule(
    seed: int,
    duration_s: float,
    min_interval_s: float = 5.0,
    max_interval_s: float = 40.0,
    kinds: Sequence[str] = FAULT_KINDS,
) -> list[Fault]:
    """The faults of a soak of `duration_s`: gaps drawn uniformly from [min, max] seconds, kinds
    drawn so that each kind comes once in every round of len(kinds) faults (no kind starves on
    a short soak); the same seed gives the same schedule."""
    if not kinds:
        raise ValueError("no fault kinds to schedule")
    if not 0 < min_interval_s <= max_interval_s:
        raise ValueError(
            f"fault intervals must satisfy 0 < min <= max, not {min_interval_s}..{max_interval_s}"
        )
    rng = random.Random(seed)  # noqa: S311 (a reproducible schedule, not a secret)
    faults: list[Fault] = []
    at = rng.uniform(min_interval_s, max_interval_s)
    round_: list[str] = []
    while at < duration_s:
        if not round_:
            round_ = list(kinds)
            rng.shuffle(round_)
        faults.append(Fault(round(at, 3), round_.pop()))
        at += rng.uniform(min_interval_s, max_interval_s)
    return faults


def percentile(values: Sequence[float], p: float) -> float | None:
    """The nearest-rank percentile `p` (0-100) of `values`; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass
class Ledger:
    """What the soak's clients were told (2xx answers), the truth the database must match."""

    # Idempotency-Key of each create → the instance id the API answered with.
    creates: dict[str, str] = field(default_factory=dict)
    # Instance ids whose deletion was accepted.
    deletes: set[str] = field(default_factory=set)
    # Instance id → the plan of its last accepted change (or of its create).
    plans: dict[str, str] = field(default_factory=dict)
    # Organisation id → (created, hold) of the newest Stripe event it was sent and that was acknowledged.
    billing: dict[str, tuple[int, bool]] = field(default_factory=dict)
    # Stripe event id → number of deliveries acknowledged (each 2xx).
    webhook_deliveries: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class Snapshot:
    """What is, once the soak has converged (or given up waiting)."""

    instances: Sequence[
        Mapping[str, Any]
    ]  # id, org_id, state, plan, spec/observed/failed generation, suspended_by_billing
    jobs: Sequence[Mapping[str, Any]]  # id, kind, state, instance_id
    organisations: Sequence[Mapping[str, Any]]  # id, billing_hold
    idempotency: Sequence[Mapping[str, Any]]  # org_id, key, status_code, instance_id (of the stored answer)
    stripe_events: Sequence[Mapping[str, Any]]  # id
    inventory: Sequence[tuple[str, str | None]]  # (kind, instance id) of each resource the provisioner holds
    audit_mismatches: Sequence[str]
    instance_events: Sequence[Mapping[str, Any]] = ()  # instance_id, event (one row per audit row)


def converged(snapshot: Snapshot) -> bool:
    """Whether the control plane has settled: no live job, every instance in a settled state, and
    no intent left for the reconciler to act on (a deletion recorded, a plan change not applied, a
    hold or a release not carried out)."""
    if any(j["state"] in LIVE_JOB_STATES for j in snapshot.jobs):
        return False
    holds = {str(o["id"]): bool(o["billing_hold"]) for o in snapshot.organisations}
    for row in snapshot.instances:
        state, held = row["state"], holds.get(str(row["org_id"]), False)
        if state not in SETTLED or (row.get("deletion_requested") and state != "deleted"):
            return False
        unapplied = row["observed_generation"] < row["spec_generation"] != row.get("failed_generation")
        if state == "ready" and (held or unapplied):
            return False
        if state == "suspended" and row["suspended_by_billing"] and not held:
            return False
    return True


def violations(ledger: Ledger, snapshot: Snapshot) -> list[str]:
    """Every invariant the snapshot breaks, one line each (empty: all hold)."""
    found: list[str] = [f"audit: {m}" for m in snapshot.audit_mismatches]
    instances = {str(i["id"]): i for i in snapshot.instances}
    found += _jobs(snapshot, instances)
    found += _instances(ledger, instances)
    found += _idempotency(ledger, snapshot, instances)
    found += _billing(ledger, snapshot, instances)
    found += _inventory(snapshot, instances)
    found += _effects(snapshot, instances)
    return found


def _jobs(snapshot: Snapshot, instances: Mapping[str, Mapping[str, Any]]) -> list[str]:
    found = []
    for job in snapshot.jobs:
        if job["state"] in LIVE_JOB_STATES:
            found.append(f"job lost: {job['kind']} job {job['id']} still {job['state']} after convergence")
        if job["instance_id"] is not None and str(job["instance_id"]) not in instances:
            found.append(f"job {job['id']} names instance {job['instance_id']}, which does not exist")
    return found


def _instances(ledger: Ledger, instances: Mapping[str, Mapping[str, Any]]) -> list[str]:
    found = []
    for iid, row in instances.items():
        state = row["state"]
        if state not in SETTLED:
            found.append(f"instance {iid} did not converge: {state} ({row.get('failure_reason')})")
        if iid in ledger.deletes and state != "deleted":
            found.append(f"instance {iid}: its deletion was accepted, but it is {state}")
        if row.get("deletion_requested") and state != "deleted":
            found.append(f"instance {iid}: its deletion is recorded, but it is {state}")
        if iid not in ledger.deletes and state == "deleted":
            found.append(f"instance {iid} is deleted, but no deletion of it was accepted")
        expected = ledger.plans.get(iid)
        if state != "deleted" and expected is not None and row["plan"] != expected:
            found.append(
                f"instance {iid}: plan {row['plan']!r}, but the last accepted change asked {expected!r}"
            )
        unapplied = row["observed_generation"] < row["spec_generation"]
        if state == "ready" and unapplied and row.get("failed_generation") != row["spec_generation"]:
            found.append(
                f"instance {iid}: ready at generation {row['observed_generation']} of "
                f"{row['spec_generation']} (a change accepted and never applied)"
            )
    return found


def _idempotency(ledger: Ledger, snapshot: Snapshot, instances: Mapping[str, Mapping[str, Any]]) -> list[str]:
    found = []
    stored: dict[str, list[Mapping[str, Any]]] = {}
    for row in snapshot.idempotency:
        stored.setdefault(str(row["key"]), []).append(row)
    for key, iid in ledger.creates.items():
        rows = stored.get(key, [])
        if len(rows) != 1:
            found.append(f"idempotency key {key}: {len(rows)} stored answers (one expected)")
        elif str(rows[0]["instance_id"]) != iid:
            found.append(
                f"idempotency key {key}: stored answer names {rows[0]['instance_id']}, client got {iid}"
            )
        if iid not in instances:
            found.append(f"idempotency key {key}: the instance {iid} its create answered does not exist")
    answered = set(ledger.creates.values())
    for iid in instances:
        if iid not in answered:
            found.append(
                f"instance {iid} exists, but no create the clients were answered made it (an orphan row)"
            )
    for event_id, deliveries in ledger.webhook_deliveries.items():
        if deliveries and event_id not in {str(e["id"]) for e in snapshot.stripe_events}:
            found.append(f"Stripe event {event_id} was acknowledged {deliveries} time(s) and never recorded")
    return found


def _billing(ledger: Ledger, snapshot: Snapshot, instances: Mapping[str, Mapping[str, Any]]) -> list[str]:
    found = []
    holds = {str(o["id"]): bool(o["billing_hold"]) for o in snapshot.organisations}
    for org, (_, hold) in ledger.billing.items():
        if holds.get(org) != hold:
            found.append(
                f"organisation {org}: billing_hold {holds.get(org)}, but its newest event says {hold}"
            )
    for iid, row in instances.items():
        held = holds.get(str(row["org_id"]), False)
        if held and row["state"] == "ready":
            found.append(f"instance {iid} is ready, but its organisation is on a billing hold")
        if not held and row["state"] == "suspended" and row["suspended_by_billing"]:
            found.append(f"instance {iid} is still suspended by billing, but its organisation's hold ended")
    return found


def _inventory(snapshot: Snapshot, instances: Mapping[str, Mapping[str, Any]]) -> list[str]:
    found = []
    held: dict[str, set[str]] = {}
    for kind, owner in snapshot.inventory:
        held.setdefault(str(owner), set()).add(kind)
    for owner, kinds in held.items():
        row = instances.get(owner)
        if row is None or row["state"] == "deleted":
            what = "no instance" if row is None else "a deleted instance"
            found.append(f"orphan: {', '.join(sorted(kinds))} of {what} {owner}")
    for iid, row in instances.items():
        if row["state"] in {"ready", "suspended"}:
            missing = RESOURCES_OF_A_LIVE_INSTANCE - held.get(iid, set())
            if missing:
                found.append(
                    f"instance {iid} is {row['state']}, but the provisioner has no "
                    + ", ".join(sorted(missing))
                )
    return found


def _effects(snapshot: Snapshot, instances: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Side effects done once: one port per instance, one `create` and at most one `provisioned`."""
    found = []
    ports = Counter(owner for kind, owner in snapshot.inventory if kind == "port")
    found += [f"instance {owner} holds {n} ports" for owner, n in ports.items() if n > 1]
    per_instance = Counter((str(e["instance_id"]), e["event"]) for e in snapshot.instance_events)
    for iid in instances:
        if per_instance[(iid, "create")] != 1:
            found.append(f"instance {iid} has {per_instance[(iid, 'create')]} create events")
        if per_instance[(iid, "provisioned")] > 1:
            found.append(f"instance {iid} was provisioned {per_instance[(iid, 'provisioned')]} times")
    return found


@dataclass
class DataLoss:
    """A data directory removed: a row committed `kept_age_s` before the loss (older than the
    archive timeout: it must survive), one committed just before it (it may not), and what the
    restored instance holds (None: not looked at, the instance never came back or was deleted)."""

    instance_id: str
    kept_age_s: float
    kept_present: bool | None = None
    late_present: bool | None = None


def durability_violations(losses: Sequence[DataLoss], instances: Sequence[Mapping[str, Any]]) -> list[str]:
    """Rows committed earlier than the archive timeout before a loss that did not survive it."""
    states = {str(i["id"]): i["state"] for i in instances}
    found = []
    for loss in losses:
        if loss.kept_present is False:
            found.append(
                f"instance {loss.instance_id}: a row committed {loss.kept_age_s:.1f} s before its data"
                " directory was removed (more than the archive timeout) is gone after the restore"
            )
        elif loss.kept_present is None and states.get(loss.instance_id) not in {"deleted", None}:
            found.append(
                f"instance {loss.instance_id}: never seen restored after its data directory was removed"
            )
    return found


@dataclass
class WriteProbe:
    """Rows committed one by one through an HA instance's pooled endpoint around a fault: the ids
    whose COMMIT was acknowledged, and the ids read back once it recovered (None: not read, the
    instance deleted meanwhile or never serving again)."""

    instance_id: str
    fault: str
    acknowledged: list[int] = field(default_factory=list)
    attempted: int = 0  # INSERTs sent (an unanswered one may or may not have committed)
    errors: int = 0  # attempts that failed (expected while the fault lasts), each retried afresh
    present: list[int] | None = None


def acknowledged_row_violations(
    probes: Sequence[WriteProbe], instances: Sequence[Mapping[str, Any]]
) -> list[str]:
    """Every acknowledged row a probe did not read back, and every probe never read back on an
    instance that still exists (an acknowledged COMMIT is on two servers: no fault may lose it)."""
    states = {str(i["id"]): i["state"] for i in instances}
    found = []
    for probe in probes:
        if probe.present is None:
            if probe.acknowledged and states.get(probe.instance_id) not in {"deleted", None}:
                found.append(
                    f"instance {probe.instance_id}: the {len(probe.acknowledged)} rows acknowledged around"
                    f" its {probe.fault} fault were never read back"
                )
            continue
        missing = sorted(set(probe.acknowledged) - set(probe.present))
        if missing:
            shown = ", ".join(str(n) for n in missing[:10]) + (", ..." if len(missing) > 10 else "")
            found.append(
                f"instance {probe.instance_id}: {len(missing)} of {len(probe.acknowledged)} acknowledged"
                f" rows lost across its {probe.fault} fault (ids {shown})"
            )
    return found


@dataclass(frozen=True)
class PrimarySample:
    """One look at one server of an HA instance: writable (not in recovery), not (a standby), or
    None (no answer)."""

    instance_id: str
    server: str  # the member's name (or its port)
    writable: bool | None


def double_primary_findings(round_: Sequence[PrimarySample]) -> list[str]:
    """Two writable primaries of one instance, proven by one round of sequential samples: server A
    writable, then server B writable, then A writable again. A was writable all along (a fenced
    primary never comes back writable), so both were at B's sample. A round samples its servers
    there and back (A, B, A) so that every pair can be seen so."""
    found: list[str] = []
    seen: set[tuple[str, str, str]] = set()
    for i, first in enumerate(round_):
        if not first.writable:
            continue
        for j in range(i + 1, len(round_)):
            other = round_[j]
            if not other.writable or other.server == first.server or other.instance_id != first.instance_id:
                continue
            again = any(
                later.writable and later.server == first.server and later.instance_id == first.instance_id
                for later in round_[j + 1 :]
            )
            pair = sorted((first.server, other.server))
            key = (first.instance_id, pair[0], pair[1])
            if again and key not in seen:
                seen.add(key)
                found.append(
                    f"instance {first.instance_id}: two writable primaries at once ({first.server} was"
                    f" writable before and after {other.server} answered writable)"
                )
    return found


@dataclass
class FaultRecord:
    kind: str
    at_s: float
    target: str
    recovery_s: float | None  # None: not recovered within the bound


@dataclass
class Report:
    seed: int
    minutes: float
    processes: dict[str, int]
    faults: list[FaultRecord] = field(default_factory=list)
    attempted: Counter[str] = field(default_factory=Counter)
    completed: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    # Faults with no target on their turn, injected at a later one; and those never injected.
    deferred: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    convergence_s: float | None = None
    violations: list[str] = field(default_factory=list)
    data_losses: list[DataLoss] = field(default_factory=list)
    write_probes: list[WriteProbe] = field(default_factory=list)
    primary_samples: int = 0  # servers of HA instances asked whether they take writes
    double_primaries: list[str] = field(default_factory=list)

    def acknowledged_rows(self) -> dict[str, int]:
        """The writers' rows: acknowledged, read back (of probes read back), missing."""
        read = [p for p in self.write_probes if p.present is not None]
        return {
            "probes": len(self.write_probes),
            "written": sum(len(p.acknowledged) for p in self.write_probes),
            "checked": sum(len(p.acknowledged) for p in read),
            "missing": sum(len(set(p.acknowledged) - set(p.present or ())) for p in read),
        }

    def by_kind(self) -> dict[str, dict[str, Any]]:
        table: dict[str, dict[str, Any]] = {}
        for kind in FAULT_KINDS:
            mine = [f for f in self.faults if f.kind == kind]
            times = [f.recovery_s for f in mine if f.recovery_s is not None]
            table[kind] = {
                "injected": len(mine),
                "deferred": self.deferred[kind],
                "skipped": self.skipped[kind],
                "unrecovered": len(mine) - len(times),
                "recovery_max_s": max(times) if times else None,
                "recovery_p95_s": percentile(times, 95),
            }
        return table

    def as_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "minutes": self.minutes,
            "processes": self.processes,
            "faults_by_kind": self.by_kind(),
            "faults": [asdict(f) for f in self.faults],
            "operations": {
                op: {
                    "attempted": self.attempted[op],
                    "completed": self.completed[op],
                    "refused": self.refused[op],
                }
                for op in sorted(self.attempted)
            },
            "convergence_s": self.convergence_s,
            "data_losses": [asdict(loss) for loss in self.data_losses],
            "acknowledged_rows": self.acknowledged_rows(),
            "write_probes": [
                {
                    "instance_id": p.instance_id,
                    "fault": p.fault,
                    "acknowledged": len(p.acknowledged),
                    "attempted": p.attempted,
                    "errors": p.errors,
                    "read_back": p.present is not None,
                }
                for p in self.write_probes
            ],
            "primary_samples": self.primary_samples,
            "double_primaries": len(self.double_primaries),
            "invariant_violations": len(self.violations),
            "violations": self.violations,
        }

    def markdown(self) -> str:
        lines = [
            "# Chaos soak report",
            "",
            f"{self.minutes:g} minutes, seed {self.seed}; processes: "
            + ", ".join(f"{n} {name}" for name, n in self.processes.items())
            + ".",
            "",
            "| fault | injected | recovered | recovery max (s) | recovery p95 (s) "
            "| deferred (no target on its turn) | skipped (none by the end) |",
            "|---|---|---|---|---|---|---|",
        ]
        for kind, row in self.by_kind().items():
            lines.append(
                f"| {kind} | {row['injected']} | {row['injected'] - row['unrecovered']} | "
                f"{_seconds(row['recovery_max_s'])} | {_seconds(row['recovery_p95_s'])} | "
                f"{row['deferred']} | {row['skipped']} |"
            )
        lines += [
            "",
            "| operation | attempted | completed | refused (a 4xx the lifecycle gives) |",
            "|---|---|---|---|",
        ]
        for op in sorted(self.attempted):
            lines.append(f"| {op} | {self.attempted[op]} | {self.completed[op]} | {self.refused[op]} |")
        if self.data_losses:
            kept = sum(1 for loss in self.data_losses if loss.kept_present)
            late = sum(1 for loss in self.data_losses if loss.late_present)
            lines += [
                "",
                f"Data directories removed: {len(self.data_losses)}; the row older than the archive timeout"
                f" survived {kept} time(s), the row written just before the loss {late} time(s).",
            ]
        rows = self.acknowledged_rows()
        lines += [
            "",
            "| invariant | checked | violations |",
            "|---|---|---|",
            f"| no acknowledged row lost ({rows['probes']} writers) | {rows['checked']} of"
            f" {rows['written']} acknowledged rows read back | {rows['missing']} missing |",
            f"| never two writable primaries | {self.primary_samples} samples |"
            f" {len(self.double_primaries)} double primaries |",
        ]
        lines += [
            "",
            f"Converged {_seconds(self.convergence_s)} s after the faults stopped.",
            "",
            f"**Invariant violations: {len(self.violations)}**",
        ]
        lines += [f"- {v}" for v in self.violations]
        return "\n".join(lines) + "\n"

    def dumps(self) -> str:
        return json.dumps(self.as_json(), indent=2, sort_keys=True) + "\n"


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"
