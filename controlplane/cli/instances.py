"""The `instances` and `ca` commands: each one's request to the API, what it prints, and the
waiting `--wait` asks for.

Every instance argument is its name or its id (the API resolves a name in one look-up)."""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from typing import Any

from controlplane.cli.client import Api, connection_uri, instance_path
from controlplane.cli.common import CommandError, Listing, output_format, print_data, print_items
from controlplane.cli.follow import follow, wait_for_generation
from controlplane.cli.render import (
    BACKUPS,
    EVENTS,
    INSTANCES,
    failure_rows,
    ready_line,
    show_instance,
    show_metrics,
    window_rows,
)
from controlplane.core import exit_codes

# The page size asked of the API (its cap) when listing everything.
PAGE = 100


def _deadline(args: argparse.Namespace) -> float:
    return time.monotonic() + float(args.timeout)


def ended_failed(instance: dict[str, Any], quiet: bool = False) -> CommandError:
    """Print why the instance failed and what to do next; the one-line error to exit with."""
    failure = instance.get("failure")
    name = instance.get("name") or instance["id"]
    if not quiet:
        for label, text in failure_rows(failure) if failure else []:
            print(f"{label}: {text}")
        if "retry" in instance.get("allowed_actions", []):
            print(f"retry: controlplane instances retry {name} --wait")
        elif "delete" in instance.get("allowed_actions", []):
            print(f"remove what is left: controlplane instances delete {instance['id']}")
    code = (failure or {}).get("code", "no reason")
    return CommandError(f"instance {name} ended {instance['state']}: {code}", exit_codes.FAILED)


def wait_until_ready(api: Api, instance: dict[str, Any], fmt: str, deadline: float) -> int:
    """Follow a new instance until ready: then its id, name and URI, else why it failed and the
    retry command."""
    quiet = fmt != "table"
    final = follow(api, instance["id"], ("ready",), quiet, deadline)
    if quiet:
        print_data(final, fmt)
    if final["state"] != "ready":
        raise ended_failed(final, quiet)
    if not quiet:
        ready_line(final, api)
    return 0


def cmd_create(args: argparse.Namespace) -> int:
    api = Api(args)
    fmt = output_format(args)
    body: dict[str, Any] = {"name": args.name, "plan": args.plan}
    if args.region:
        body["region"] = args.region
    if args.deletion_protection:
        body["deletion_protection"] = True
    if args.restore_from:
        body["restore_from"] = _restore_from(api, args)
    elif args.at or args.from_backup:
        raise CommandError("--at and --from-backup need --restore-from SOURCE", exit_codes.USAGE)
    # One key for every try of this command: a create answered 502 (or lost) and sent again makes
    # one database, and the API answers the first outcome again.
    key = {"Idempotency-Key": str(uuid.uuid4())}
    instance = api.request("POST", "/v1/instances", json=body, headers=key)
    if not args.wait:
        show_instance(instance, fmt)
        return 0
    if fmt == "table":
        print(f"{instance['name']}: created as {instance['id']}")
    return wait_until_ready(api, instance, fmt, _deadline(args))


def _restore_from(api: Api, args: argparse.Namespace) -> dict[str, Any]:
    """The `restore_from` of a new instance: the source by name or id (a deleted one too), and a
    moment of its window (`--at`), one of its backups (`--from-backup`), or its latest state."""
    source = api.request("GET", f"/v1/instances/{instance_path(args.restore_from)}")
    restore: dict[str, Any] = {"instance_id": source["id"]}
    if args.at:
        restore["point_in_time"] = args.at
    if args.from_backup:
        restore["backup"] = args.from_backup
    return restore


def cmd_retry(args: argparse.Namespace) -> int:
    api = Api(args)
    fmt = output_format(args)
    # A failed instance is retried at most once (the API refuses a second retry): no key is needed.
    instance = api.request("POST", f"/v1/instances/{instance_path(args.ref)}/retry")
    if fmt != "table" and not args.wait:
        print_data(instance, fmt)
        return 0
    if fmt == "table":
        print(f"{instance['name']}: retried as {instance['id']} (replaces {instance.get('replaces')})")
    if not args.wait:
        return 0
    return wait_until_ready(api, instance, fmt, _deadline(args))


