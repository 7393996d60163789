"""The console over HTTP (the browser tests drive it in Chromium): sessions, CSRF, tenancy, forms
that call the use cases, and the documentation served from local files."""

from __future__ import annotations

import base64
import hashlib
import re
import time
import uuid
from datetime import timedelta

import httpx
import pytest
from fastapi import FastAPI

from controlplane.api.console.session import COOKIE, SIGN_IN_COOKIE
from controlplane.db.connection import AsyncConn
from controlplane.db.transitions import transition
from controlplane.runtime.secretbox import SecretBox
from controlplane.runtime.settings import Settings
from controlplane.services import sessions, tenants
from controlplane.services.sessions import Seal
from tests.api_support import WORKER, Tenant, create, drive, make_ready, make_tenant, ready_patch
from tests.console_support import PAGE, sign_in, signed_in, text_of, token_of

pytest_plugins = ("tests.api_fixtures",)


async def _count(conn: AsyncConn, org_id: uuid.UUID) -> int:
    cursor = await conn.execute("SELECT count(*) AS n FROM instances WHERE org_id = %s", (org_id,))
    row = await cursor.fetchone()
    assert row is not None
    return int(row["n"])


# ---- signing in -----------------------------------------------------------------------------------


async def test_a_wrong_key_is_refused_with_a_message_and_nothing_else(
    client: httpx.AsyncClient, tenant: Tenant
) -> None:
    for key in ("nope", tenant.key[:-2] + "xx", "cpk_000000000000_" + "a" * 43):
        refused = await sign_in(client, key)
        assert refused.status_code == 401
        assert "That key is not valid, or it has been revoked." in text_of(refused.text)
        assert COOKIE not in refused.cookies
    assert (await client.get("/", headers=PAGE)).headers["location"] == "/sign-in"


async def test_an_admin_key_is_sent_to_an_organisation_key(
    client: httpx.AsyncClient, conn: AsyncConn
) -> None:
    admin = await tenants.create_admin_key(conn)
    refused = await sign_in(client, admin.plaintext)
    assert refused.status_code == 403 and "That is an admin key" in text_of(refused.text)


async def test_sign_in_gives_a_strict_http_only_cookie_that_names_a_session(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn
) -> None:
    response = await sign_in(client, tenant.key)
    assert response.status_code == 303 and response.headers["location"] == "/"
    cookie = next(h for h in response.headers.get_list("set-cookie") if h.startswith(f"{COOKIE}="))
    attributes = {part.strip().split("=")[0].lower() for part in cookie.split(";")[1:]}
    assert {"httponly", "samesite", "max-age", "path"} <= attributes and "secure" not in attributes
    assert "samesite=strict" in cookie.lower()
    # The value is sealed: it does not carry the key, and a session row backs it.
    assert tenant.key not in cookie
    cursor = await conn.execute(
        "SELECT count(*) AS n FROM console_sessions WHERE org_id = %s", (tenant.org_id,)
    )
    assert (await cursor.fetchone()) == {"n": 1}
    home = await client.get("/", headers=PAGE)
    assert home.status_code == 200 and "acme" in home.text and "No databases yet" in text_of(home.text)


async def test_behind_https_the_cookies_are_secure(api_settings: Settings, tenant: Tenant) -> None:
    from controlplane.api.app import create_app

    app = create_app(api_settings.replace(public_url="https://console.example"))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="https://console.example") as http:
            form = await http.get("/sign-in", headers=PAGE)
            response = await sign_in(http, tenant.key)
    assert response.status_code == 303
    (session,) = [c for c in response.headers.get_list("set-cookie") if c.startswith(f"{COOKIE}=")]
    (nonce,) = form.headers.get_list("set-cookie")
    assert nonce.startswith(f"{SIGN_IN_COOKIE}=")
    for cookie in (session, nonce):
        assert "secure" in {part.strip().split("=")[0].lower() for part in cookie.split(";")[1:]}, cookie


