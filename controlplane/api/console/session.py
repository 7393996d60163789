"""Who is using the console: the session its cookie names (signed in with an organisation's key),
and the CSRF check of every form that changes something."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Annotated
from urllib.parse import urlsplit

from fastapi import Depends, Request
from fastapi.responses import Response

from controlplane.api.auth import Customer, note_org
from controlplane.api.console.web import is_https, read_form
from controlplane.api.problems import request_id
from controlplane.api.state import AppState, app_state
from controlplane.services import sessions
from controlplane.services.sessions import Seal, Session

COOKIE = "cp_session"
# Before a session exists: the sign-in form's nonce (its token is bound to it).
SIGN_IN_COOKIE = "cp_sign_in"
CSRF_FIELD = "csrf_token"


class SignInRequired(Exception):
    """No live session: `ended` when the cookie named one that is over (signed out, expired, or its
    key revoked)."""

    def __init__(self, ended: bool) -> None:
        super().__init__("sign in to the console")
        self.ended = ended


class CsrfRefused(Exception):
    """A state-changing form without this session's token, or posted from another site."""


@dataclass(frozen=True)
class Visitor:
    """A signed-in console user: the session, its CSRF token, and the customer it acts as (the
    key it signed in with: the same actor the REST API records for that key)."""

    session: Session
    csrf: str
    customer: Customer

    @property
    def org_id(self) -> uuid.UUID:
        return self.session.org_id


def seal_of(state: AppState) -> Seal:
    assert state.seal is not None  # made with the state
    return state.seal


async def visitor(request: Request) -> Visitor:
    state = app_state(request)
    seal = seal_of(state)
    value = request.cookies.get(COOKIE)
    session_id = seal.open(value) if value else None
    session = None
    if session_id is not None:
        async with state.pool.connection() as conn:
            session = await sessions.resolve(conn, session_id)
    if session is None:
        raise SignInRequired(ended=value is not None)
    note_org(request, session.org_id)
    customer = Customer(session.org_id, session.key_id, request_id(request))
    return Visitor(session, seal.csrf_token(session.id), customer)


SignedIn = Annotated[Visitor, Depends(visitor)]


def same_origin(request: Request) -> bool:
    """The request did not come from another site (the browser says so where it sends Origin or
    Sec-Fetch-Site; the SameSite=Strict cookie is the first line, the token the second)."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        return False
    origin = request.headers.get("origin")
    if origin is None or origin == "null":
        return origin is None
    return urlsplit(origin).netloc == request.headers.get("host", "")


async def posted(request: Request, who: SignedIn) -> dict[str, str]:
    """The fields of a form this session's pages sent (its CSRF token checked), or CsrfRefused."""
    fields = await read_form(request)
    if not same_origin(request) or not seal_of(app_state(request)).csrf_valid(
        who.session.id, fields.get(CSRF_FIELD)
    ):
        raise CsrfRefused("this form did not come from your console session; reload the page and try again")
    return fields


Form = Annotated[dict[str, str], Depends(posted)]


def set_session_cookie(response: Response, request: Request, value: str, max_age_s: float) -> None:
    state = app_state(request)
    response.set_cookie(
        COOKIE,
        value,
        max_age=int(max_age_s),
        path="/",
        httponly=True,
        samesite="strict",
        secure=is_https(request, state.settings.api.public_url),
    )


def clear_session_cookie(response: Response) -> None:
    response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
