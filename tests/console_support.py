"""Helpers of the console tests over HTTP: sign in as a browser would, read a page's form token."""

from __future__ import annotations

import html
import re

import httpx

TOKEN = re.compile(r'name="csrf_token" value="([^"]+)"')
# A browser's navigation asks for a page; the console answers those with pages and redirects.
PAGE = {"Accept": "text/html"}


def token_of(page: str) -> str:
    found = TOKEN.search(page)
    assert found is not None, "no form token on the page"
    return html.unescape(found.group(1))


async def sign_in(client: httpx.AsyncClient, key: str) -> httpx.Response:
    """Post the sign-in form with `key` (its token from the form, as the page gives it)."""
    page = await client.get("/sign-in", headers=PAGE)
    assert page.status_code == 200
    return await client.post("/sign-in", data={"csrf_token": token_of(page.text), "key": key}, headers=PAGE)


async def signed_in(client: httpx.AsyncClient, key: str) -> str:
    """Sign in; the form token of this session's pages."""
    response = await sign_in(client, key)
    assert response.status_code == 303 and response.headers["location"] == "/", response.text
    home = await client.get("/", headers=PAGE)
    assert home.status_code == 200
    return token_of(home.text)


def text_of(page: str) -> str:
    """A page's words without its markup (what a person reads)."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", page)).split())
