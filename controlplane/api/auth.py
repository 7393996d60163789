"""Who is calling: Bearer API keys resolved to an organisation or an admin, denied by default."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from controlplane.api.problems import ProblemError, request_id
from controlplane.api.state import AppState, app_state
from controlplane.db.transitions import Actor
from controlplane.services import tenants
from controlplane.services.tenants import Principal

bearer = HTTPBearer(auto_error=False, description="An API key: `Authorization: Bearer cpk_...`")

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="controlplane"'}


@dataclass(frozen=True)
class Customer:
    """A caller holding an organisation's key: every query it makes is scoped to `org_id`."""

    org_id: uuid.UUID
    key_id: uuid.UUID
    request_id: str | None

    @property
    def actor(self) -> Actor:
        return Actor("customer", str(self.key_id))


@dataclass(frozen=True)
class Admin:
    key_id: uuid.UUID
    request_id: str | None

    @property
    def actor(self) -> Actor:
        return Actor("admin", str(self.key_id))


async def principal(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> Principal:
    if credentials is None or not credentials.credentials:
        raise ProblemError(
            "unauthorized", "an API key is required (Authorization: Bearer ...)", headers=_CHALLENGE
        )
    state = app_state(request)
    key_hash = tenants.hash_key(credentials.credentials)
    found = state.keys.get(key_hash)
    if found is None:
        async with state.pool.connection() as conn:
            found = await tenants.authenticate(conn, credentials.credentials)
        if found is not None:
            state.keys.put(key_hash, found)
    if found is None:
        raise ProblemError("unauthorized", "the API key is not valid or has been revoked", headers=_CHALLENGE)
    note_org(request, found.org_id)
    return found


def note_org(request: Request, org_id: uuid.UUID | None) -> None:
    """The organisation the request acts for, for its access-log line and its span (admin: none)."""
    if org_id is not None:
        request.state.org_id = str(org_id)


# Any valid key: an organisation's or an admin's.
AnyKey = Annotated[Principal, Depends(principal)]


async def customer(request: Request, who: AnyKey) -> Customer:
    if who.org_id is None:
        raise ProblemError("forbidden", "this route needs an organisation's key, not an admin key")
    return Customer(who.org_id, who.key_id, request_id(request))


async def admin(request: Request, who: AnyKey) -> Admin:
    if not who.is_admin:
        raise ProblemError("forbidden", "this route needs an admin key")
    return Admin(who.key_id, request_id(request))


AdminKey = Annotated[Admin, Depends(admin)]


async def revoke(state: AppState, key_id: uuid.UUID, org_id: uuid.UUID | None) -> bool:
    """Revoke a live key of `org_id` (any organisation's: None), trusted by this process no longer
    (nor its console sessions, which end with it); False if there is no such live key."""
    async with state.pool.connection() as conn:
        revoked = await tenants.revoke_key(conn, key_id, org_id)
    if revoked:
        state.keys.forget(key_id)
    return revoked
