"""Webhook signatures and the notification rules (pure): sign and verify, the addresses an endpoint
may not use, which events customers hear of."""

from __future__ import annotations

import binascii
import socket
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
import standardwebhooks

from controlplane.core import webhook_signatures as signatures
from controlplane.core.refusals import InvalidRequest
from controlplane.queue.consumers import LogEvent
from controlplane.runtime.settings import NotificationSettings
from controlplane.services.notices import (
    DEADLINE_CODES,
    address_allowed,
    body_of,
    check_url,
    notice_types,
)

SECRET = "whsec_test"
BODY = b'{"id":"evt_1","type":"instance.ready"}'


def test_a_signature_verifies_with_its_secret_and_body_only() -> None:
    header = signatures.sign(SECRET, 1_800_000_000, BODY)
    assert header.startswith("t=1800000000,v1=")
    assert signatures.verify(SECRET, header, BODY, now=1_800_000_010) == 1_800_000_000
    for secret, body in (("whsec_other", BODY), (SECRET, BODY + b" ")):
        with pytest.raises(signatures.SignatureError, match="no signature matches"):
            signatures.verify(secret, header, body, now=1_800_000_010)


def test_a_standard_webhooks_library_verifies_new_and_earlier_secrets() -> None:
    """The receiver's own Standard Webhooks library checks the id, the timestamp and the body."""
    now = int(time.time())
    # A new secret, and two made as secrets were before (`token_urlsafe`): one its library decodes.
    for secret in (signatures.new_secret(), SECRET, "whsec_kF3-x_Q9Zr2mT8vLpW4yN6bH1cJ5dG7sA0eU_iO-qXk"):
        headers = signatures.signed_headers(secret, "evt_1", now, BODY)
        assert signatures.verify(secret, headers[signatures.SIGNATURE_HEADER], BODY, now=now) == now
        receiver = standardwebhooks.Webhook(secret)
        assert receiver.verify(BODY, headers) == {"id": "evt_1", "type": "instance.ready"}
        changes = (
            {signatures.STANDARD_ID_HEADER: "evt_2"},
            {signatures.STANDARD_TIMESTAMP_HEADER: str(now - 1)},
        )
        for changed in changes:
            with pytest.raises(standardwebhooks.WebhookVerificationError):
                receiver.verify(BODY, headers | changed)
        with pytest.raises(standardwebhooks.WebhookVerificationError):
            receiver.verify(BODY + b" ", headers)


def test_an_earlier_secret_its_library_cannot_decode_still_signs_the_other_scheme() -> None:
    undecodable = "whsec_a"  # one character more than a multiple of four: no base64
    with pytest.raises(binascii.Error):
        standardwebhooks.Webhook(undecodable)
    headers = signatures.signed_headers(undecodable, "evt_1", 1_800_000_000, BODY)
    assert signatures.verify(undecodable, headers[signatures.SIGNATURE_HEADER], BODY, now=1_800_000_000)


def test_an_old_or_malformed_signature_is_refused() -> None:
    header = signatures.sign(SECRET, 1_800_000_000, BODY)
    with pytest.raises(signatures.SignatureError, match="away from now"):
        signatures.verify(SECRET, header, BODY, now=1_800_000_301)
    for bad in (None, "", "v1=abc", "t=1800000000", "t=x,v1=abc"):
        with pytest.raises(signatures.SignatureError):
            signatures.verify(SECRET, bad, BODY, now=1_800_000_000)
    # A rotated secret's receiver accepts either of two v1 values.
    both = f"{header},v1={'0' * 64}"
    assert signatures.verify(SECRET, both, BODY, now=1_800_000_000) == 1_800_000_000


@pytest.mark.parametrize(
    ("address", "allowed"),
    [
        ("93.184.216.34", True),
        ("2606:2800:220:1:248:1893:25c8:1946", True),
        ("127.0.0.1", False),
        ("10.0.0.5", False),
        ("172.16.3.4", False),
        ("192.168.1.1", False),
        ("169.254.169.254", False),
        ("0.0.0.0", False),
        ("::1", False),
        ("fe80::1", False),
        ("fd00::1", False),
        ("::ffff:10.0.0.1", False),
        ("224.0.0.1", False),
        # Not globally reachable: shared address space (carrier NAT, a cloud's metadata at
        # 100.100.100.200), IETF protocol assignments, benchmarking.
        ("100.64.0.1", False),
        ("100.100.100.200", False),
        ("192.0.0.8", False),
        ("198.18.0.1", False),
        ("fec0::1", False),
        # 6to4, Teredo and NAT64 addresses carrying to internal IPv4 ones.
        ("2002:7f00:1::1", False),  # 127.0.0.1
        ("2002:a00:1::1", False),  # 10.0.0.1
        ("2002:a9fe:a9fe::1", False),  # 169.254.169.254
        ("2001:0:4136:e378:8000:63bf:f5ff:fffe", False),  # Teredo, client 10.0.0.1
        ("64:ff9b::a9fe:a9fe", False),  # NAT64 169.254.169.254
        ("::ffff:100.100.100.200", False),
    ],
)
def test_endpoint_addresses(address: str, allowed: bool) -> None:
    assert address_allowed(address) is allowed


