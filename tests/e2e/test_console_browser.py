"""The console in a real browser (Debian's Chromium, driven by Playwright) against the control plane
running as its separate roles over a real database, with the local provisioner (real PostgreSQL
servers) and, for failures, the fault-injecting one."""

from __future__ import annotations

import asyncio
import subprocess
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from controlplane.db import connection as db
from controlplane.services import tenants
from tests.api_support import sign, stripe_event
from tests.browser_support import (
    CHROMIUM,
    CLI,
    WEBHOOK_SECRET,
    Stack,
    chromium_args,
    screenshot,
    stack_on_a_copy,
)
from tests.support import ROOT

if not CHROMIUM.exists():  # dev.py test installs it (as root); say so rather than skip quietly
    pytest.fail(f"{CHROMIUM} is missing: `python3 dev.py test` installs it as root", pytrace=False)

from playwright.sync_api import Browser, Page, expect, sync_playwright

pytestmark = [pytest.mark.browser, pytest.mark.timeout(240)]

# How long a page may take to show what a step leads to (provisioning a real server included).
WAIT_MS = 60_000
expect.set_options(timeout=15_000)


@pytest.fixture(scope="module")
def stack(
    test_server: Any, template_url: str, pg_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("console-logs")
    with stack_on_a_copy(test_server, template_url, pg_root, logs, "cp_console") as (running, _url):
        yield running


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=chromium_args()
        )
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(
        permissions=["clipboard-read", "clipboard-write"],
        accept_downloads=True,
        viewport={"width": 1200, "height": 900},
    )
    context.set_default_timeout(WAIT_MS)
    try:
        yield context.new_page()
    finally:
        context.close()


def _org(stack: Stack, name: str) -> tuple[uuid.UUID, str, str]:
    """A new organisation (as `controlplane orgs create` makes one): its id, key and Stripe customer."""
    customer = f"cus_{uuid.uuid4().hex[:12]}"

    async def make() -> tuple[uuid.UUID, str]:
        conn = await db.connect(stack.env["CONTROLPLANE_DATABASE_URL"])
        async with conn:
            org, key = await tenants.create_org(conn, f"{name}-{uuid.uuid4().hex[:6]}", customer)
        return org["id"], key.plaintext

    # Playwright's sync API runs an event loop in this thread: the database call runs in another.
    with ThreadPoolExecutor(1) as thread:
        org_id, key = thread.submit(asyncio.run, make()).result()
    return org_id, key, customer


def _sign_in(page: Page, stack: Stack, key: str) -> None:
    page.goto(f"{stack.url}/")
    expect(page).to_have_url(f"{stack.url}/sign-in")
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("heading", name="Databases", exact=True)).to_be_visible()


def _create(page: Page, name: str, plan: str = "dev") -> float:
    """Create a database through the form; the moment Create was clicked."""
    page.get_by_role("link", name="Create database").first.click()
    page.get_by_label("Name", exact=True).fill(name)
    page.get_by_role("radio", name=plan).check()
    clicked = time.monotonic()
    page.get_by_role("button", name="Create database").click()
    expect(page.get_by_role("heading", name=name, level=1)).to_be_visible()
    return clicked


def _watch_states(page: Page) -> None:
    """Record every state the live part shows, and mark the document: a reload would lose the mark."""
    page.evaluate(
        """() => {
          window.__seen = [document.querySelector('.live-body').dataset.state];
          window.__notReloaded = true;
          new MutationObserver(() => {
            const body = document.querySelector('.live-body');
            const last = window.__seen[window.__seen.length - 1];
            if (body && last !== body.dataset.state) window.__seen.push(body.dataset.state);
          }).observe(document.getElementById('live'), {childList: true, subtree: true});
        }"""
    )


def _wider_than_the_screen(page: Page) -> list[str]:
    """The elements that stick out past the right edge of the window (none: no sideways scrolling)."""
    wider: list[str] = page.evaluate(
        """() => [...document.querySelectorAll('body *')]
            .filter(e => e.getBoundingClientRect().right > window.innerWidth + 1)
            .filter(e => !e.closest('.table-wrap, pre'))
            .map(e => e.tagName + '.' + e.className)"""
    )
    return wider


