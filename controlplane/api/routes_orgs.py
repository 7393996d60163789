"""Organisations and API keys: admins create organisations; keys are listed, created and revoked."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request, Response

from controlplane import tenants
from controlplane.api import errors
from controlplane.api.auth import AdminKey, AnyKey
from controlplane.api.errors import ProblemError
from controlplane.api.models import KeyCreate, KeyList, NewApiKey, OrgCreate, OrgCreated
from controlplane.api.state import AppState, app_state
from controlplane.tenants import Principal

router = APIRouter(tags=["organisations and keys"])


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
)
async def create_org(body: OrgCreate, request: Request, _: AdminKey) -> Any:
    async with app_state(request).pool.connection() as conn:
        org, key = await tenants.create_org(conn, body.name, body.stripe_customer_id)
    return {"org": _org(org), "key": _new_key(key)}


@router.post(
    "/v1/orgs/{org_id}/keys",
    status_code=201,
    response_model=NewApiKey,
    responses=errors.responses(400, 401, 403, 404, 413, 422),
    summary="Create another API key for an organisation (admin)",
)
async def create_org_key(org_id: uuid.UUID, body: KeyCreate, request: Request, _: AdminKey) -> Any:
    async with app_state(request).pool.connection() as conn:
        if await tenants.get_org(conn, org_id) is None:
            raise ProblemError("not-found", f"no organisation {org_id}")
        key = await tenants.create_key(conn, org_id, name=body.name)
    return _new_key(key)


@router.get(
    "/v1/keys",
    response_model=KeyList,
    responses=errors.responses(401, 403),
    summary="List the API keys of the caller's organisation (never the keys themselves)",
)
async def list_keys(request: Request, who: AnyKey) -> Any:
    org_id = _own_org(who, "admin keys belong to no organisation")
    async with app_state(request).pool.connection() as conn:
        rows = await tenants.list_keys(conn, org_id)
    return {"items": [dict(r) for r in rows]}


@router.post(
    "/v1/keys",
    status_code=201,
    response_model=NewApiKey,
    responses=errors.responses(400, 401, 403, 413, 422),
    summary="Create another API key for the caller's organisation",
)
async def create_own_key(body: KeyCreate, request: Request, who: AnyKey) -> Any:
    org_id = _own_org(who, "admin keys belong to no organisation; use POST /v1/orgs/{id}/keys")
    async with app_state(request).pool.connection() as conn:
        key = await tenants.create_key(conn, org_id, name=body.name)
    return _new_key(key)


@router.delete(
    "/v1/keys/{key_id}",
    status_code=204,
    response_class=Response,
    responses=errors.responses(401, 403, 404, 422),
    summary="Revoke an API key (an organisation's own keys; an admin, any key)",
)
async def revoke_key(key_id: uuid.UUID, request: Request, who: AnyKey) -> Response:
    if not await revoke(app_state(request), key_id, None if who.is_admin else who.org_id):
        raise ProblemError("not-found", f"no live key {key_id}")
    return Response(status_code=204)


async def revoke(state: AppState, key_id: uuid.UUID, org_id: uuid.UUID | None) -> bool:
    """Revoke a live key of `org_id` (any organisation's: None), trusted by this process no longer
    (nor its console sessions, which end with it); False if there is no such live key."""
    async with state.pool.connection() as conn:
        revoked = await tenants.revoke_key(conn, key_id, org_id)
    if revoked:
        state.keys.forget(key_id)
    return revoked