async def test_sign_in_attempts_are_limited_per_client_address_and_per_key_prefix(
    api_settings: Settings, tenant: Tenant, other_tenant: Tenant
) -> None:
    """Three attempts a minute (on a clock the test moves): the fourth from one address, or with one
    key's prefix from anywhere, is refused with 429 and the message next to the key's field."""
    from controlplane.api.app import create_app

    now = [1000.0]
    app = create_app(api_settings.replace(console_sign_in_limit=3), clock=lambda: now[0])
    async with app.router.lifespan_context(app):
        here, there = (
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=(ip, 40000)), base_url="http://t")
            for ip in ("192.0.2.1", "192.0.2.2")
        )
        async with here, there:
            guesses = [await sign_in(here, tenant.key[:-2] + "xx") for _ in range(3)]
            assert [g.status_code for g in guesses] == [401, 401, 401]
            refused = await sign_in(here, tenant.key)  # the right key, too late this minute
            assert refused.status_code == 429 and refused.headers["retry-after"] == "60"
            assert COOKIE not in refused.cookies
            field = re.search(r'<div class="field invalid">.*?</div>', refused.text, re.S)
            assert field is not None and 'aria-describedby="key-help key-error"' in field.group(0)
            assert "Too many sign-in attempts. Try again in 60 seconds." in text_of(field.group(0))
            # The key's prefix is held from another address too; another key from there is not.
            assert (await sign_in(there, tenant.key)).status_code == 429
            assert (await sign_in(there, other_tenant.key)).status_code == 303
            # The first address is held whatever the key.
            assert (await sign_in(here, other_tenant.key)).status_code == 429
            now[0] += 59.5
            assert (await sign_in(here, tenant.key)).headers["retry-after"] == "1"
            now[0] += 0.5
            assert (await sign_in(here, tenant.key)).status_code == 303


async def test_sign_in_without_its_form_token_is_refused(client: httpx.AsyncClient, tenant: Tenant) -> None:
    refused = await client.post("/sign-in", data={"key": tenant.key}, headers=PAGE)
    assert refused.status_code == 403 and COOKIE not in refused.cookies
    assert "This sign-in form has expired" in text_of(refused.text)


async def test_sign_out_ends_the_session_for_every_copy_of_the_cookie(
    client: httpx.AsyncClient, tenant: Tenant
) -> None:
    token = await signed_in(client, tenant.key)
    copy = client.cookies[COOKIE]
    out = await client.post("/sign-out", data={"csrf_token": token}, headers=PAGE)
    assert out.status_code == 303 and out.headers["location"] == "/sign-in?signed_out=true"
    client.cookies.set(COOKIE, copy)  # a copy kept elsewhere names an ended session
    again = await client.get("/", headers=PAGE)
    assert again.status_code == 303 and again.headers["location"] == "/sign-in?ended=true"


async def test_revoking_the_key_ends_its_sessions(client: httpx.AsyncClient, tenant: Tenant) -> None:
    await signed_in(client, tenant.key)
    (key,) = (await client.get("/v1/keys", headers=tenant.headers)).json()["items"]
    assert (await client.delete(f"/v1/keys/{key['id']}", headers=tenant.headers)).status_code == 204
    ended = await client.get("/", headers=PAGE)
    assert ended.status_code == 303 and ended.headers["location"] == "/sign-in?ended=true"
    # The page's script gets a 401 instead of a redirect (it reloads the page).
    assert (await client.get("/", headers={"Accept": "*/*"})).status_code == 401


async def test_an_expired_session_signs_in_again(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn
) -> None:
    await signed_in(client, tenant.key)
    await conn.execute("UPDATE console_sessions SET expires_at = now() - interval '1 second'")
    ended = await client.get("/", headers=PAGE)
    assert ended.headers["location"] == "/sign-in?ended=true"


async def test_sessions_live_by_the_injected_time(conn: AsyncConn, tenant: Tenant) -> None:
    who = await tenants.authenticate(conn, tenant.key)
    assert who is not None
    session = await sessions.start(conn, who, ttl_s=600)
    assert await sessions.resolve(conn, session.id) == session
    assert await sessions.resolve(conn, session.id, now=session.expires_at - timedelta(seconds=1)) == session
    assert await sessions.resolve(conn, session.id, now=session.expires_at) is None
    await sessions.end(conn, session.id)
    assert await sessions.resolve(conn, session.id) is None