def cmd_switchover(args: argparse.Namespace) -> int:
    """An SRE's switchover (the admin API, with the admin key): the job that carries it out."""
    api = Api(args, admin=True)
    job = api.request(
        "POST", f"/v1/admin/instances/{instance_path(args.ref)}/switchover", json={"reason": args.reason}
    )
    fmt = output_format(args)
    if fmt != "table":
        print_data(job, fmt)
    else:
        print(f"switchover of {args.ref}: job {job['id']} ({job['state']}); follow it: `controlplane events`")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    params: dict[str, Any] = {"limit": min(args.limit or PAGE, PAGE)}
    if args.state:
        params["state"] = args.state
    elif not args.all:
        params["live"] = "true"
    items = Api(args).all_items("/v1/instances", params, limit=args.limit)
    print_items(items, args, INSTANCES)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    api = Api(args)
    instance = api.request("GET", f"/v1/instances/{instance_path(args.ref)}")
    if args.uri:
        if not instance.get("connection"):
            raise CommandError(
                f"instance {args.ref} has no connection yet (state {instance['state']})", exit_codes.CONFLICT
            )
        print(connection_uri(api, instance["connection"]))
        return 0
    show_instance(instance, output_format(args), api)
    return 0


def cmd_resize(args: argparse.Namespace) -> int:
    api = Api(args)
    fmt = output_format(args)
    instance = api.request("PATCH", f"/v1/instances/{instance_path(args.ref)}", json={"plan": args.plan})
    if not (args.wait or args.wait_for_resume):
        show_instance(instance, fmt)
        return 0
    if fmt == "table":
        print(
            f"{instance['name']}: resize to {args.plan} requested (generation {instance['spec_generation']})"
        )
    generation = int(instance["spec_generation"])
    final = wait_for_generation(
        api,
        instance["id"],
        generation,
        fmt != "table",
        _deadline(args),
        plan=args.plan,
        through_suspension=args.wait_for_resume,
    )
    if fmt != "table":
        print_data(final, fmt)
    if final["state"] == "suspended":
        return exit_codes.RECORDED  # wait_for_generation said why, on stderr
    if final["observed_generation"] < generation or final["state"] != "ready":
        raise CommandError(
            f"resize to {args.plan} did not complete: instance is {final['state']}"
            f" ({(final.get('failure') or {}).get('message') or 'no reason recorded'})",
            exit_codes.FAILED,
        )
    if fmt == "table":
        ready_line(final, api, plan=args.plan)
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    api = Api(args)
    fmt = output_format(args)
    params = {"skip_final_backup": "true"} if args.skip_final_backup else None
    instance = api.request("DELETE", f"/v1/instances/{instance_path(args.ref)}", params=params)
    if args.wait:
        # By id from here on: once deleted, the name may mean another instance.
        instance = follow(api, instance["id"], ("deleted",), fmt != "table", _deadline(args))
        if instance["state"] != "deleted" and instance.get("archived_at") is None:
            raise ended_failed(instance, fmt != "table")
    if fmt != "table":
        print_data(instance, fmt)
    else:
        requested = " (deletion requested)" if not args.wait else ""
        print(f"{instance['name']} ({instance['id']}): {instance['state']}{requested}")
    return 0


def cmd_protection(args: argparse.Namespace) -> int:
    on = args.setting == "on"
    instance = Api(args).request(
        "PATCH", f"/v1/instances/{instance_path(args.ref)}", json={"deletion_protection": on}
    )
    fmt = output_format(args)
    if fmt != "table":
        print_data(instance, fmt)
    else:
        print(f"{instance['name']}: deletion protection {'on' if instance['deletion_protection'] else 'off'}")
    return 0