STRICT = NotificationSettings()


def _resolving(monkeypatch: pytest.MonkeyPatch, *addresses: str) -> None:
    """socket.getaddrinfo answers `addresses` (none: the name does not resolve)."""

    def getaddrinfo(host: str, port: int, *args: object, **kwargs: object) -> list[tuple[Any, ...]]:
        if not addresses:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in addresses]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def _refusal(url: str) -> str:
    with pytest.raises(InvalidRequest) as refused:
        check_url(url, STRICT)
    return str(refused.value)


def test_a_name_that_does_not_resolve_is_refused_as_one_that_resolves_internally(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The two answers are the same: registering endpoints tells nothing of the internal names."""
    _resolving(monkeypatch)
    unknown = _refusal("https://db.internal.example/hook")
    _resolving(monkeypatch, "10.0.0.7")
    internal = _refusal("https://db.internal.example/hook")
    _resolving(monkeypatch, "93.184.216.34", "10.0.0.7")
    partly = _refusal("https://db.internal.example/hook")
    assert unknown == internal == partly
    _resolving(monkeypatch, "93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946")
    assert check_url("https://hooks.example.com/x", STRICT) == [
        "93.184.216.34",
        "2606:2800:220:1:248:1893:25c8:1946",
    ]


def _event(from_state: str | None, to_state: str, **detail: object) -> LogEvent:
    return LogEvent(
        1,
        1,
        uuid.uuid4(),
        uuid.uuid4(),
        from_state,
        to_state,
        "e",
        "worker",
        "w",
        None,
        detail,
        datetime(2026, 5, 1, tzinfo=UTC),
        1,
        1,
    )


def test_which_events_customers_hear_of() -> None:
    assert notice_types(_event("provisioning", "ready"), DEADLINE_CODES) == ["instance.ready"]
    assert notice_types(_event("degraded", "ready"), DEADLINE_CODES) == ["instance.recovered"]
    failover = {"promoted": "member1", "fenced": "member0", "lsn": "0/3000060", "writes_refused_s": 4.2}
    recovered = _event("degraded", "ready", failover=failover)
    assert notice_types(recovered, DEADLINE_CODES) == ["instance.recovered", "instance.failover"]
    told = body_of(recovered, "instance.failover", {"name": "orders", "plan": "small"})["data"]
    assert told["failover"] == failover
    plain = body_of(recovered, "instance.recovered", {"name": "orders", "plan": "small"})["data"]
    assert plain["failover"] is None
    assert notice_types(_event("suspended", "ready"), DEADLINE_CODES) == ["instance.resumed"]
    assert notice_types(_event("updating", "ready"), DEADLINE_CODES) == []
    assert notice_types(_event("pending", "provisioning"), DEADLINE_CODES) == []
    assert notice_types(_event("ready", "suspended"), DEADLINE_CODES) == ["instance.suspended"]
    assert notice_types(_event("deprovisioning", "deleted"), DEADLINE_CODES) == ["instance.deleted"]
    assert notice_types(
        _event("provisioning", "failed", code="storage_allocation_failed"), DEADLINE_CODES
    ) == ["instance.failed"]
    overdue = notice_types(_event("provisioning", "failed", code="init_timeout"), DEADLINE_CODES)
    assert overdue == ["instance.failed", "instance.deadline_overdue"]


def test_a_suspension_says_why_when_it_has_a_code() -> None:
    instance = {"name": "orders", "plan": "dev"}
    full = body_of(_event("ready", "suspended", code="storage_full"), "instance.suspended", instance)
    assert (
        full["data"]["failure"]["code"] == "storage_full" and "larger plan" in full["data"]["failure"]["hint"]
    )
    held = body_of(_event("ready", "suspended"), "instance.suspended", instance)
    assert held["data"]["failure"] is None  # a billing hold: billing.past_due said why
    restored = body_of(_event("degraded", "ready", code="data_lost"), "instance.recovered", instance)
    assert restored["data"]["failure"] is None