def test_a_cookie_opens_only_with_its_secret_and_within_its_lifetime() -> None:
    box = SecretBox("a" * 43 + "=")
    seal = Seal(box, ttl_s=3600)
    session_id = uuid.uuid4()
    now = time.time()
    value = seal.seal(session_id, now=now)
    assert seal.open(value, now=now + 60) == session_id
    assert seal.open(value, now=now + 3601) is None  # older than a session lives
    assert Seal(SecretBox("b" * 43 + "="), ttl_s=3600).open(value, now=now) is None
    assert seal.open(value[:-4] + "AAAA", now=now) is None
    assert seal.open("not a cookie", now=now) is None
    # The form token is the session's, and the credentials' key is not the cookies' key.
    assert seal.csrf_valid(session_id, seal.csrf_token(session_id))
    assert not seal.csrf_valid(uuid.uuid4(), seal.csrf_token(session_id))
    assert box.subkey("console-session") != box.subkey("console-csrf")


# ---- CSRF and tenancy -------------------------------------------------------------------------------


async def test_a_form_post_without_the_csrf_token_is_refused_and_changes_nothing(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn
) -> None:
    token = await signed_in(client, tenant.key)
    form = {"name": "orders", "plan": "dev", "request_key": "k1"}
    for data, headers in (
        (form, PAGE),
        (form | {"csrf_token": "0" * 64}, PAGE),
        (form | {"csrf_token": token}, PAGE | {"Origin": "https://evil.example"}),
        (form | {"csrf_token": token}, PAGE | {"Sec-Fetch-Site": "cross-site"}),
    ):
        refused = await client.post("/instances", data=data, headers=headers)
        assert refused.status_code == 403, refused.text
    assert await _count(conn, tenant.org_id) == 0
    for path in ("/sign-out", "/keys"):
        assert (await client.post(path, data={}, headers=PAGE)).status_code == 403
    assert (await client.get("/", headers=PAGE)).status_code == 200  # still signed in
    made = await client.post("/instances", data=form | {"csrf_token": token}, headers=PAGE)
    assert made.status_code == 303 and await _count(conn, tenant.org_id) == 1


async def test_another_organisation_sees_none_of_it(
    client: httpx.AsyncClient, app: FastAPI, tenant: Tenant, other_tenant: Tenant, conn: AsyncConn
) -> None:
    created = await create(client, tenant, "orders")
    await make_ready(conn, app_state_settings(app), created["id"])
    token = await signed_in(client, other_tenant.key)
    home = await client.get("/", headers=PAGE)
    assert "orders" not in home.text
    base = f"/instances/{created['id']}"
    for path in (base, f"{base}/live", f"{base}/history", f"{base}/connection", f"{base}/watch"):
        assert (await client.get(path, headers=PAGE)).status_code == 404, path
    for action, data in (
        ("resize", {"plan": "small"}),
        ("protection", {"deletion_protection": "on"}),
        ("delete", {"confirm_name": "orders", "final_backup": "on"}),
    ):
        refused = await client.post(f"{base}/{action}", data=data | {"csrf_token": token}, headers=PAGE)
        assert refused.status_code == 404, action
    row = await (await conn.execute("SELECT * FROM instances WHERE id = %s", (created["id"],))).fetchone()
    assert row is not None and row["deletion_requested_at"] is None and row["spec"]["plan"] == "dev"
    assert not row["deletion_protection"]


def app_state_settings(app: FastAPI) -> Settings:
    return app.state.controlplane.settings  # type: ignore[no-any-return]


# ---- the forms call the use cases ------------------------------------------------------------------


async def test_create_shows_the_apis_validation_next_to_the_field_and_creates_once(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn
) -> None:
    token = await signed_in(client, tenant.key)
    bad = await client.post(
        "/instances", data={"csrf_token": token, "name": "Bad_Name", "plan": "dev"}, headers=PAGE
    )
    assert bad.status_code == 422
    assert re.search(r'<p id="name-error" class="field-error">use lower-case letters', bad.text)
    assert 'value="Bad_Name"' in bad.text and 'aria-invalid="true"' in bad.text
    plan = await client.post(
        "/instances", data={"csrf_token": token, "name": "ok", "plan": "huge"}, headers=PAGE
    )
    assert plan.status_code == 422 and "unknown plan &#39;huge&#39;" in plan.text
    form = {"csrf_token": token, "name": "orders", "plan": "small", "request_key": "once"}
    first = await client.post("/instances", data=form, headers=PAGE)
    again = await client.post("/instances", data=form, headers=PAGE)  # a double submit
    assert first.status_code == again.status_code == 303
    assert first.headers["location"] == again.headers["location"]
    assert await _count(conn, tenant.org_id) == 1
    taken = await client.post("/instances", data=form | {"request_key": "other"}, headers=PAGE)
    assert taken.status_code == 422 and 'id="name-error"' in taken.text
    assert "already" in text_of(taken.text)


