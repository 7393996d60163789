"""The console's pages and forms: each reads with the same queries and changes through the same use
cases as the REST API (`controlplane.services`), with the signed-in key as the actor."""

from __future__ import annotations

import secrets
import uuid
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from controlplane.api import auth, ratelimit, views, watch
from controlplane.api import problems as errors
from controlplane.api.console import charts, present
from controlplane.api.console.session import (
    CSRF_FIELD,
    SIGN_IN_COOKIE,
    Form,
    SignedIn,
    Visitor,
    clear_session_cookie,
    same_origin,
    seal_of,
    set_session_cookie,
)
from controlplane.api.console.web import is_https, read_form, redirect, render
from controlplane.api.models import InstanceCreate, InstanceUpdate, KeyCreate
from controlplane.api.problems import ProblemError
from controlplane.api.state import AppState, app_state
from controlplane.core import lifecycle, plans
from controlplane.core.records import Instance as InstanceRecord
from controlplane.core.refusals import DomainError, InvalidRequest, LimitReached, NotFound
from controlplane.db.connection import AsyncConn
from controlplane.runtime.settings import BillingSettings
from controlplane.services import backups, billing_policy, idempotency, instances, metrics, sessions, tenants
from provisioners.base import RestoreSource

router = APIRouter(include_in_schema=False)

# Instances on one page of the list (its filter and order apply to the page).
PAGE = 500
# The list's filter by the severity class of the lifecycle metadata, and its orders.
SHOWN: Mapping[str, str] = {
    "": "Every state",
    "fault": "Needs attention",
    "transient": "In progress",
    "healthy": "Available",
    "suspended": "Suspended",
    "terminal": "Ended",
}
SORTS: Mapping[str, str] = {
    "newest": "Newest first",
    "oldest": "Oldest first",
    "name": "Name",
    "state": "State",
}
# Sorted by state: what needs the customer first, what ended last.
SEVERITY_ORDER = ("fault", "transient", "suspended", "healthy", "terminal")
# Rows of the audit timeline on one page.
HISTORY_PAGE = 25
# The most keys the console lists or names actors from (an organisation holds at most
# CONTROLPLANE_API_MAX_KEYS_PER_ORG live ones; the rest are revoked).
KEYS_SHOWN = 1000
# Where a failure leaves an instance (listed apart from the live ones and the deleted ones).
FAILED = lifecycle.INSTANCE.targets_of("fail")
# Where a deletion leaves an instance (its page then says what the deletion kept).
DELETED = lifecycle.INSTANCE.targets_of("deprovisioned")

# What a redirect after a form tells the person (the `done` query parameter names one).
NOTICES: Mapping[str, str] = {
    "resize": "The new plan is recorded; the database is updated now, or as soon as it can be.",
    "protection-on": "Deletion protection is on: the database cannot be deleted until it is turned off.",
    "protection-off": "Deletion protection is off.",
    "delete": "The deletion is under way; it runs now, or as soon as the database can be deleted.",
    "remove": "Removing it: what its failure left behind is cleaned up, and it leaves your list.",
    "retry": "A new database replaces the failed one; follow it here.",
    "restored": "A new database is being made from the other's backups; follow it here.",
    "revoked": "The key is revoked: requests and console sessions with it are refused from now on.",
}


class Missing(Exception):
    """A page about something the organisation does not have (another's, or none of that id)."""


# ---- signing in and out -------------------------------------------------------------------------


@router.get("/sign-in", response_class=HTMLResponse)
async def sign_in_page(request: Request, ended: bool = False, signed_out: bool = False) -> Response:
    notice = None
    if signed_out:
        notice = "You are signed out."
    elif ended:
        notice = "Your session has ended (it expired, or its key was revoked). Sign in again."
    return _sign_in_form(request, notice=notice)


