"""What every console page shares: the templates, the response headers, and reading a posted form."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import jinja2
from fastapi import Request
from fastapi.responses import HTMLResponse, RedirectResponse

from controlplane.api.console import present

HERE = Path(__file__).parent
STATIC_URL = "/static/console"
FORM_MEDIA_TYPE = "application/x-www-form-urlencoded"
# A form of the console has a handful of fields; anything beyond is refused.
MAX_FIELDS = 20

# Pages and fragments: scripts, styles and connections from this origin only, no framing, and no
# copy kept by a cache (they show credentials).
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


class FormRefused(Exception):
    """A posted form that is not one the console sent (wrong type, too many fields, not UTF-8)."""


@functools.cache
def templates() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=jinja2.select_autoescape(["html"]),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.globals.update(static=STATIC_URL)
    env.filters.update(
        duration=present.duration,
        when=present.when,
        iso=present.iso,
        badge=present.badge,
        every=present.every,
        cpu=present.cpu,
        memory=present.memory,
    )
    return env


def render(name: str, context: Mapping[str, Any], status_code: int = 200) -> HTMLResponse:
    html = templates().get_template(name).render(server_now=datetime.now(UTC), **context)
    return HTMLResponse(html, status_code=status_code, headers=HEADERS)


def redirect(url: str) -> RedirectResponse:
    """After a form: see the result with a GET (303), so a reload does not post it again."""
    return RedirectResponse(url, status_code=303, headers={"Cache-Control": "no-store"})


async def read_form(request: Request) -> dict[str, str]:
    """A urlencoded form's fields (the first value of each name)."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    body = await request.body()
    if not body and not media_type:
        return {}  # an empty post: no field, so no token either
    if media_type != FORM_MEDIA_TYPE:
        raise FormRefused(f"expected a form ({FORM_MEDIA_TYPE}), not {media_type or 'no body'}")
    try:
        text = body.decode("utf-8")
        pairs = parse_qsl(text, keep_blank_values=True, max_num_fields=MAX_FIELDS, errors="strict")
    except (UnicodeDecodeError, ValueError) as exc:
        raise FormRefused(f"the form cannot be read: {exc}") from None
    fields: dict[str, str] = {}
    for name, value in pairs:
        fields.setdefault(name, value)
    return fields


def is_https(request: Request, public_url: str | None) -> bool:
    """The console is reached over HTTPS: directly, through a trusted proxy (X-Forwarded-Proto, read
    by uvicorn), or as the configured public URL says."""
    return request.url.scheme == "https" or (public_url or "").startswith("https://")