async def test_resize_protection_and_delete_go_through_the_use_cases(
    client: httpx.AsyncClient, app: FastAPI, tenant: Tenant, conn: AsyncConn
) -> None:
    created = await create(client, tenant, "orders")
    await make_ready(conn, app_state_settings(app), created["id"])
    token = await signed_in(client, tenant.key)
    base = f"/instances/{created['id']}"
    resized = await client.post(f"{base}/resize", data={"csrf_token": token, "plan": "small"}, headers=PAGE)
    assert resized.status_code == 303 and resized.headers["location"] == f"{base}?done=resize"
    on = await client.post(
        f"{base}/protection", data={"csrf_token": token, "deletion_protection": "on"}, headers=PAGE
    )
    assert on.status_code == 303
    refused = await client.post(
        f"{base}/delete",
        data={"csrf_token": token, "confirm_name": "orders", "final_backup": "on"},
        headers=PAGE,
    )
    assert refused.status_code == 409 and "deletion protection is on" in text_of(refused.text)
    await client.post(
        f"{base}/protection", data={"csrf_token": token, "deletion_protection": "off"}, headers=PAGE
    )
    mistyped = await client.post(
        f"{base}/delete", data={"csrf_token": token, "confirm_name": "order"}, headers=PAGE
    )
    assert mistyped.status_code == 422 and "Type the database's name, orders, to confirm." in text_of(
        mistyped.text
    )
    deleted = await client.post(
        f"{base}/delete", data={"csrf_token": token, "confirm_name": "orders"}, headers=PAGE
    )
    assert deleted.status_code == 303
    row = await (await conn.execute("SELECT * FROM instances WHERE id = %s", (created["id"],))).fetchone()
    assert row is not None and row["spec"]["plan"] == "small" and row["spec_generation"] == 2
    assert row["deletion_requested_at"] is not None and row["skip_final_backup"]  # the box was unticked
    history = await client.get(f"{base}/history", headers=PAGE)
    assert history.status_code == 200
    # Who: the key the session signed in with, by its name.
    assert "API key first key" in text_of(history.text)


async def test_the_connection_is_shown_masked_and_revealed_on_request(
    client: httpx.AsyncClient, app: FastAPI, tenant: Tenant, conn: AsyncConn
) -> None:
    created = await create(client, tenant, "orders")
    await signed_in(client, tenant.key)
    base = f"/instances/{created['id']}"
    assert (await client.get(f"{base}/connection")).status_code == 404  # not usable yet
    assert "data-connection=" not in (await client.get(base, headers=PAGE)).text
    await make_ready(conn, app_state_settings(app), created["id"], password="s3cret/pw")
    page = await client.get(base, headers=PAGE)
    assert page.status_code == 200 and "s3cret" not in page.text and "postgresql://app_owner:" in page.text
    assert page.headers["cache-control"] == "no-store"
    assert "script-src 'self'" in page.headers["content-security-policy"]
    revealed = await client.get(f"{base}/connection")
    assert revealed.headers["cache-control"] == "no-store"
    formats = revealed.json()
    assert formats["uri"] == "postgresql://app_owner:s3cret%2Fpw@127.0.0.1:15432/app"
    assert "export PGPASSWORD=s3cret/pw" in formats["env"]
    assert "read_only" not in formats  # one server: no standby to read from
    assert "Read-only URI" not in page.text
    assert (await client.get(f"{base}/ca.pem")).status_code == 404  # no TLS, no CA to offer


