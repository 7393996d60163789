"""Organisations and API keys: admins create organisations; keys are listed, created and revoked."""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response

from controlplane.api import auth, views
from controlplane.api import problems as errors
from controlplane.api.auth import AdminKey, AnyKey
from controlplane.api.models import (
    KeyCreate,
    KeyList,
    NewApiKey,
    Org,
    OrgCreate,
    OrgCreated,
    OrgList,
    OrgUpdate,
)
from controlplane.api.problems import ProblemError
from controlplane.api.state import app_state
from controlplane.core import cursors
from controlplane.services import tenants
from controlplane.services.tenants import Principal

router = APIRouter(tags=["organisations and keys"])


def _shown_once(response: Response) -> None:
    """A response carrying a new key (a secret shown once) is never stored by a cache."""
    response.headers["Cache-Control"] = "no-store"


def _org(row: Any) -> dict[str, Any]:
    return {
        "id": row["id"],
        "name": row["name"],
        "stripe_customer_id": row["stripe_customer_id"],
        "billing_hold": row["billing_hold"],
        "billing_status": row["billing_status"],
        "created_at": row["created_at"],
    }


def _new_key(key: tenants.NewKey) -> dict[str, Any]:
    return {"id": key.id, "prefix": key.prefix, "key": key.plaintext}


def _own_org(who: Principal, refusal: str) -> uuid.UUID:
    """The caller's organisation; an admin key, which has none, is refused with `refusal`."""
    if who.org_id is None:
        raise ProblemError("forbidden", refusal)
    return who.org_id


@router.post(
    "/v1/orgs",
    status_code=201,
    response_model=OrgCreated,
    responses=errors.responses(400, 401, 403, 409, 413, 422),
    summary="Create an organisation and its first API key (admin)",
    operation_id="createOrg",
    description="Creates an organisation and its first API key, shown once in the answer (admin key only).",
)
async def create_org(body: OrgCreate, request: Request, response: Response, _: AdminKey) -> Any:
    _shown_once(response)
    async with app_state(request).pool.connection() as conn:
        org, key = await tenants.create_org(conn, body.name, body.stripe_customer_id)
    return {"org": _org(org), "key": _new_key(key)}


@router.get(
    "/v1/orgs",
    response_model=OrgList,
    responses=errors.responses(401, 403, 422),
    summary="List the organisations (admin)",
    operation_id="listOrgs",
    description="The organisations, oldest first, or only the one of a name (admin key only).",
)
async def list_orgs(
    request: Request,
    _: AdminKey,
    name: Annotated[
        str | None, Query(max_length=100, description="only the organisation of this name")
    ] = None,
) -> Any:
    async with app_state(request).pool.connection() as conn:
        rows = await tenants.list_orgs(conn, name)
    return {"items": [_org(r) for r in rows]}


@router.patch(
    "/v1/orgs/{org_id}",
    response_model=Org,
    responses=errors.responses(400, 401, 403, 404, 409, 413, 422),
    summary="Link an organisation to its Stripe customer (admin)",
    operation_id="updateOrg",
    description=(
        "Links an organisation made without a Stripe customer to one (admin key only): its usage is "
        "reported to that customer from then on, and the customer's subscription events apply to it, "
        "the newest decisive one received before included. The customer it has already: no change; "
        "another customer, or one another organisation has: 409."
    ),
)
async def update_org(org_id: uuid.UUID, body: OrgUpdate, request: Request, _: AdminKey) -> Any:
    async with app_state(request).pool.connection() as conn:
        org = await tenants.link_stripe_customer(conn, org_id, body.stripe_customer_id)
    return _org(org)


