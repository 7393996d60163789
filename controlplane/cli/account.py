"""Customer commands about the organisation: `controlplane usage`, `billing` and `webhooks ...`,
talking to the REST API with an API key."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime, timedelta
from typing import Any

from controlplane.cli.common import (
    CommandError,
    Listing,
    add_list_flags,
    add_output_flag,
    api_client,
    cell_text,
    output_format,
    print_data,
    print_fields,
    print_items,
    print_table,
)
from controlplane.cli.customer_parser import _action, api_flags


def register(commands: Any) -> None:
    usage = commands.add_parser(
        "usage",
        help="the organisation's usage: time and allocated storage (GB-hours) per database, plan and class",
    )
    api_flags(usage)
    add_output_flag(usage)
    usage.add_argument("--from", dest="start", help="start (RFC 3339; default: the start of this month, UTC)")
    usage.add_argument("--to", dest="end", help="end (RFC 3339; default: now)")
    usage.set_defaults(handler=cmd_usage)

    billing = commands.add_parser(
        "billing", help="the organisation's billing state: hold, grace period, policy"
    )
    api_flags(billing)
    add_output_flag(billing)
    billing.set_defaults(handler=cmd_billing)

    webhooks = commands.add_parser(
        "webhooks", help="webhook endpoints that the databases' events are sent to"
    )
    actions = webhooks.add_subparsers(dest="webhooks_command", metavar="ACTION", required=True)
    create = _action(
        actions,
        "create",
        "register an endpoint (its signing secret is printed once)",
        cmd_webhook_create,
        "controlplane webhooks create https://example.com/hooks --events instance.ready,instance.failed",
    )
    # Not `url`: that is --url's destination, where the API is (api_flags).
    create.add_argument("endpoint_url", metavar="URL", help="where the events are POSTed (https)")
    create.add_argument("--events", required=True, help="comma-separated event types, or '*'")
    create.add_argument("--description", default="", help="a note to recognise it by")
    add_list_flags(
        _action(actions, "list", "list the endpoints", cmd_webhook_list, "controlplane webhooks list")
    )
    delete = _action(
        actions,
        "delete",
        "remove an endpoint",
        cmd_webhook_delete,
        "controlplane webhooks delete 5b1e0c52-8d4f-4c7e-9a51-0d2f6b3f9e10",
    )
    delete.add_argument("id", metavar="ENDPOINT_ID", help="the endpoint's id (`webhooks list`)")
    deliveries = _action(
        actions,
        "deliveries",
        "an endpoint's delivery log, newest first",
        cmd_webhook_deliveries,
        "controlplane webhooks deliveries 5b1e0c52-8d4f-4c7e-9a51-0d2f6b3f9e10",
    )
    deliveries.add_argument("id", metavar="ENDPOINT_ID", help="the endpoint's id (`webhooks list`)")
    add_list_flags(deliveries, limit_default=100)


def _time(value: str, name: str) -> str:
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise CommandError(
            f"--{name} must be an RFC 3339 time (e.g. 2026-05-01T00:00:00Z), not {value!r}"
        ) from None
    if moment.tzinfo is None:
        raise CommandError(f"--{name} must carry a time zone (e.g. 2026-05-01T00:00:00Z), not {value!r}")
    return moment.isoformat()


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h ({seconds:.0f} s)"


def _gb_hours(gb_seconds: float) -> str:
    return f"{gb_seconds / 3600:.2f} GB-h"


def cmd_usage(args: argparse.Namespace) -> int:
    now = datetime.now(UTC)
    start = (
        _time(args.start, "from")
        if args.start
        else now.replace(day=1, hour=0, minute=0, second=0, microsecond=0).isoformat()
    )
    end = _time(args.end, "to") if args.end else (now + timedelta(seconds=1)).isoformat()
    api = api_client(args)
    report = api.request("GET", "/v1/usage", params={"from": start, "to": end})
    fmt = output_format(args)
    if fmt != "table":
        print_data(report, fmt)
        return 0
    # The databases by name: those of the window, deleted and archived ones too.
    everything = api.all_items("/v1/instances", {"limit": 100, "include": "archived"})
    names = {i["id"]: i["name"] for i in everything}
    window = f"{cell_text(report['from'])} to {cell_text(report['to'])}"
    print(f"usage from {window} (as of {cell_text(report['as_of'])})")
    rows = [
        [
            names.get(i["instance_id"], i["instance_id"]),
            i["plan"],
            i["billing"],
            _hours(i["seconds"]),
            _gb_hours(i["storage_gb_seconds"]),
        ]
        for i in report["items"]
    ]
    print_table(rows, ("instance", "plan", "billing", "time", "storage"))
    print()
    print_table(
        [
            [t["plan"], t["billing"], _hours(t["seconds"]), _gb_hours(t["storage_gb_seconds"])]
            for t in report["totals"]
        ],
        ("plan", "billing", "total", "storage"),
    )
    return 0


def cmd_billing(args: argparse.Namespace) -> int:
    state = api_client(args).request("GET", "/v1/billing")
    fmt = output_format(args)
    if fmt != "table":
        print_data(state, fmt)
        return 0
    print_fields(list(state.items()))
    if state.get("suspends_at"):
        print(f"the subscription is past due: the databases become read-only at {state['suspends_at']}")
    return 0


def cmd_webhook_create(args: argparse.Namespace) -> int:
    events = [e.strip() for e in args.events.split(",") if e.strip()]
    endpoint = api_client(args).request(
        "POST",
        "/v1/webhook-endpoints",
        json={"url": args.endpoint_url, "event_types": events, "description": args.description},
    )
    fmt = output_format(args)
    if fmt != "table":
        print_data(endpoint, fmt)
        return 0
    print(f"endpoint {endpoint['id']} registered for {', '.join(endpoint['event_types'])}")
    print(f"signing secret (shown once): {endpoint['secret']}")
    return 0


WEBHOOKS = Listing(
    ("id", "url", "events", "enabled"),
    lambda e: {
        "events": e["event_types"],
        "enabled": "yes" if e["enabled"] else f"no: {e['disabled_reason']}",
    },
)
DELIVERIES = Listing(
    ("created_at", "event_id", "event_type", "state", "attempts", "last_status", "last_error")
)


def cmd_webhook_list(args: argparse.Namespace) -> int:
    items = api_client(args).all_items("/v1/webhook-endpoints", {"limit": 100}, limit=args.limit)
    print_items(items, args, WEBHOOKS)
    return 0


def cmd_webhook_delete(args: argparse.Namespace) -> int:
    api_client(args).request("DELETE", f"/v1/webhook-endpoints/{args.id}")
    print(f"endpoint {args.id} removed")
    return 0


def cmd_webhook_deliveries(args: argparse.Namespace) -> int:
    path = f"/v1/webhook-endpoints/{args.id}/deliveries"
    items = api_client(args).all_items(path, {"limit": 100}, limit=args.limit)
    print_items(items, args, DELIVERIES)
    return 0