async def test_an_ha_instance_shows_its_read_only_uri_beside_the_pooled_one(
    client: httpx.AsyncClient, app: FastAPI, tenant: Tenant, conn: AsyncConn
) -> None:
    created = await create(client, tenant, "orders")
    await signed_in(client, tenant.key)
    base = f"/instances/{created['id']}"
    patch = ready_patch(app_state_settings(app), "s3cret")
    patch["connection"] |= {
        "pool_mode": "transaction",
        "direct": {"host": "127.0.0.1", "port": 15433},
        "read_only": {"host": "127.0.0.1", "port": 15432, "dbname": "app_readonly"},
    }
    await drive(conn, created["id"], "start_provisioning", "provisioned", **patch)
    page = await client.get(base, headers=PAGE)
    assert page.status_code == 200 and "s3cret" not in page.text
    # Masked on the page, with the copy button of its own; its database name said in words.
    assert 'data-format="read_only"' in page.text and 'data-copy="read_only"' in page.text
    assert "postgresql://app_owner:" in page.text and "/app_readonly" in page.text
    assert "Every write there is refused" in text_of(page.text)
    formats = (await client.get(f"{base}/connection")).json()
    assert formats["read_only"] == "postgresql://app_owner:s3cret@127.0.0.1:15432/app_readonly"


async def test_the_ca_download_comes_before_the_uri_that_names_its_file(
    client: httpx.AsyncClient, app: FastAPI, tenant: Tenant, conn: AsyncConn
) -> None:
    created = await create(client, tenant, "orders")
    await signed_in(client, tenant.key)
    base = f"/instances/{created['id']}"
    pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    await make_ready(conn, app_state_settings(app), created["id"], password="pw", ca=pem)
    page = (await client.get(base, headers=PAGE)).text
    # The step the URI needs is shown above it: the download, and the file name the URI gives.
    assert page.index("Download the CA certificate") < page.index('data-format="uri"')
    assert f'href="{base}/ca.pem" download="controlplane-ca.pem"' in page
    formats = (await client.get(f"{base}/connection")).json()
    assert formats["uri"].endswith("/app?sslmode=verify-full&sslrootcert=controlplane-ca.pem")
    assert formats["psql"] == f"psql '{formats['uri']}'"
    assert "export PGSSLROOTCERT=controlplane-ca.pem" in formats["env"]
    ca = await client.get(f"{base}/ca.pem")
    assert ca.status_code == 200 and ca.text == pem
    assert ca.headers["content-disposition"] == 'attachment; filename="controlplane-ca.pem"'


async def test_keys_are_created_once_listed_and_revoked(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn
) -> None:
    token = await signed_in(client, tenant.key)
    made = await client.post("/keys", data={"csrf_token": token, "name": "ci deploys"}, headers=PAGE)
    assert made.status_code == 201
    key = re.search(r'id="new-key-value">(cpk_[^<]+)<', made.text)
    assert key is not None and await tenants.authenticate(conn, key.group(1)) is not None
    listed = await client.get("/keys", headers=PAGE)
    assert key.group(1) not in listed.text and "ci deploys" in listed.text
    keys = await tenants.list_keys(conn, tenant.org_id, limit=10)
    other = next(row for row in keys if row["name"] == "ci deploys")
    revoked = await client.post(f"/keys/{other['id']}/revoke", data={"csrf_token": token}, headers=PAGE)
    assert revoked.status_code == 303 and revoked.headers["location"] == "/keys?done=revoked"
    assert await tenants.authenticate(conn, key.group(1)) is None
    own = next(row for row in keys if row["name"] == "first key")
    out = await client.post(f"/keys/{own['id']}/revoke", data={"csrf_token": token}, headers=PAGE)
    assert out.headers["location"] == "/sign-in?ended=true"
    assert (await client.get("/keys", headers=PAGE)).headers["location"] == "/sign-in"  # cookie cleared


async def test_another_organisations_key_cannot_be_revoked(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn
) -> None:
    victim = await make_tenant(conn, "victim")
    (key,) = await tenants.list_keys(conn, victim.org_id, limit=10)
    token = await signed_in(client, tenant.key)
    refused = await client.post(f"/keys/{key['id']}/revoke", data={"csrf_token": token}, headers=PAGE)
    assert refused.status_code == 404
    assert await tenants.authenticate(conn, victim.key) is not None


# ---- documentation and static files -----------------------------------------------------------------


@pytest.mark.parametrize("path", ["/docs", "/redoc"])
async def test_the_api_reference_loads_from_local_files_only(client: httpx.AsyncClient, path: str) -> None:
    page = await client.get(path)
    assert page.status_code == 200
    _has_the_consoles_headers_and_allows_its_inline_scripts(page)
    sources = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert sources and all(s.startswith("/") for s in sources), sources
    assert "fonts.googleapis" not in page.text
    for source in sources:
        asset = await client.get(source)
        assert asset.status_code == 200 and len(asset.content) > 1000, source