def _psql_ssl(uri: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """psql run in `cwd` with `uri` as pasted: whether its session is TLS (`t`)."""
    query = "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()"
    return subprocess.run(
        ["psql", uri, "-X", "-A", "-t", "-c", query], cwd=cwd, capture_output=True, text=True, check=False
    )


def _deliver(stack: Stack, customer: str, status: str) -> None:
    payload = stripe_event(f"evt_{uuid.uuid4().hex[:10]}", customer, status, int(time.time()))
    headers = {"Content-Type": "application/json", "Stripe-Signature": sign(payload, WEBHOOK_SECRET)}
    response = httpx.post(f"{stack.url}/v1/webhooks/stripe", content=payload, headers=headers, timeout=10)
    assert response.status_code == 200, response.text


def test_sign_in_refuses_a_wrong_key_and_works_by_keyboard(page: Page, stack: Stack) -> None:
    _, key, _ = _org(stack, "keyboard")
    page.goto(f"{stack.url}/")
    screenshot(page, "01-sign-in")
    page.get_by_label("API key").fill("cpk_000000000000_not-a-key")
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("alert")).to_have_text("That key is not valid, or it has been revoked.")
    screenshot(page, "02-sign-in-refused")
    # Keyboard only: the skip link comes first and shows where focus is; the key and Enter sign in.
    page.keyboard.press("Tab")
    skip = page.get_by_role("link", name="Skip to content")
    expect(skip).to_be_focused()
    assert page.evaluate("getComputedStyle(document.activeElement).outlineStyle") != "none"
    page.get_by_label("API key").focus()
    page.keyboard.type(key)
    page.keyboard.press("Enter")
    expect(page.get_by_role("heading", name="Databases", exact=True)).to_be_visible()
    expect(page.get_by_text("No databases yet")).to_be_visible()
    screenshot(page, "03-databases-empty")
    # Signing out ends the session: the list asks to sign in again.
    page.get_by_role("button", name="Sign out").click()
    expect(page.get_by_text("You are signed out.")).to_be_visible()
    page.goto(f"{stack.url}/")
    expect(page).to_have_url(f"{stack.url}/sign-in")


@pytest.mark.parametrize("path", ["/docs", "/redoc"])
def test_the_api_reference_renders_under_its_security_headers(page: Page, stack: Stack, path: str) -> None:
    """Swagger UI and ReDoc, from the pinned local assets, render the document under the policy the
    page is sent with: nothing it needs is refused (a refusal is a securitypolicyviolation event),
    and nothing is fetched from another origin."""
    page.add_init_script(
        """document.addEventListener('securitypolicyviolation', e =>
             (window.__refused = window.__refused || []).push(e.violatedDirective + ' ' + e.blockedURI))"""
    )
    fetched: list[str] = []
    page.on("response", lambda answer: fetched.append(answer.url))
    response = page.goto(f"{stack.url}{path}")
    assert response is not None and response.ok
    headers = response.headers
    assert "frame-ancestors 'none'" in headers["content-security-policy"]
    assert (headers["x-frame-options"], headers["x-content-type-options"]) == ("DENY", "nosniff")
    expect(page.get_by_text("Managed PostgreSQL control plane").first).to_be_visible()
    summary = "Create an instance (provisioned in the background)"
    expect(page.locator(f"text={summary} >> visible=true").first).to_be_visible()
    screenshot(page, f"20-api-reference{path.replace('/', '-')}")
    # Only what would come from elsewhere is refused: ReDoc's "powered by" logo, from its CDN.
    refused = page.evaluate("window.__refused || []")
    assert all(r.startswith("img-src https://cdn.redoc.ly/") for r in refused), refused
    assert fetched and all(url.startswith((stack.url, "data:", f"blob:{stack.url}")) for url in fetched), (
        fetched
    )