@router.post("/sign-in", response_class=HTMLResponse)
async def sign_in(request: Request) -> Response:
    state = app_state(request)
    seal = seal_of(state)
    fields = await read_form(request)
    if not same_origin(request) or not seal.sign_in_valid(
        request.cookies.get(SIGN_IN_COOKIE), fields.get(CSRF_FIELD)
    ):
        return _sign_in_form(
            request, error="This sign-in form has expired. Paste your key again.", status=403
        )
    key = fields.get("key", "").strip()
    if not key:
        return _sign_in_form(request, error="Paste your organisation's API key.", status=422)
    client = request.client.host if request.client else "unknown"
    wait_s = ratelimit.sign_in_refusal(state.sign_in, client, tenants.split_key(key))
    if wait_s is not None:
        return _sign_in_form(
            request,
            error=f"Too many sign-in attempts. Try again in {wait_s} seconds.",
            status=429,
            headers={"Retry-After": str(wait_s)},
        )
    async with state.pool.connection() as conn:
        who = await tenants.authenticate(conn, key)
        if who is not None and who.org_id is not None:
            session = await sessions.start(conn, who, state.settings.api.console_session_s)
    if who is None:
        return _sign_in_form(request, error="That key is not valid, or it has been revoked.", status=401)
    if who.org_id is None:
        return _sign_in_form(
            request,
            error="That is an admin key. The console is for an organisation's key "
            "(`controlplane orgs create` prints one).",
            status=403,
        )
    response = redirect("/")
    set_session_cookie(response, request, seal.seal(session.id), state.settings.api.console_session_s)
    response.delete_cookie(SIGN_IN_COOKIE, path="/sign-in")
    return response