def _has_the_consoles_headers_and_allows_its_inline_scripts(page: httpx.Response) -> None:
    """The console's security headers, with the page's own inline scripts allowed by their hash
    (the real browser test renders the pages under them: tests/e2e/test_console_browser.py)."""
    policy = page.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in policy and "script-src 'self' " in policy
    assert "'unsafe-inline'" not in policy.split("script-src")[1].split(";")[0]
    assert (page.headers["x-frame-options"], page.headers["x-content-type-options"]) == ("DENY", "nosniff")
    for script in re.findall(r"<script>(.*?)</script>", page.text, re.S):
        digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
        assert f"'sha256-{digest}'" in policy


async def test_swagger_uis_sign_in_return_page_has_the_consoles_headers(client: httpx.AsyncClient) -> None:
    page = await client.get("/docs/oauth2-redirect")
    assert page.status_code == 200 and "<script>" in page.text
    _has_the_consoles_headers_and_allows_its_inline_scripts(page)


async def test_the_console_assets_are_served(client: httpx.AsyncClient) -> None:
    page = await client.get("/sign-in", headers=PAGE)
    for source in re.findall(r'(?:src|href)="(/static/[^"]+)"', page.text):
        assert (await client.get(source)).status_code == 200, source
    assert "http" not in " ".join(re.findall(r'(?:src|href)="([^"]+)"', page.text))
    assert token_of(page.text)


async def test_a_deleted_database_says_it_is_deleted_and_what_final_backup_was_kept(
    client: httpx.AsyncClient, app: FastAPI, tenant: Tenant, conn: AsyncConn
) -> None:
    created = await create(client, tenant, "orders")
    token = await signed_in(client, tenant.key)
    base = f"/instances/{created['id']}"
    await make_ready(conn, app_state_settings(app), created["id"])
    asked = await client.post(
        f"{base}/delete",
        data={"csrf_token": token, "confirm_name": "orders", "final_backup": "on"},
        headers=PAGE,
    )
    assert asked.headers["location"] == f"{base}?done=delete"
    under_way = text_of((await client.get(f"{base}?done=delete", headers=PAGE)).text)
    assert "The deletion is under way" in under_way and "A final backup was kept" not in under_way
    row = await drive(conn, created["id"], "deprovision")
    await transition(
        conn,
        "instance",
        uuid.UUID(created["id"]),
        "deprovisioned",
        row["state_version"],
        expected_state="deprovisioning",
        actor=WORKER,
        reason="final backup orders-final.dump",
        detail={"backup": "orders-final.dump", "skip_backup": False, "sre": {"location": "/srv/b/x.dump"}},
    )
    # The page the script reloads once the deletion is over (the redirect's query still there).
    done = text_of((await client.get(f"{base}?done=delete", headers=PAGE)).text)
    assert "The deletion is under way" not in done
    assert "Deleted on" in done and "A final backup was kept: orders-final.dump" in done
    assert "/srv/b" not in done  # where the provisioner keeps it is the SREs' to know
    assert "restore_from" in done and created["id"] in done


async def test_removing_a_failed_database_says_remove_as_its_button_does(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn
) -> None:
    created = await create(client, tenant, "flaky")
    token = await signed_in(client, tenant.key)
    base = f"/instances/{created['id']}"
    await drive(conn, created["id"], "fail")
    page = text_of((await client.get(base, headers=PAGE)).text)
    assert "Remove flaky" in page and "delete" not in page.lower().replace("deletion protection", "")
    removed = await client.post(
        f"{base}/delete", data={"csrf_token": token, "confirm_name": "flaky"}, headers=PAGE
    )
    assert removed.headers["location"] == f"{base}?done=remove"
    after = text_of((await client.get(removed.headers["location"], headers=PAGE)).text)
    assert "Removing it" in after and "deletion" not in after.lower().replace("deletion protection", "")


# ---- the list: groups, filter, order, the live stream ------------------------------------------------


def _rows(page: str) -> list[str]:
    """The names of the list's rows, in the order shown."""
    return re.findall(r'<th scope="row"><a href="/instances/[^"]+">([^<]+)</a>', page)