def test_create_follows_the_steps_live_to_ready_and_the_copied_uri_connects(
    page: Page, stack: Stack, tmp_path: Path
) -> None:
    _, key, _ = _org(stack, "live")
    _sign_in(page, stack, key)
    page.get_by_role("link", name="Create database").first.click()
    page.get_by_label("Name", exact=True).fill("Not_Valid")
    page.get_by_role("button", name="Create database").click()
    expect(page.locator("#name-error")).to_contain_text("lower-case letters")
    expect(page.get_by_label("Name")).to_have_attribute("aria-invalid", "true")
    screenshot(page, "04-create-refused-name")
    page.goto(f"{stack.url}/")
    clicked = _create(page, "orders")
    _watch_states(page)
    expect(page.locator(".progress .step").first).to_be_visible()
    screenshot(page, "05-progress")
    uri_box = page.locator('[data-format="uri"]')
    expect(uri_box).to_be_visible(timeout=WAIT_MS)
    elapsed = time.monotonic() - clicked
    print(f"\ncreate -> connection string shown: {elapsed:.2f} s")
    seen = page.evaluate("window.__seen")
    assert page.evaluate("window.__notReloaded") is True  # followed live, never reloaded
    assert seen[-1] == "ready" and len(seen) >= 2, seen
    expect(page.locator(".badge")).to_have_attribute("data-state", "ready")
    assert "\u2022" in uri_box.inner_text()  # masked until revealed
    screenshot(page, "06-ready-connection")
    page.get_by_role("button", name="Reveal password").click()
    expect(page.get_by_role("button", name="Hide password")).to_have_attribute("aria-pressed", "true")
    expect(uri_box).not_to_contain_text("\u2022")
    screenshot(page, "07-ready-revealed")
    page.locator('[data-copy="uri"]').click()
    expect(page.locator('[data-copy="uri"]')).to_have_text("Copied")
    copied = page.evaluate("navigator.clipboard.readText()")
    assert copied == uri_box.inner_text() and copied.startswith("postgresql://")
    # The URI as copied, pasted into psql: before the one step the panel shows above it, the error
    # names the file to save; after it (the download, into the directory psql runs in), it connects.
    assert copied.endswith("sslmode=verify-full&sslrootcert=controlplane-ca.pem")
    before = _psql_ssl(copied, tmp_path)
    assert before.returncode != 0 and "controlplane-ca.pem" in before.stderr, before.stderr
    with page.expect_download() as download:
        page.get_by_role("link", name="Download the CA certificate").click()
    ca = tmp_path / download.value.suggested_filename
    download.value.save_as(ca)
    assert ca.name == "controlplane-ca.pem" and ca.read_text().startswith("-----BEGIN CERTIFICATE-----")
    after = _psql_ssl(copied, tmp_path)
    assert after.returncode == 0 and after.stdout.strip() == "t", after.stderr
    # Readable at phone width: nothing wider than the screen.
    page.set_viewport_size({"width": 390, "height": 844})
    assert _wider_than_the_screen(page) == []
    screenshot(page, "08-ready-phone")


def test_a_failed_creation_says_why_and_its_retry_reaches_ready(page: Page, stack: Stack) -> None:
    _, key, _ = _org(stack, "retry")
    stack.stop_worker()
    stack.start_worker(faults="allocate_storage:fail_permanent:*")
    try:
        _sign_in(page, stack, key)
        _create(page, "flaky")
        failure = page.get_by_role("region", name="What went wrong")
        expect(failure).to_be_visible(timeout=WAIT_MS)
        expect(page.locator(".badge")).to_have_attribute("data-state", "failed")
        expect(failure).to_contain_text("Retrying can help")
        screenshot(page, "09-failed")
    finally:
        stack.stop_worker()
        stack.start_worker()
    failed_url = page.url
    page.get_by_role("button", name="Retry").click()
    expect(page).not_to_have_url(failed_url)
    expect(page.get_by_text("A new database replaces the failed one")).to_be_visible()
    expect(page.locator('[data-format="uri"]')).to_be_visible(timeout=WAIT_MS)
    screenshot(page, "10-retried-ready")
    page.goto(failed_url)
    expect(page.get_by_role("link", name="follow the new database")).to_be_visible()
    # In the list the retried failure is folded away and marked, not shown as one to act on.
    page.get_by_role("link", name="Databases").first.click()
    expect(page.get_by_role("heading", name="Failed")).to_have_count(0)
    listed = page.get_by_role("region", name="Your databases")
    expect(listed.get_by_role("link", name="flaky")).to_be_visible()
    page.locator("#ended summary").click()
    expect(page.locator("#ended")).to_contain_text("retried: flaky")
    screenshot(page, "10b-list-after-retry")


