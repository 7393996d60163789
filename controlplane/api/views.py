"""How rows become API documents: instance representation (with its state's metadata, progress and
typed failure), audit rows as customers see them, opaque cursors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar
from urllib.parse import quote

from fastapi import Depends, Query
from fastapi.responses import JSONResponse

from controlplane.core import actions, failures, lifecycle, plans, progress
from controlplane.core.records import Instance as InstanceRecord
from controlplane.db.connection import AsyncConn
from controlplane.queue import steps
from controlplane.runtime.secretbox import SecretBox
from controlplane.services.backups import Recovery
from controlplane.services.idempotency import Answer
from controlplane.services.instances import InstanceResult, Versions

Row = TypeVar("Row")

# The file name every connection URI the service hands out gives as its `sslrootcert` (relative: the
# directory the client runs in), and that the console offers the CA certificate under.
CA_FILE = "controlplane-ca.pem"
# The sslmodes that check the server's certificate against a CA (so need one).
VERIFYING = ("verify-full", "verify-ca")


def connection(inst: InstanceRecord, box: SecretBox, *, reveal: bool) -> dict[str, Any] | None:
    info = inst.connection
    if not info:
        return None
    host, port = str(info.get("host", "")), int(info.get("port", 5432))
    dbname, user = str(info.get("dbname", "postgres")), str(info.get("user", "postgres"))
    password = box.decrypt(inst.secret) if reveal and inst.secret else None
    credentials = quote(user, safe="") + (f":{quote(password, safe='')}" if password is not None else "")
    sslmode = info.get("sslmode")
    query = f"?sslmode={quote(str(sslmode), safe='')}" if sslmode else ""
    # A verified connection names the CA's file, so what a customer pastes fails, if it does, with
    # that file's name (and connects once ca_certificate is saved under it).
    sslrootcert = CA_FILE if sslmode in VERIFYING else None
    if sslrootcert:
        query += f"&sslrootcert={sslrootcert}"
    path = f"/{quote(dbname, safe='')}{query}"
    direct = info.get("direct")
    reads = info.get("read_only")
    return {
        "host": host,
        "port": port,
        "dbname": dbname,
        "user": user,
        "password": password,
        "sslmode": sslmode,
        "ca_certificate": info.get("ca_certificate"),
        "sslrootcert": sslrootcert,
        "uri": f"postgresql://{credentials}@{host}:{port}{path}",
        "pool_mode": info.get("pool_mode"),
        "direct": None
        if not isinstance(direct, dict)
        else {
            "host": str(direct["host"]),
            "port": int(direct["port"]),
            "uri": f"postgresql://{credentials}@{direct['host']}:{int(direct['port'])}{path}",
        },
        "read_only": None
        if not isinstance(reads, dict)
        else {
            "host": str(reads["host"]),
            "port": int(reads["port"]),
            "dbname": str(reads["dbname"]),
            "uri": f"postgresql://{credentials}@{reads['host']}:{int(reads['port'])}"
            f"/{quote(str(reads['dbname']), safe='')}{query}",
        },
    }


def failure(inst: InstanceRecord) -> dict[str, Any] | None:
    """The typed reason of what is wrong with the instance, as its customer is told (never the raw
    error): from its code, or the unknown reason for a failed or degraded one that has none."""
    if inst.failure_code is None and inst.state not in ("failed", "degraded"):
        return None
    return failures.reason(inst.failure_code).as_dict()


def instance(
    inst: InstanceRecord, box: SecretBox, *, reveal: bool = False, progress: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The API representation of an instance (read with its organisation's billing hold);
    `progress` as `steps.progress_of` gives it (for a transitional state)."""
    shape = plans.SHAPES.get(str(inst.plan))
    wrong = failure(inst)
    return {
        "id": inst.id,
        "name": inst.name,
        "plan": inst.spec.get("plan"),
        "observed_plan": (inst.observed_spec or {}).get("plan"),
        "region": inst.spec.get("region"),
        "instances": None if shape is None else shape.instances,
        "storage_gb": None if shape is None else max(shape.storage_gb, int(inst.spec.get("storage_gb") or 0)),
        "restore_from": inst.spec.get("restore_from"),
        "state": inst.state,
        "state_info": lifecycle.INSTANCE.state_info[inst.state].as_dict(inst.failure_code),
        "state_version": inst.state_version,
        "progress": progress,
        "allowed_actions": actions.of(inst),
        "settled": actions.settled(inst),
        "spec_generation": inst.spec_generation,
        "observed_generation": inst.observed_generation,
        "failed_generation": inst.failed_generation,
        "state_entered_at": inst.state_entered_at,
        "time_in_state_s": max(0.0, round(float(inst.time_in_state_s or 0.0), 3)),
        "deadline_at": inst.deadline_at,
        "failure": wrong,
        "failure_reason": None if wrong is None else wrong["message"],
        "failure_code": None if wrong is None else wrong["code"],
        "replaces": inst.replaces,
        "replaced_by": inst.replaced_by,
        "archived_at": inst.archived_at,
        "deletion_protection": inst.deletion_protection,
        "billing_hold": inst.billing_hold,
        "deletion_requested": inst.deletion_requested,
        "connection": connection(inst, box, reveal=reveal),
        "created_at": inst.created_at,
        "updated_at": inst.updated_at,
    }


# The fleet's usual step durations in the documents this process serves (read every few seconds).
FLEET_DURATIONS = steps.FleetDurations()


async def instances(
    conn: AsyncConn, found: Sequence[InstanceRecord], box: SecretBox, *, reveal: bool = False
) -> list[dict[str, Any]]:
    """The documents of `found`, each with its progress (read in one go for the page)."""
    moving = await steps.progress_of(conn, found, durations=FLEET_DURATIONS)
    return [instance(inst, box, reveal=reveal, progress=moving.get(inst.id)) for inst in found]