async def test_an_unresolved_failure_is_shown_and_a_retried_one_is_folded_away_and_marked(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn
) -> None:
    flaky = await create(client, tenant, "flaky")
    lost = await create(client, tenant, "lost")
    await drive(conn, flaky["id"], "fail", failure_code="allocate_storage_failed")
    await drive(conn, lost["id"], "fail", failure_code="allocate_storage_failed")
    retried = await client.post(f"/v1/instances/{flaky['id']}/retry", headers=tenant.headers)
    assert retried.status_code == 202
    await signed_in(client, tenant.key)
    page = (await client.get("/", headers=PAGE)).text
    # The failure nobody acted on is in an open section above the list, not in a folded one.
    failed = page[page.index('id="failed-title"') : page.index("</section>", page.index('id="failed-title"'))]
    assert _rows(failed) == ["lost"]
    ended = page[page.index('<details class="group" id="ended"') :]
    assert (
        _rows(ended) == ["flaky"]
        and f'retried: <a href="/instances/{retried.json()["id"]}">flaky</a>' in ended
    )
    assert "<details" not in page[: page.index('<details class="group" id="ended"')]


async def test_the_list_filters_by_name_and_state_and_sorts(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn
) -> None:
    for name in ("beta", "alpha", "gamma"):
        await create(client, tenant, name)
    gamma = (await client.get("/v1/instances/gamma", headers=tenant.headers)).json()
    await drive(conn, gamma["id"], "start_provisioning")
    await signed_in(client, tenant.key)
    assert _rows((await client.get("/", headers=PAGE)).text) == ["gamma", "alpha", "beta"]  # newest first
    assert _rows((await client.get("/?sort=oldest", headers=PAGE)).text) == ["beta", "alpha", "gamma"]
    assert _rows((await client.get("/?sort=name", headers=PAGE)).text) == ["alpha", "beta", "gamma"]
    assert _rows((await client.get("/?q=AL", headers=PAGE)).text) == ["alpha"]
    pending = (await client.get("/?show=transient&sort=name", headers=PAGE)).text
    assert _rows(pending) == ["alpha", "beta", "gamma"]  # pending and provisioning are both in progress
    none = await client.get("/?q=zeta", headers=PAGE)
    assert _rows(none.text) == [] and "No database matches this filter" in text_of(none.text)
    # The live part alone, with the same query (what the page's script fetches).
    live = await client.get("/live?sort=name&q=a", headers=PAGE)
    assert live.status_code == 200 and "<html" not in live.text
    assert _rows(live.text) == ["alpha", "beta", "gamma"]
    junk = await client.get("/?show=nonsense&sort=sideways", headers=PAGE)
    assert junk.status_code == 200 and _rows(junk.text) == ["gamma", "alpha", "beta"]


async def test_the_organisations_stream_tells_its_own_changes_only(
    app: FastAPI, client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn
) -> None:
    from controlplane.api import watch

    class Gone:
        async def is_disconnected(self) -> bool:
            return True

    other = await make_tenant(conn)
    stream = watch.org_stream(app.state.controlplane, Gone(), tenant.org_id, keepalive_s=0.5)  # type: ignore[arg-type]
    chunks = [await anext(stream), await anext(stream)]  # retry, then `list` (read the list now)
    assert b"event: list" in chunks[1]
    theirs = await create(client, other, "theirs")
    mine = await create(client, tenant, "mine")  # a creation is a change of the list
    await drive(conn, theirs["id"], "start_provisioning")
    await drive(conn, mine["id"], "start_provisioning")
    chunks.extend([chunk async for chunk in stream])  # until the keepalive finds the client gone
    events = [
        (block.split("\n")[0], block)
        for block in b"".join(chunks).decode().split("\n\n")
        if block.startswith("event")
    ]
    moved = [block for name, block in events if name == "event: transition"]
    assert len(moved) == 2 and all(mine["id"] in block for block in moved), events
    assert '"state":"pending"' in moved[0] and '"state":"provisioning"' in moved[1]
    assert app.state.controlplane.watchers.streams == 0  # it follows nothing any more


