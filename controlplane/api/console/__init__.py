"""The customer console, served at `/` by the API's application: server-rendered pages (Jinja2)
and one small script of its own, signed in with an organisation's key for a session cookie."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response
from fastapi.staticfiles import StaticFiles

from controlplane.api.console import pages
from controlplane.api.console.session import CsrfRefused, SignInRequired, clear_session_cookie
from controlplane.api.console.web import HERE, STATIC_URL, FormRefused, redirect, render
from controlplane.api.problems import problem_response


def install(app: FastAPI) -> None:
    app.include_router(pages.router)
    app.mount(STATIC_URL, StaticFiles(directory=HERE / "static"), name="console-static")
    app.add_exception_handler(SignInRequired, _sign_in_required)
    app.add_exception_handler(CsrfRefused, _refused)
    app.add_exception_handler(FormRefused, _refused)
    app.add_exception_handler(pages.Missing, _missing)


# A page outside a session's pages: no navigation, no organisation.
_BARE = {"visitor": None, "org": None, "notice": None, "error": None}


def _wants_page(request: Request) -> bool:
    return "text/html" in request.headers.get("accept", "")


async def _sign_in_required(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, SignInRequired)
    if _wants_page(request):
        response: Response = redirect("/sign-in?ended=true" if exc.ended else "/sign-in")
    else:  # the page's script (a fragment, the watch stream): it reloads the page, which signs in
        response = problem_response("unauthorized", "sign in to the console", instance=request.url.path)
    if exc.ended:
        clear_session_cookie(response)
    return response


async def _refused(request: Request, exc: Exception) -> Response:
    status = 415 if isinstance(exc, FormRefused) else 403
    context = {"title": "Not accepted", "message": str(exc), **_BARE}
    return render("error.html", context, status)


async def _missing(request: Request, exc: Exception) -> Response:
    context = {"title": "Not found", "message": "There is no such database in your organisation.", **_BARE}
    if not _wants_page(request):
        return problem_response("not-found", context["message"], instance=request.url.path)
    return render("error.html", context, 404)