async def created_instance(conn: AsyncConn, made: InstanceResult, box: SecretBox) -> dict[str, Any]:
    """The document of an instance a use case made: of one just created with its first job, known
    without reading its progress (no step has run, the job is queued); else as `one_instance`."""
    inst = made.instance
    if made.first_job is None or made.enqueued is None:
        return await one_instance(conn, inst, box)
    job = progress.LiveJob(made.first_job, made.enqueued, 0, "queued")
    return instance(inst, box, progress=await steps.progress_of_created(conn, inst, job, FLEET_DURATIONS))


async def one_instance(
    conn: AsyncConn, inst: InstanceRecord, box: SecretBox, *, reveal: bool = False
) -> dict[str, Any]:
    (doc,) = await instances(conn, [inst], box, reveal=reveal)
    return doc


def _edge_label(row: Mapping[str, Any]) -> str | None:
    if row["from_state"] is None:
        return "Created" if row["event"] == lifecycle.INSTANCE.creation_event else None
    info = lifecycle.INSTANCE.edge_info.get((row["from_state"], row["event"]))
    return None if info is None else info.label


def event(row: Mapping[str, Any]) -> dict[str, Any]:
    """An audit row as its customer sees it: a coded failure says its reason (not the raw error),
    and what is kept for SREs (`detail.sre`) is left out."""
    detail = dict(row["detail"] or {})
    detail.pop("sre", None)
    code = detail.get("code")
    return {
        "id": row["id"],
        "at": row["at"],
        "from_state": row["from_state"],
        "to_state": row["to_state"],
        "event": row["event"],
        "label": _edge_label(row),
        "actor": {"kind": row["actor_kind"], "id": row["actor_id"]},
        "reason": failures.reason(str(code)).message if code else row["reason"],
        "detail": detail,
        "seq": row["seq"],
        "hash": bytes(row["hash"]).hex(),
    }


def sre_event(row: Mapping[str, Any]) -> dict[str, Any]:
    """An audit row as SREs see it: the raw reason and the whole detail."""
    return {**event(row), "reason": row["reason"], "detail": row["detail"] or {}}


def etag(inst: InstanceRecord) -> str:
    """The instance's ETag header value (its `Instance.etag`, quoted)."""
    return f'"{inst.etag}"'


def _tags(header: str) -> list[str]:
    """The entity tags a list header (If-Match, If-None-Match) names, unquoted; weak tags compare
    by their value here (an ETag of this API is never weak)."""
    return [tag.strip().removeprefix("W/").strip('"') for tag in header.split(",") if tag.strip()]


def if_match_versions(if_match: str | None) -> Versions | None:
    """The versions an RFC 9110 If-Match names; None when there is no precondition (no header, or
    `*`: any current instance)."""
    if if_match is None:
        return None
    tags = _tags(if_match)
    if "*" in tags:
        return None
    return Versions(frozenset(tags), if_match)


def none_match(if_none_match: str | None, inst: InstanceRecord) -> bool:
    """Whether an If-None-Match names the instance as it is (or is `*`): a GET answers 304."""
    if if_none_match is None:
        return False
    tags = _tags(if_none_match)
    return "*" in tags or inst.etag in tags


# The size of a page of any list: the default, and the most (a larger `limit` is lowered to it).
DEFAULT_LIMIT = 50
MAX_LIMIT = 100


@dataclass(frozen=True)
class Paging:
    """The query parameters of a page: where it starts, and how long it is."""

    cursor: str | None = None
    limit: Annotated[int, Query(ge=1, description=f"page size; values above {MAX_LIMIT} are capped")] = (
        DEFAULT_LIMIT
    )

    @property
    def size(self) -> int:
        return min(self.limit, MAX_LIMIT)


Page = Annotated[Paging, Depends()]


def answered(answer: Answer, shown_once: Mapping[str, Any] | None = None) -> JSONResponse:
    """The answer to a creating request: a replay says so (Idempotent-Replayed); what is shown only
    once (a secret) is added to the first answer and never stored with it."""
    stored = answer.response
    if answer.replayed:
        headers = {**stored.headers, "Idempotent-Replayed": "true"}
        return JSONResponse(stored.body, status_code=stored.status_code, headers=headers)
    body = {**stored.body, **shown_once} if shown_once else stored.body
    return JSONResponse(body, status_code=stored.status_code, headers=stored.headers)


def recovery(found: Recovery, backups: list[dict[str, Any]], *, sre: bool = False) -> dict[str, Any]:
    """The recoverable window of an instance as the API shows it (SREs also see what fails)."""
    window = found.window
    shown: dict[str, Any] = {
        "instance_id": found.instance.id,
        "earliest": None,
        "latest": None,
        "archive": None,
        "observed_at": None,
        "retained_until": None,
        "verified_at": None,
        "verified": None,
        "backups": backups,
    }
    if sre:
        shown["verify_problem"] = None if window is None else window.verify_problem
    if window is None:
        return shown
    archive: dict[str, Any] = {
        "healthy": window.archive_healthy,
        "failing_since": window.archive_failing_since,
        "lag_s": window.lag_s,
        "lag_bytes": window.lag_bytes,
        "last_archived_at": window.last_archived_at,
    }
    if sre:
        archive["detail"] = window.archive_detail
    return shown | {
        "earliest": window.earliest_at,
        "latest": window.latest_at,
        "archive": archive if window.expired_at is None else None,
        "observed_at": window.observed_at,
        "retained_until": window.retained_until,
        "verified_at": window.verified_at,
        "verified": None if window.verified_at is None else window.verify_problem is None,
    }
