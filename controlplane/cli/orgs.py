"""Organisations and API keys through the API: `controlplane orgs create|list|update`, `controlplane keys
create|list|revoke`. Organisations need an admin key (a profile's, CONTROLPLANE_API_KEY, or the
one `up` saved in the local data directory); an organisation's key manages its own keys."""

from __future__ import annotations

import argparse
import uuid
from typing import TYPE_CHECKING, Any

from controlplane.cli.common import (
    CommandError,
    Listing,
    add_list_flags,
    add_output_flag,
    api_client,
    output_format,
    print_data,
    print_items,
)
from controlplane.cli.customer_parser import api_flags
from controlplane.core import exit_codes

if TYPE_CHECKING:
    from controlplane.cli.client import Api

EXAMPLE = "example:\n  {}"


def _parser(actions: Any, name: str, help_text: str, example: str, handler: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = actions.add_parser(
        name,
        help=help_text,
        description=help_text[0].upper() + help_text[1:] + ".",
        epilog=EXAMPLE.format(example),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    api_flags(parser)
    parser.add_argument(
        "--data-dir",
        default=None,
        help="the data directory of a local `up`: its admin key is used when no key is given "
        "(env CONTROLPLANE_DATA_DIR; default: .controlplane)",
    )
    add_output_flag(parser)
    parser.set_defaults(handler=handler)
    return parser


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "orgs",
        help="create, list and update organisations (an admin key)",
        description="Create, list and update organisations through the API, with an admin key.",
    )
    actions = parser.add_subparsers(dest="orgs_command", metavar="ACTION", required=True)
    create = _parser(
        actions,
        "create",
        "create an organisation and print its first API key once",
        "controlplane orgs create acme",
        cmd_create,
    )
    create.add_argument("name", metavar="NAME", help="letters, digits, spaces and . _ -")
    create.add_argument("--stripe-customer", default=None, metavar="ID", help="Stripe customer id (cus_...)")
    add_list_flags(_parser(actions, "list", "list the organisations", "controlplane orgs list", cmd_list))
    update = _parser(
        actions,
        "update",
        "link an organisation to its Stripe customer, so that it is billed",
        "controlplane orgs update acme --stripe-customer cus_NffrFeUfNV2Hib",
        cmd_update,
    )
    update.add_argument("org", metavar="NAME_OR_ID", help="the organisation")
    update.add_argument(
        "--stripe-customer",
        required=True,
        metavar="ID",
        help="its Stripe customer id (cus_...); once linked, it is not moved to another",
    )

    parser = commands.add_parser(
        "keys",
        help="create, list and revoke API keys",
        description="API keys: an organisation's key manages its organisation's keys; an admin key, "
        "any organisation's (--org).",
    )
    actions = parser.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    create = _parser(
        actions,
        "create",
        "create an API key and print it once",
        "controlplane keys create --name ci",
        cmd_key_create,
    )
    create.add_argument("--name", default="", help="a name to recognise it by (default: none)")
    create.add_argument("--org", metavar="NAME_OR_ID", help="the organisation (with an admin key)")
    listing = _parser(
        actions, "list", "list API keys (never the keys themselves)", "controlplane keys list", cmd_key_list
    )
    listing.add_argument("--org", metavar="NAME_OR_ID", help="the organisation (with an admin key)")
    add_list_flags(listing)
    revoke = _parser(
        actions,
        "revoke",
        "revoke an API key",
        "controlplane keys revoke 5b1e0c52-8d4f-4c7e-9a51-0d2f6b3f9e10",
        cmd_key_revoke,
    )
    revoke.add_argument("key_id", metavar="KEY_ID", type=uuid.UUID, help="the key's id (`keys list`)")


def org_id(api: Api, ref: str) -> str:
    """An organisation's id from its id or its name (one look-up)."""
    try:
        return str(uuid.UUID(ref))
    except ValueError:
        pass
    found = api.request("GET", "/v1/orgs", params={"name": ref})["items"]
    if not found:
        raise CommandError(f"no organisation named {ref!r}", exit_codes.NOT_FOUND)
    return str(found[0]["id"])


def cmd_create(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"name": args.name}
    if args.stripe_customer:
        body["stripe_customer_id"] = args.stripe_customer
    created = api_client(args, admin=True).request("POST", "/v1/orgs", json=body)
    fmt = output_format(args)
    if fmt != "table":
        print_data(created, fmt)
        return 0
    print(f"organisation {created['org']['name']} created: {created['org']['id']}")
    print(f"API key (shown once, keep it safe): {created['key']['key']}")
    return 0


ORGS = Listing(("name", "id", "stripe_customer_id", "billing_hold", "created_at"))
KEYS = Listing(("id", "prefix", "name", "created_at", "revoked_at"))


def cmd_list(args: argparse.Namespace) -> int:
    items = api_client(args, admin=True).request("GET", "/v1/orgs")["items"]
    print_items(items[: args.limit], args, ORGS)
    return 0


def cmd_update(args: argparse.Namespace) -> int:
    api = api_client(args, admin=True)
    org = api.request(
        "PATCH", f"/v1/orgs/{org_id(api, args.org)}", json={"stripe_customer_id": args.stripe_customer}
    )
    fmt = output_format(args)
    if fmt != "table":
        print_data(org, fmt)
        return 0
    hold = " (on billing hold: a payment failed before the link)" if org["billing_hold"] else ""
    print(f"organisation {org['name']} is billed to Stripe customer {org['stripe_customer_id']}{hold}")
    return 0


def _keys(args: argparse.Namespace) -> tuple[Api, str]:
    """The client and the keys' path: the caller's organisation's, or (admin) --org's."""
    api = api_client(args, admin=bool(args.org))
    return api, f"/v1/orgs/{org_id(api, args.org)}/keys" if args.org else "/v1/keys"


def cmd_key_create(args: argparse.Namespace) -> int:
    api, path = _keys(args)
    key = api.request("POST", path, json={"name": args.name})
    fmt = output_format(args)
    if fmt != "table":
        print_data(key, fmt)
        return 0
    print(f"API key {key['id']} created")
    print(f"API key (shown once, keep it safe): {key['key']}")
    return 0


def cmd_key_list(args: argparse.Namespace) -> int:
    api, path = _keys(args)
    print_items(api.all_items(path, limit=args.limit), args, KEYS)
    return 0


def cmd_key_revoke(args: argparse.Namespace) -> int:
    api_client(args, admin=True).request("DELETE", f"/v1/keys/{args.key_id}")
    if output_format(args) != "table":
        print_data({"id": str(args.key_id), "revoked": True}, output_format(args))
    else:
        print(f"API key {args.key_id} revoked")
    return 0
