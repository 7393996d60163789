"""The API's documentation pages (Swagger UI and ReDoc) from assets installed with the project
(the pinned `fastapi-offline` package): nothing is fetched from elsewhere when they are opened.

They are served from the console's origin, so they carry the console's security headers; their
policy differs in what the pages need: the one inline script each page has (allowed by its hash)
and inline styles (ReDoc writes its styles at run time; scripts stay this origin's only)."""

from __future__ import annotations

import base64
import hashlib
import re
from importlib.resources import files
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from controlplane.api.console.web import HEADERS

ASSETS_URL = "/static/docs"
OAUTH2_REDIRECT_URL = "/docs/oauth2-redirect"

router = APIRouter(include_in_schema=False)

# The console's policy, but for what the documentation pages need (see above); the rest as the console's.
POLICY = (
    "default-src 'self'; script-src 'self' {scripts}; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self' data:; worker-src 'self' blob:; connect-src 'self'; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)
INLINE_SCRIPT = re.compile(r"<script>(.*?)</script>", re.S)


def with_headers(page: HTMLResponse) -> HTMLResponse:
    """`page` with the console's headers, its inline scripts allowed by their SHA-256."""
    body = bytes(page.body).decode()
    digests = [
        base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
        for script in INLINE_SCRIPT.findall(body)
    ]
    scripts = " ".join(f"'sha256-{digest}'" for digest in digests)
    page.headers.update(HEADERS | {"Content-Security-Policy": POLICY.format(scripts=scripts)})
    return page


def assets() -> Path:
    """Swagger UI's and ReDoc's files as the package ships them."""
    return Path(str(files("fastapi_offline") / "static"))


@router.get("/docs", response_class=HTMLResponse)
async def swagger_ui(request: Request) -> HTMLResponse:
    return with_headers(
        get_swagger_ui_html(
            openapi_url=request.app.openapi_url,
            title=f"{request.app.title} (Swagger UI)",
            oauth2_redirect_url=OAUTH2_REDIRECT_URL,
            swagger_js_url=f"{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS_URL}/favicon.png",
        )
    )


@router.get(OAUTH2_REDIRECT_URL, response_class=HTMLResponse)
async def swagger_ui_redirect() -> HTMLResponse:
    return with_headers(get_swagger_ui_oauth2_redirect_html())


@router.get("/redoc", response_class=HTMLResponse)
async def redoc(request: Request) -> HTMLResponse:
    return with_headers(
        get_redoc_html(
            openapi_url=request.app.openapi_url,
            title=f"{request.app.title} (ReDoc)",
            redoc_js_url=f"{ASSETS_URL}/redoc.standalone.js",
            redoc_favicon_url=f"{ASSETS_URL}/favicon.png",
            with_google_fonts=False,
        )
    )


def install(app: FastAPI) -> None:
    app.include_router(router)
    app.mount(ASSETS_URL, StaticFiles(directory=assets()), name="docs-static")