def test_suspension_shows_live_resume_clears_it_and_delete_needs_the_name(page: Page, stack: Stack) -> None:
    _, key, customer = _org(stack, "billing")
    _sign_in(page, stack, key)
    _create(page, "ledger")
    expect(page.locator('[data-format="uri"]')).to_be_visible(timeout=WAIT_MS)
    _watch_states(page)
    # The API goes away and comes back: the page's stream reconnects by itself (no reload).
    status = page.locator("[data-live-status]")
    before = int(status.get_attribute("data-connections") or "0")
    stack.restart_api()
    expect(status).to_have_attribute("data-connections", str(before + 1), timeout=WAIT_MS)
    _deliver(stack, customer, "unpaid")
    banner = page.get_by_role("region", name="Suspended")
    expect(banner).to_be_visible(timeout=WAIT_MS)
    expect(banner).to_contain_text("Your data is intact")
    expect(banner).to_contain_text("writes are refused")
    screenshot(page, "11-suspended")
    _deliver(stack, customer, "active")
    expect(banner).to_be_hidden(timeout=WAIT_MS)
    expect(page.locator(".badge")).to_have_attribute("data-state", "ready")
    assert page.evaluate("window.__notReloaded") is True
    assert page.evaluate("window.__seen")[-2:] == ["suspended", "ready"]
    page.get_by_role("link", name="History").click()
    suspended = page.get_by_role("row").filter(has_text="Available → Suspended")
    expect(suspended).to_contain_text("billing hold")
    expect(page.get_by_role("row").filter(has_text="Suspended → Available")).to_have_count(1)
    screenshot(page, "12-history")
    page.go_back()
    delete = page.get_by_role("button", name="Delete ledger")
    expect(delete).to_be_disabled()
    page.get_by_label("Type ledger to confirm").fill("ledge")
    expect(delete).to_be_disabled()
    page.get_by_label("Type ledger to confirm").fill("ledger")
    page.get_by_label("Take a final backup first").uncheck()
    screenshot(page, "13-delete-confirm")
    delete.click()
    expect(page.locator(".badge")).to_have_attribute("data-state", "deleted", timeout=WAIT_MS)
    page.get_by_role("link", name="Databases").first.click()
    live = page.get_by_role("region", name="Your databases")
    expect(live).to_have_count(0)
    expect(page.get_by_text("No databases yet")).to_be_visible()
    screenshot(page, "14-after-delete")


def test_another_organisation_sees_nothing_and_a_post_without_the_token_is_refused(
    page: Page, stack: Stack
) -> None:
    _, key, _ = _org(stack, "owner")
    _sign_in(page, stack, key)
    _create(page, "secret-db")
    mine = page.url
    page.get_by_role("button", name="Sign out").click()
    _, other_key, _ = _org(stack, "intruder")
    _sign_in(page, stack, other_key)
    expect(page.get_by_text("secret-db")).to_have_count(0)
    response = page.goto(mine)
    assert response is not None and response.status == 404
    expect(page.get_by_role("heading", name="Not found")).to_be_visible()
    screenshot(page, "15-other-organisation")
    # The session's cookie goes with the request, its form token does not: refused.
    forged = page.request.post(f"{mine}/delete", form={"confirm_name": "secret-db"})
    assert forged.status == 403
    refused = page.request.post(f"{stack.url}/instances", form={"name": "sneaky", "plan": "dev"})
    assert refused.status == 403


def test_api_keys_are_shown_once_and_revoked(page: Page, stack: Stack) -> None:
    _, key, _ = _org(stack, "keys")
    _sign_in(page, stack, key)
    page.get_by_role("link", name="API keys").click()
    page.get_by_label("Name", exact=True).fill("ci deploys")
    page.get_by_role("button", name="Create key").click()
    shown = page.locator("#new-key-value")
    expect(shown).to_contain_text("cpk_")
    new_key = shown.inner_text()
    screenshot(page, "16-keys-new")
    page.reload()  # posts the form again: no second key, and this one is not shown again
    expect(page.get_by_text("shown only once")).to_be_visible()
    expect(page.get_by_text(new_key)).to_have_count(0)
    expect(page.get_by_role("button", name="Revoke the key ci deploys")).to_have_count(1)
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Revoke the key ci deploys").click()
    expect(page.get_by_text("The key is revoked")).to_be_visible()
    screenshot(page, "17-keys-revoked")
    listed = httpx.get(
        f"{stack.url}/v1/instances", headers={"Authorization": f"Bearer {new_key}"}, timeout=10
    )
    assert listed.status_code == 401