@router.get(
    "/v1/orgs/{org_id}/keys",
    response_model=KeyList,
    responses=errors.responses(401, 403, 404, 422),
    summary="List an organisation's API keys (admin; never the keys themselves)",
    operation_id="listOrgKeys",
    description="An organisation's API keys: ids, prefixes, names, creation and revocation times; "
    "never the keys (admin key only).",
)
async def list_org_keys(org_id: uuid.UUID, request: Request, _: AdminKey, paging: views.Page) -> Any:
    async with app_state(request).pool.connection() as conn:
        if await tenants.get_org(conn, org_id) is None:
            raise ProblemError("not-found", f"no organisation {org_id}")
    return await _keys_page(request, org_id, paging)


@router.post(
    "/v1/orgs/{org_id}/keys",
    status_code=201,
    response_model=NewApiKey,
    responses=errors.responses(400, 401, 403, 404, 409, 413, 422),
    summary="Create another API key for an organisation (admin; a cap of live keys per organisation)",
    operation_id="createOrgKey",
    description="Creates another API key for an organisation, shown once in the answer (admin key only).",
)
async def create_org_key(
    org_id: uuid.UUID, body: KeyCreate, request: Request, response: Response, _: AdminKey
) -> Any:
    return await _create_key(request, response, org_id, body)


async def _create_key(request: Request, response: Response, org_id: uuid.UUID, body: KeyCreate) -> Any:
    _shown_once(response)
    state = app_state(request)
    async with state.pool.connection() as conn:
        key = await tenants.create_key(
            conn, org_id, name=body.name, max_per_org=state.settings.api.max_keys_per_org
        )
    return _new_key(key)


@router.get(
    "/v1/keys",
    response_model=KeyList,
    responses=errors.responses(401, 403, 422),
    summary="The caller's organisation's API keys, revoked too (oldest first, paginated; never the keys)",
    operation_id="listKeys",
    description=(
        "The API keys of the caller's organisation: ids, prefixes, names, creation and revocation times; "
        "never the keys themselves."
    ),
)
async def list_keys(request: Request, who: AnyKey, paging: views.Page) -> Any:
    org_id = _own_org(who, "admin keys belong to no organisation")
    return await _keys_page(request, org_id, paging)


async def _keys_page(request: Request, org_id: uuid.UUID, paging: views.Paging) -> dict[str, Any]:
    """A page of an organisation's keys (revoked ones too), oldest first."""
    after = cursors.after_created(paging.cursor)
    async with app_state(request).pool.connection() as conn:
        rows = await tenants.list_keys(conn, org_id, limit=paging.size + 1, after=after)
    page, next_cursor = cursors.page_of(
        rows, paging.size, lambda last: cursors.created_cursor(last["created_at"], last["id"])
    )
    return {"items": [dict(r) for r in page], "next_cursor": next_cursor}


@router.post(
    "/v1/keys",
    status_code=201,
    response_model=NewApiKey,
    responses=errors.responses(400, 401, 403, 409, 413, 422),
    summary="Create another API key for the caller's organisation (a cap of live keys per organisation)",
    operation_id="createKey",
    description="Creates another API key for the caller's organisation; the key is in this answer only.",
)
async def create_own_key(body: KeyCreate, request: Request, response: Response, who: AnyKey) -> Any:
    org_id = _own_org(who, "admin keys belong to no organisation; use POST /v1/orgs/{id}/keys")
    return await _create_key(request, response, org_id, body)


@router.delete(
    "/v1/keys/{key_id}",
    status_code=204,
    response_class=Response,
    responses=errors.responses(401, 403, 404, 422),
    summary="Revoke an API key (an organisation's own keys; an admin, any key)",
    operation_id="revokeKey",
    description=(
        "Revokes an API key at once on this API process, within the key cache time on the others; an "
        "organisation revokes its own keys, an admin any key."
    ),
)
async def revoke_key(key_id: uuid.UUID, request: Request, who: AnyKey) -> Response:
    if not await auth.revoke(app_state(request), key_id, None if who.is_admin else who.org_id):
        raise ProblemError("not-found", f"no live key {key_id}")
    return Response(status_code=204)