def _sign_in_form(
    request: Request,
    *,
    notice: str | None = None,
    error: str | None = None,
    status: int = 200,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """The form; `error` is shown next to the key's field."""
    state = app_state(request)
    seal = seal_of(state)
    nonce = seal.sign_in_nonce()
    context = {"visitor": None, "org": None, "notice": notice, "error": None, "key_error": error}
    response = render("sign_in.html", context | {"csrf": seal.sign_in_token(nonce)}, status)
    response.headers.update(headers or {})
    response.set_cookie(
        SIGN_IN_COOKIE,
        nonce,
        max_age=3600,
        path="/sign-in",
        httponly=True,
        samesite="strict",
        secure=is_https(request, state.settings.api.public_url),
    )
    return response


@router.post("/sign-out")
async def sign_out(request: Request, who: SignedIn, _: Form) -> Response:
    async with app_state(request).pool.connection() as conn:
        await sessions.end(conn, who.session.id)
    response = redirect("/sign-in?signed_out=true")
    clear_session_cookie(response)
    return response


# ---- the instances ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ListQuery:
    """What the list shows: a name filter, a state class, an order, the archived ones, a page."""

    q: Annotated[str, Query(max_length=63)] = ""
    show: Annotated[str, Query(max_length=20)] = ""
    sort: Annotated[str, Query(max_length=20)] = "newest"
    include: str | None = None
    cursor: str | None = None


ListView = Annotated[ListQuery, Depends()]


@router.get("/", response_class=HTMLResponse)
async def instance_list(request: Request, who: SignedIn, view: ListView) -> Response:
    try:
        context = await _list_context(request, who, view)
    except InvalidRequest:  # a cursor that is not one of ours: the first page
        return redirect("/")
    return render("instances.html", context)


@router.get("/live", response_class=HTMLResponse)
async def instance_list_live(request: Request, who: SignedIn, view: ListView) -> Response:
    """The list's part that follows the organisation's databases (fetched again on each event)."""
    try:
        context = await _list_context(request, who, view)
    except InvalidRequest:
        raise Missing() from None
    return render("_list.html", context)


@router.get("/watch")
async def instance_list_watch(request: Request, who: SignedIn) -> StreamingResponse:
    """The organisation's stream of its databases' changes: its events drive the list."""
    return watch.org_response(request, who.org_id)


async def _list_context(request: Request, who: Visitor, view: ListQuery) -> dict[str, Any]:
    app = app_state(request)
    archived = view.include == "archived"
    async with app.pool.connection() as conn:
        page, next_cursor = await instances.list_page(
            conn, instances.ListInstances(who.org_id, archived=archived), limit=PAGE, cursor=view.cursor
        )
        docs = await views.instances(conn, page, app.box)
        org = await _org(conn, who, app.settings.billing)
    shown = SHOWN.get(view.show) and view.show
    order = view.sort if view.sort in SORTS else "newest"
    wanted = view.q.strip().lower()
    picked = [
        doc
        for doc in docs
        if wanted in str(doc["name"]).lower() and (not shown or doc["state_info"]["severity"] == shown)
    ]
    groups: dict[str, list[dict[str, Any]]] = {"live": [], "failed": [], "ended": []}
    for doc in _sorted(picked, order):
        if doc["state"] not in lifecycle.INSTANCE.terminal:
            groups["live"].append(doc)
        elif doc["state"] in FAILED and doc["archived_at"] is None and doc["replaced_by"] is None:
            groups["failed"].append(doc)  # a failure nobody has acted on yet: shown, never folded
        else:
            groups["ended"].append(doc)  # deleted, removed, or replaced by a retry
    query = {"q": view.q, "show": shown or "", "sort": order, "include": "archived" if archived else ""}
    return _page(who, org, "instances") | {
        "groups": groups,
        "names": {doc["id"]: doc["name"] for doc in docs},
        "next_cursor": next_cursor,
        "archived": archived,
        "query": query,
        "query_string": urlencode({k: v for k, v in query.items() if v and (k, v) != ("sort", "newest")}),
        "filtered": len(picked) < len(docs),
        "total": len(docs),
        "shows": SHOWN,
        "sorts": SORTS,
    }


def _sorted(docs: list[dict[str, Any]], order: str) -> list[dict[str, Any]]:
    if order == "name":
        return sorted(docs, key=lambda doc: (doc["name"], doc["created_at"]))
    if order == "state":
        rank = {severity: n for n, severity in enumerate(SEVERITY_ORDER)}
        return sorted(docs, key=lambda doc: (rank.get(doc["state_info"]["severity"], 99), doc["name"]))
    return sorted(docs, key=lambda doc: doc["created_at"], reverse=order == "newest")


@router.get("/instances/new", response_class=HTMLResponse)
async def new_instance_page(request: Request, who: SignedIn) -> Response:
    app = app_state(request)
    async with app.pool.connection() as conn:
        org = await _org(conn, who, app.settings.billing)
    return _new_instance_form(who, org, {"plan": plans.plan_names()[0]}, {})


@router.post("/instances", response_class=HTMLResponse)
async def create_instance(request: Request, who: SignedIn, form: Form) -> Response:
    app = app_state(request)
    values = {
        "name": form.get("name", "").strip(),
        "plan": form.get("plan", ""),
        "deletion_protection": form.get("deletion_protection") == "on",
    }
    field_errors: dict[str, str] = {}
    try:
        body = InstanceCreate.model_validate(values)
    except ValidationError as exc:
        field_errors = _field_errors(errors.validation_errors(exc.errors()))
    else:
        try:
            asked = instances.CreateInstance(
                who.org_id, body.name, body.plan, body.region, deletion_protection=body.deletion_protection
            )
            made = await _create_once(app, who, form, body, asked)
        except (DomainError, ProblemError) as exc:
            field_errors = _refusal_fields(exc, default_field="name")
        else:
            return redirect(f"/instances/{made}")
    async with app.pool.connection() as conn:
        org = await _org(conn, who, app.settings.billing)
    return _new_instance_form(who, org, values, field_errors, status=422)


def _new_instance_form(
    who: Visitor,
    org: Mapping[str, Any],
    values: Mapping[str, Any],
    field_errors: Mapping[str, str],
    status: int = 200,
) -> Response:
    context = _page(who, org, "new") | {
        "values": defaultdict(str, values),
        "errors": defaultdict(str, field_errors),
        "plans": _plans(),
        "request_key": secrets.token_urlsafe(16),
    }
    return render("new_instance.html", context, status)


@router.get("/instances/{instance_id}", response_class=HTMLResponse)
async def instance_page(
    request: Request, instance_id: uuid.UUID, who: SignedIn, done: str | None = None
) -> Response:
    return await _instance_view(request, who, instance_id, done=done)


@router.get("/instances/{instance_id}/live", response_class=HTMLResponse)
async def instance_live(request: Request, instance_id: uuid.UUID, who: SignedIn) -> Response:
    """The part of the instance's page that follows its state (fetched again on each watch event)."""
    app = app_state(request)
    async with app.pool.connection() as conn:
        record = await _load(conn, who, instance_id)
        org = await _org(conn, who, app.settings.billing)
        context = await _instance_context(conn, app, who, org, record)
    return render("_live.html", context)


@router.get("/instances/{instance_id}/watch")
async def instance_watch(request: Request, instance_id: uuid.UUID, who: SignedIn) -> StreamingResponse:
    """The instance's watch stream (the REST API's, for the session): its events drive the page."""
    try:
        return await watch.response(request, who.org_id, instance_id)
    except NotFound:
        raise Missing() from None


@router.get("/instances/{instance_id}/connection")
async def instance_connection(request: Request, instance_id: uuid.UUID, who: SignedIn) -> Response:
    """The connection formats with the password, for Reveal and Copy (never cached)."""
    app = app_state(request)
    async with app.pool.connection() as conn:
        record = await _load(conn, who, instance_id)
    connection = views.connection(record, app.box, reveal=True)
    if connection is None or record.state not in present.CONNECTABLE:
        raise Missing()
    formats = present.connection_formats(connection, reveal=True)
    return JSONResponse(formats, headers={"Cache-Control": "no-store"})


@router.get("/instances/{instance_id}/ca.pem")
async def instance_ca(request: Request, instance_id: uuid.UUID, who: SignedIn) -> Response:
    """The CA certificate the instance's server certificate is checked against, as the file its
    connection URI names (`sslrootcert`)."""
    async with app_state(request).pool.connection() as conn:
        record = await _load(conn, who, instance_id)
    pem = (record.connection or {}).get("ca_certificate")
    if not pem:
        raise Missing()
    disposition = f'attachment; filename="{present.CA_FILE}"'
    return Response(
        str(pem), media_type="application/x-pem-file", headers={"Content-Disposition": disposition}
    )


@router.post("/instances/{instance_id}/resize", response_class=HTMLResponse)
async def resize(request: Request, instance_id: uuid.UUID, who: SignedIn, form: Form) -> Response:
    try:
        plan = InstanceUpdate.model_validate({"plan": form.get("plan") or None}).plan
    except ValidationError as exc:
        message = "; ".join(e["message"] for e in errors.validation_errors(exc.errors()))
        return await _instance_view(request, who, instance_id, failed={"resize": message}, status=422)
    asked = instances.ChangeInstance(who.org_id, instance_id, plan=plan)
    return await _change(request, who, instance_id, "resize", asked, done="resize")


@router.post("/instances/{instance_id}/protection", response_class=HTMLResponse)
async def protection(request: Request, instance_id: uuid.UUID, who: SignedIn, form: Form) -> Response:
    on = form.get("deletion_protection") == "on"
    asked = instances.ChangeInstance(who.org_id, instance_id, deletion_protection=on)
    done = "protection-on" if on else "protection-off"
    return await _change(request, who, instance_id, "protection", asked, done=done)


@router.post("/instances/{instance_id}/delete", response_class=HTMLResponse)
async def delete(request: Request, instance_id: uuid.UUID, who: SignedIn, form: Form) -> Response:
    app = app_state(request)
    async with app.pool.connection() as conn:
        record = await _load(conn, who, instance_id)
    if form.get("confirm_name", "").strip() != record.name:
        message = f"Type the database's name, {record.name}, to confirm."
        return await _instance_view(request, who, instance_id, failed={"delete": message}, status=422)
    skip = form.get("final_backup") != "on"
    asked = instances.RequestDeletion(who.org_id, instance_id, skip_final_backup=skip)
    done = "remove" if record.state in FAILED else "delete"  # what its button said
    async with app.pool.connection() as conn:
        try:
            await instances.request_deletion(
                conn, who.customer.actor, who.customer.request_id, asked, app.policy
            )
        except NotFound:
            raise Missing() from None
        except DomainError as exc:
            return await _instance_view(request, who, instance_id, failed={"delete": exc.detail}, status=409)
    return redirect(f"/instances/{instance_id}?done={done}")


@router.post("/instances/{instance_id}/retry", response_class=HTMLResponse)
async def retry(request: Request, instance_id: uuid.UUID, who: SignedIn, _: Form) -> Response:
    """A new database in place of the failed one (the retry use case); the page follows it."""
    app = app_state(request)
    try:
        # Keyed by the failed instance: a double submit answers with the same replacement.
        customer, asked = who.customer, instances.RetryInstance(who.org_id, instance_id)
        path = f"/v1/instances/{instance_id}/retry"
        created = await instances.once(
            app.pool,
            who.org_id,
            idempotency.Keyed(f"console:retry:{instance_id}", idempotency.request_hash("POST", path, {})),
            lambda conn: instances.retry(conn, customer.actor, customer.request_id, asked, app.policy),
            _made,
        )
    except NotFound:
        raise Missing() from None
    except DomainError as exc:
        return await _instance_view(request, who, instance_id, failed={"retry": exc.detail}, status=409)
    return redirect(f"/instances/{created.response.body['id']}?done=retry")


@router.post("/instances/{instance_id}/restore-to-new", response_class=HTMLResponse)
async def restore_to_new(request: Request, instance_id: uuid.UUID, who: SignedIn, form: Form) -> Response:
    """A new database from this one's backups at a point in time (the create use case, as
    `POST /v1/instances` with `restore_from` calls it); the page follows the new one."""
    app = app_state(request)
    source = {
        "instance_id": str(instance_id),
        "point_in_time": form.get("point_in_time", "").strip() or None,
        "backup": form.get("backup", "").strip() or None,
    }
    values = {"name": form.get("name", "").strip(), "plan": form.get("plan", ""), "restore_from": source}
    try:
        body = InstanceCreate.model_validate(values)
    except ValidationError as exc:
        message = "; ".join(f"{e['field']}: {e['message']}" for e in errors.validation_errors(exc.errors()))
        return await _instance_view(request, who, instance_id, failed={"restore": message}, status=422)
    assert body.restore_from is not None
    asked = instances.CreateInstance(
        who.org_id,
        body.name,
        body.plan,
        body.region,
        restore_from=RestoreSource.from_spec(body.restore_from.model_dump(mode="json")),
    )
    try:
        made = await _create_once(app, who, form, body, asked)
    except (DomainError, ProblemError) as exc:
        message = exc.detail if isinstance(exc, DomainError) else str(exc)
        return await _instance_view(request, who, instance_id, failed={"restore": message}, status=422)
    return redirect(f"/instances/{made}?done=restored")


async def _create_once(
    app: AppState,
    who: Visitor,
    form: Mapping[str, str],
    body: InstanceCreate,
    asked: instances.CreateInstance,
) -> str:
    """The create use case behind the form's own key (a double submit, or a reload of the answer,
    creates one database); the new instance's id."""
    customer = who.customer
    created = await instances.once(
        app.pool,
        who.org_id,
        _keyed(form, "console", "/v1/instances", body.model_dump(mode="json")),
        lambda conn: instances.create(conn, customer.actor, customer.request_id, asked, app.policy),
        _made,
    )
    return str(created.response.body["id"])


async def _change(
    request: Request,
    who: Visitor,
    instance_id: uuid.UUID,
    form_name: str,
    asked: instances.ChangeInstance,
    *,
    done: str,
) -> Response:
    app = app_state(request)
    async with app.pool.connection() as conn:
        try:
            await instances.change(conn, who.customer.actor, who.customer.request_id, asked, app.policy)
        except NotFound:
            raise Missing() from None
        except DomainError as exc:
            return await _instance_view(request, who, instance_id, failed={form_name: exc.detail}, status=409)
    return redirect(f"/instances/{instance_id}?done={done}")


async def _instance_view(
    request: Request,
    who: Visitor,
    instance_id: uuid.UUID,
    *,
    done: str | None = None,
    failed: Mapping[str, str] | None = None,
    status: int = 200,
) -> Response:
    app = app_state(request)
    async with app.pool.connection() as conn:
        record = await _load(conn, who, instance_id)
        org = await _org(conn, who, app.settings.billing)
        context = await _instance_context(conn, app, who, org, record)
        shown = None
        if record.state not in lifecycle.INSTANCE.terminal:
            series = await metrics.series(
                conn, who.org_id, record.id, None, None, None, metrics.retention(app.settings.reconciler)
            )
            shown = charts.charts(series)
    # What a form's redirect says, while it is news: a deletion that is over is told by the page.
    notice = None if context["ended"] else NOTICES.get(done or "")
    context |= {
        "charts": shown,
        "chart_width": charts.WIDTH,
        "chart_height": charts.HEIGHT,
        "notice": notice,
        "errors": defaultdict(str, failed or {}),
        "plans": _plans(),
    }
    return render("instance.html", context, status)


async def _instance_context(
    conn: AsyncConn, app: AppState, who: Visitor, org: Mapping[str, Any], record: InstanceRecord
) -> dict[str, Any]:
    doc = await views.one_instance(conn, record, app.box)
    connectable = doc["connection"] is not None and record.state in present.CONNECTABLE
    found = await backups.recovery(conn, backups.ShowRecovery(record.id, who.org_id, limit=5))
    shown = [
        {"id": b.backup_id, "kind": b.kind, "type": b.type, "taken_at": b.taken_at} for b in found.backups
    ]
    ended = None
    if record.state in DELETED:
        # Its deletion's event: when, and the final backup it kept (its name; where it is kept is
        # the service's to know).
        last = await instances.last_event(conn, who.org_id, record.id)
        ended = None if last is None else views.event(last)
    return _page(who, org, "instance") | {
        "ended": ended,
        "i": doc,
        "recovery": views.recovery(found, shown),
        "restore_key": secrets.token_urlsafe(16),
        "terminal": record.state in lifecycle.INSTANCE.terminal,
        "formats": present.connection_formats(doc["connection"], reveal=False) if connectable else None,
    }


# ---- the audit timeline -------------------------------------------------------------------------


@router.get("/instances/{instance_id}/history", response_class=HTMLResponse)
async def history(
    request: Request, instance_id: uuid.UUID, who: SignedIn, cursor: str | None = None
) -> Response:
    app = app_state(request)
    async with app.pool.connection() as conn:
        try:
            rows, next_cursor = await instances.events_page(
                conn, who.org_id, instance_id, limit=HISTORY_PAGE, cursor=cursor
            )
        except NotFound:
            raise Missing() from None
        except InvalidRequest:  # a cursor that is not one of ours: the first page
            return redirect(f"/instances/{instance_id}/history")
        record = await _load(conn, who, instance_id)
        org = await _org(conn, who, app.settings.billing)
        keys = {row["id"]: row for row in await tenants.list_keys(conn, who.org_id, limit=KEYS_SHOWN)}
        doc = await views.one_instance(conn, record, app.box)
    entries = [_entry(event, keys) for event in map(views.event, rows)]
    context = _page(who, org, "instance") | {
        "i": doc,
        "entries": entries,
        "next_cursor": next_cursor,
        "first_page": cursor is None,
    }
    return render("history.html", context)


def _entry(event: dict[str, Any], keys: Mapping[uuid.UUID, Any]) -> dict[str, Any]:
    """An audit row as the timeline shows it: the move's label and the states' (lifecycle metadata)."""
    info = lifecycle.INSTANCE.state_info
    source = event["from_state"]
    return event | {
        "who": _who(event["actor"], keys),
        "label": event["label"] or event["event"],
        "from_label": info[source].label if source else None,
        "to_label": info[event["to_state"]].label,
    }


def _who(actor: Mapping[str, str], keys: Mapping[uuid.UUID, Any]) -> str:
    """The actor of an audit row in words: which of the organisation's keys, or which part of the service."""
    kind, actor_id = actor["kind"], actor["id"]
    if kind == "customer":
        try:
            key = keys.get(uuid.UUID(actor_id))
        except ValueError:
            key = None
        if key is not None:
            return f"API key {key['name'] or 'unnamed'} (cpk_{key['prefix']}_\u2026)"
        return "an API key of your organisation"
    words = {
        "worker": "the service (worker)",
        "reconciler": "the service (reconciler)",
        "stripe": "billing (Stripe event)",
        "admin": "support (an operator)",
        "system": "the service",
    }
    return words.get(kind, kind)


# ---- API keys -----------------------------------------------------------------------------------


@router.get("/keys", response_class=HTMLResponse)
async def keys_page(request: Request, who: SignedIn, done: str | None = None) -> Response:
    return await _keys_view(request, who, notice=NOTICES.get(done or ""))


@router.post("/keys", response_class=HTMLResponse)
async def create_key(request: Request, who: SignedIn, form: Form) -> Response:
    try:
        body = KeyCreate.model_validate({"name": form.get("name", "").strip()})
    except ValidationError as exc:
        message = "; ".join(e["message"] for e in errors.validation_errors(exc.errors()))
        return await _keys_view(request, who, error=message, status=422)
    state = app_state(request)
    made: list[tenants.NewKey] = []

    async def run(conn: AsyncConn) -> idempotency.StoredResponse:
        key = await tenants.create_key(
            conn, who.org_id, name=body.name, max_per_org=state.settings.api.max_keys_per_org
        )
        made.append(key)
        return idempotency.StoredResponse(201, {"id": str(key.id)}, {})

    try:
        # The form's own key: posting it again (a reload of the answer) makes no second key, and
        # the first is not shown again (it is kept only hashed).
        answer = await idempotency.once_per_key(
            state.pool, who.org_id, _keyed(form, "console-key", "/keys", {"name": body.name}), run
        )
    except LimitReached as exc:
        return await _keys_view(request, who, error=str(exc), status=409)
    if answer.replayed:
        notice = "That key was made already and is shown only once: make another if it was not copied."
        return await _keys_view(request, who, notice=notice)
    return await _keys_view(request, who, new_key={"name": body.name, "key": made[-1].plaintext}, status=201)


@router.post("/keys/{key_id}/revoke", response_class=HTMLResponse)
async def revoke_key(request: Request, key_id: uuid.UUID, who: SignedIn, _: Form) -> Response:
    if not await auth.revoke(app_state(request), key_id, who.org_id):
        return await _keys_view(
            request, who, error="That key is already revoked, or not one of yours.", status=404
        )
    if key_id == who.session.key_id:
        # This session's own key: the session ended with it.
        response = redirect("/sign-in?ended=true")
        clear_session_cookie(response)
        return response
    return redirect("/keys?done=revoked")


async def _keys_view(
    request: Request,
    who: Visitor,
    *,
    notice: str | None = None,
    error: str | None = None,
    new_key: Mapping[str, str] | None = None,
    status: int = 200,
) -> Response:
    app = app_state(request)
    async with app.pool.connection() as conn:
        org = await _org(conn, who, app.settings.billing)
        keys = await tenants.list_keys(conn, who.org_id, limit=KEYS_SHOWN)
    context = _page(who, org, "keys") | {
        "keys": [dict(key) for key in keys],
        "current_key": who.session.key_id,
        "new_key": new_key,
        "request_key": secrets.token_urlsafe(16),
        "notice": notice,
        "error": error,
    }
    return render("keys.html", context, status)


# ---- shared -------------------------------------------------------------------------------------


def _page(who: Visitor, org: Mapping[str, Any], active: str) -> dict[str, Any]:
    return {
        "visitor": who,
        "csrf": who.csrf,
        "org": org,
        "active": active,
        "notice": None,
        "error": None,
        "failed_states": FAILED,
    }


async def _org(conn: AsyncConn, who: Visitor, billing: BillingSettings) -> Mapping[str, Any]:
    """The organisation, with its billing state as customers see it (the grace period's end)."""
    org = await tenants.get_org(conn, who.org_id)
    if org is None:  # a session outlives no organisation (they are not deleted)
        raise Missing()
    return {
        **org,
        "billing": billing_policy.billing_view(dict(org), billing),
        "portal_url": billing.portal_url,
    }


async def _load(conn: AsyncConn, who: Visitor, instance_id: uuid.UUID) -> InstanceRecord:
    try:
        return await instances.load(conn, who.org_id, instance_id)
    except NotFound:
        raise Missing() from None


def _plans() -> list[dict[str, Any]]:
    return [
        {
            "name": name,
            "settings": dict(plans.PLANS[name]),
            "shape": plans.get_shape(name),
            "backups": plans.backup_schedule(name),
        }
        for name in plans.plan_names()
    ]


def _field_errors(found: list[dict[str, Any]]) -> dict[str, str]:
    """Problem-details errors by form field (`body.name` is the field `name`); the rest under `form`."""
    by_field: dict[str, str] = {}
    for error in found:
        field = str(error["field"]).removeprefix("body.")
        name = field if field in ("name", "plan", "deletion_protection") else "form"
        by_field.setdefault(name, str(error["message"]))
    return by_field


def _keyed(form: Mapping[str, str], scope: str, path: str, asked: Mapping[str, Any]) -> idempotency.Keyed:
    """The form's own Idempotency-Key: a double submit (or a reload of the answer) creates once."""
    key = f"{scope}:{form.get('request_key', '')}"[: idempotency.MAX_KEY_LENGTH]
    return idempotency.Keyed(key, idempotency.request_hash("POST", path, asked))


async def _made(_conn: AsyncConn, made: instances.InstanceResult) -> idempotency.StoredResponse:
    """What a console form stores for its key: the id of the instance it made (to show it)."""
    return idempotency.StoredResponse(202, {"id": str(made.instance.id)}, {})


def _refusal_fields(exc: DomainError | ProblemError, *, default_field: str) -> dict[str, str]:
    """A refusal of the use case as the API words it (its problem details), next to its field."""
    problem = errors.domain_problem(exc) if isinstance(exc, DomainError) else exc
    listed = problem.ext.get("errors")
    if listed:
        return _field_errors(listed)
    field = default_field if problem.kind in ("name-taken", "validation") else "form"
    return {field: problem.detail or problem.title}