async def test_plan_cards_use_human_units_and_even_intervals(
    client: httpx.AsyncClient, tenant: Tenant
) -> None:
    await signed_in(client, tenant.key)
    page = text_of((await client.get("/instances/new", headers=PAGE)).text)
    assert "0.25 CPU cores and 256 MiB of memory each" in page and "1 CPU core and 1 GiB" in page
    assert "a backup every day" in page and "a backup every 12 hours" in page and "every 6 hours" in page
    assert "250m" not in page and "Mi " not in page and " d 0 h" not in page


async def test_a_suspended_database_shows_one_banner_that_says_how_to_pay(
    api_settings: Settings, client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn
) -> None:
    from controlplane.api.app import create_app

    created = await create(client, tenant, "ledger")
    await make_ready(conn, api_settings, created["id"])
    await drive(conn, created["id"], "suspend")
    await conn.execute("UPDATE organisations SET billing_hold = true WHERE id = %s", (tenant.org_id,))
    await signed_in(client, tenant.key)
    page = (await client.get(f"/instances/{created['id']}", headers=PAGE)).text
    assert page.count('class="banner suspended"') == 1 and "Pay the outstanding invoice" in text_of(page)
    listing = (await client.get("/", headers=PAGE)).text  # elsewhere the organisation's banner says it
    assert listing.count('class="banner suspended"') == 1 and "payments are on hold" in listing
    portal = "https://billing.example/portal"
    app = create_app(api_settings.replace(billing_portal_url=portal))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://console") as http:
            await signed_in(http, tenant.key)
            linked = (await http.get(f"/instances/{created['id']}", headers=PAGE)).text
    assert f'<a href="{portal}">Settle the payment in the billing portal</a>' in linked


async def test_a_database_held_to_its_storage_allocation_says_why_and_what_ends_it(
    api_settings: Settings, client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn
) -> None:
    created = await create(client, tenant, "ledger")
    await make_ready(conn, api_settings, created["id"])
    await drive(
        conn, created["id"], "suspend", failure_code="storage_full", failure_reason="storage full: 104%"
    )
    await signed_in(client, tenant.key)
    page = text_of((await client.get(f"/instances/{created['id']}", headers=PAGE)).text)
    assert "outgrew its storage allocation" in page and "Move it to a larger plan" in page
    assert "hold has been lifted" not in page and "storage full: 104%" not in page  # the SREs' words


async def test_a_databases_page_charts_its_metrics_with_the_numbers_as_text(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn, api_settings: Settings
) -> None:
    made = await create(client, tenant, "orders")
    await make_ready(conn, api_settings, made["id"])
    await signed_in(client, tenant.key)
    page = await client.get(f"/instances/{made['id']}", headers=PAGE)
    assert "no samples yet" in text_of(page.text) and "<svg" not in page.text
    # Three samples of the last minute, as the reconciler's observation writes them (counters grow).
    samples = ((40, 2, 100, 1, 2**23), (30, 5, 160, 2, 2**24), (20, 3, 190, 3, 2**24))
    for ago, connections, transactions, k, size in samples:
        await conn.execute(
            "INSERT INTO instance_metrics (instance_id, resolution_s, at, connections, max_connections,"
            " transactions, rows_read, rows_written, blocks_hit, blocks_read, size_bytes, allocated_bytes)"
            " VALUES (%s, 10, date_bin('10 seconds', now() - make_interval(secs => %s), 'epoch'), %s, 20,"
            " %s, %s, %s, %s, %s, %s, 1073741824)",
            (made["id"], ago, connections, transactions, 1000 * k, 10 * k, 90 * k, 10 * k, size),
        )
    page = await client.get(f"/instances/{made['id']}", headers=PAGE)
    assert page.status_code == 200
    charts = re.findall(r'<figure class="chart" data-chart="(\w+)">', page.text)
    assert charts == ["connections", "transactions", "reads", "writes", "cache", "size"]
    # Each drawn chart is an image with a title and a description saying its range, for screen readers.
    assert page.text.count('role="img"') == 6
    assert re.search(r"<desc [^>]*>From 2\.0 to 5\.0; the plan allows 20\.0; now 3\.0\.</desc>", page.text)
    text = text_of(page.text)
    assert "Database size 16.0 MiB" in text and "Transactions per second 3.0/s" in text
    # The numbers are there as text: a table row per point (rates from the second point on).
    assert re.search(r"<td>\d\d:\d\d:\d\d</td><td>16\.0 MiB</td>", page.text)