def _cli(stack: Stack, key: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The `controlplane` command against the stack's API, as a customer runs it."""
    env = {**stack.env, "CONTROLPLANE_URL": stack.url, "CONTROLPLANE_API_KEY": key}
    return subprocess.run(
        [*CLI, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_the_list_follows_the_organisation_live_filters_sorts_and_fits_a_phone(
    page: Page, stack: Stack
) -> None:
    _, key, _ = _org(stack, "list")
    page.set_viewport_size({"width": 1280, "height": 900})
    _sign_in(page, stack, key)
    status = page.locator("[data-live-status]")
    expect(status).to_have_attribute("data-connections", "1")  # the organisation's stream is open
    page.evaluate("window.__notReloaded = true")
    # Made elsewhere (the CLI): the list shows it, and follows it to ready, without a reload.
    made = _cli(stack, key, "instances", "create", "from-the-cli", "--plan", "dev")
    assert made.returncode == 0, made.stderr
    rows = page.get_by_role("region", name="Your databases")
    row = rows.get_by_role("row").filter(has_text="from-the-cli")
    expect(row).to_be_visible(timeout=WAIT_MS)
    expect(row.locator(".badge")).to_have_attribute("data-state", "ready", timeout=WAIT_MS)
    assert _cli(stack, key, "instances", "create", "another-one", "--plan", "dev").returncode == 0
    expect(rows.get_by_role("row").filter(has_text="another-one")).to_be_visible(timeout=WAIT_MS)
    assert page.evaluate("window.__notReloaded") is True
    names = rows.locator("tbody th")
    expect(names).to_have_text(["another-one", "from-the-cli"])  # newest first
    screenshot(page, "18-list-live")
    # Sort and filter: the list is queried again, the address keeps the choice.
    page.get_by_label("Sort", exact=True).select_option("name")
    expect(names).to_have_text(["another-one", "from-the-cli"])
    page.get_by_label("Sort", exact=True).select_option("oldest")
    expect(names).to_have_text(["from-the-cli", "another-one"])
    page.get_by_label("Name", exact=True).fill("cli")
    expect(names).to_have_text(["from-the-cli"])
    assert "q=cli" in page.url and "sort=oldest" in page.url
    page.get_by_label("Name", exact=True).fill("nothing-like-it")
    expect(page.get_by_text("No database matches this filter")).to_be_visible()
    page.get_by_label("Name", exact=True).fill("")
    expect(names).to_have_count(2)
    # At phone width every row fits: nothing sticks out, no table scrolls sideways.
    page.set_viewport_size({"width": 390, "height": 844})
    assert _wider_than_the_screen(page) == []
    cut: list[str] = page.evaluate(
        """() => [...document.querySelectorAll('#list .table-wrap')]
            .filter(w => w.scrollWidth > w.clientWidth + 1).map(w => w.getAttribute('aria-label'))"""
    )
    assert cut == []
    expect(row.get_by_role("cell", name="Plan dev")).to_be_visible()  # each cell labelled in its card
    screenshot(page, "19-list-phone")
    page.get_by_role("link", name="Create database").first.click()
    screenshot(page, "20-create-phone")
    page.set_viewport_size({"width": 1280, "height": 900})
    screenshot(page, "21-create-plans")


def test_a_databases_page_charts_its_metrics_at_desk_and_phone_width(page: Page, stack: Stack) -> None:
    """The reconciler samples a ready database; its page charts the samples, each chart an image
    with its numbers as text, readable at 1280 and at 390 px."""
    _, key, _ = _org(stack, "charts")
    made = _cli(stack, key, "instances", "create", "charted", "--plan", "dev", "--wait", "-o", "json")
    assert made.returncode == 0, made.stderr
    page.set_viewport_size({"width": 1280, "height": 900})
    _sign_in(page, stack, key)
    page.get_by_role("link", name="charted").first.click()
    connections = page.locator('[data-chart="connections"] svg[role="img"]')

    def drawn() -> bool:  # two samples, 10 s apart, are a line: the page shows the newest on a reload
        page.reload()
        return connections.count() == 1

    deadline = time.monotonic() + WAIT_MS / 1000
    while not drawn():
        assert time.monotonic() < deadline, "no chart within the wait"
        page.wait_for_timeout(1000)
    expect(page.get_by_role("heading", name="The last hour")).to_be_visible()
    expect(page.get_by_role("img", name="Connections, the last hour")).to_be_visible()
    screenshot(page, "22-charts")
    page.locator('[data-chart="size"] summary').click()
    expect(page.locator('[data-chart="size"] table')).to_contain_text("MiB")
    page.set_viewport_size({"width": 390, "height": 844})
    assert _wider_than_the_screen(page) == []
    screenshot(page, "23-charts-phone")