def cmd_wait(args: argparse.Namespace) -> int:
    """Like `aws rds wait`: exit 0 once in one of the states, 5 at the timeout, 8 if it ended in a
    terminal state it was not asked to wait for."""
    api = Api(args)
    fmt = output_format(args)
    first = api.request("GET", f"/v1/instances/{instance_path(args.ref)}")
    final = follow(api, first["id"], args.states, fmt != "table", _deadline(args))
    if fmt != "table":
        print_data(final, fmt)
    if final["state"] not in args.states:
        raise ended_failed(final, fmt != "table")
    if fmt == "table":
        print(f"{final['name']} ({final['id']}) is {final['state']}")
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    return _show_all(args, "events", EVENTS)


def cmd_watch(args: argparse.Namespace) -> int:
    api = Api(args)
    if output_format(args) == "table":
        follow(api, args.ref, (), quiet=False)
        return 0
    # One JSON document a line: each event's data (the snapshot, a transition, a step).
    for _name, event in api.stream_events(args.ref):
        json.dump(event, sys.stdout)
        sys.stdout.write("\n")
        sys.stdout.flush()
    return 0


def cmd_backups(args: argparse.Namespace) -> int:
    """The recoverable window (earliest and latest restorable moment, the archive's health and lag),
    then the backups, newest first."""
    recovery = Api(args).request("GET", f"/v1/instances/{instance_path(args.ref)}/recovery")
    fmt = output_format(args)
    if fmt != "table":
        print_data(recovery, fmt)
        return 0
    for label, value in window_rows(recovery):
        print(f"{label + ':':<18}{value}")
    print()
    backups = recovery["backups"]
    print_items(backups[: args.limit] if args.limit else backups, args, BACKUPS)
    return 0


def _show_all(args: argparse.Namespace, what: str, listing: Listing) -> int:
    """The items of one of the instance's lists (`events`, `backups`; the first --limit), shown."""
    params = {"limit": min(args.limit, PAGE)} if args.limit else None
    items = Api(args).all_items(f"/v1/instances/{instance_path(args.ref)}/{what}", params, limit=args.limit)
    print_items(items, args, listing)
    return 0


def cmd_metrics(args: argparse.Namespace) -> int:
    params = {"from": args.since, "to": args.until, "step": args.step}
    series = Api(args).request(
        "GET",
        f"/v1/instances/{instance_path(args.ref)}/metrics",
        params={k: v for k, v in params.items() if v is not None} or None,
    )
    show_metrics(series, output_format(args))
    return 0


def cmd_backup(args: argparse.Namespace) -> int:
    requested = Api(args).request("POST", f"/v1/instances/{instance_path(args.ref)}/backups")
    fmt = output_format(args)
    if fmt != "table":
        print_data(requested, fmt)
    elif requested["created"]:
        job = requested["job_id"]
        print(f"{args.ref}: backup requested (job {job}); `instances backups` lists it once taken")
    else:
        print(f"{args.ref}: a backup is already under way (job {requested['job_id']})")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    api = Api(args)
    fmt = output_format(args)
    body: dict[str, Any] = {"empty": True} if args.empty else {}
    if args.backup:
        body["backup_id"] = args.backup
    if args.reason:
        body["reason"] = args.reason
    instance = api.request("POST", f"/v1/instances/{instance_path(args.ref)}/restore", json=body)
    if not args.wait:
        if fmt != "table":
            print_data(instance, fmt)
        else:
            source = "empty" if args.empty else args.backup or "the newest backup"
            print(f"{instance['name']}: restore requested ({source})")
        return 0
    return wait_until_ready(api, instance, fmt, _deadline(args))


def cmd_ca(args: argparse.Namespace) -> int:
    pem = Api(args, need_key=False).ca_pem()
    if args.file is None:
        sys.stdout.write(pem)
        return 0
    args.file.write_text(pem)
    print(f"CA certificate written to {args.file} (use it as sslrootcert)")
    return 0
