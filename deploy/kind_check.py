#!/usr/bin/env python3
"""A check on a real Kubernetes cluster (kind, for example): installs the CloudNativePG operator and
the control plane's manifests, then runs one instance through its whole lifecycle with the
kubernetes provisioner, as the control plane's ServiceAccount (so the API server enforces
deploy/kubernetes/rbac.yaml): create -> ready -> write -> resize -> suspend (write refused) ->
resume -> backup -> delete.

Run it from a checkout, in the project's environment (it needs the dev extra):

    python3 dev.py shell python deploy/kind_check.py --kubeconfig ~/.kube/config
    python3 dev.py shell python deploy/kind_check.py --dry-run

--dry-run contacts no cluster: it prints every step and validates every manifest it would apply
(the operator's release manifest, the rendered kustomization, the instance's objects) against
the CRD and Kubernetes schemas. Backups need a barman-cloud ObjectStore in the instances
namespace (--object-store; the barman-cloud plugin and cert-manager installed): without one the
backup step is skipped and the instance is deleted without a final backup.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import secrets
import shutil
import subprocess
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from provisioners import cnpg, cnpg_schema  # noqa: E402
from provisioners.base import InstanceSpec  # noqa: E402

KUSTOMIZATION = ROOT / "deploy" / "kubernetes"
SERVICE_ACCOUNT = "system:serviceaccount:controlplane:controlplane"
OPERATOR = ("cnpg-system", "deployment/cnpg-controller-manager")
STEPS = ("create", "ready", "write", "resize", "suspend", "write refused", "resume", "backup", "delete")
WRITE = "CREATE TABLE IF NOT EXISTS kind_check (n int); INSERT INTO kind_check VALUES (1);"
# What a customer would try to get round suspension: none of it may succeed.
FORCED_WRITE = "SET default_transaction_read_only = off; INSERT INTO kind_check VALUES (2);"


class CheckFailed(RuntimeError):
    """A step of the check did not do what it must."""


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kubeconfig", help="the cluster to check (default: the current kubeconfig)")
    parser.add_argument("--context", help="a context of that kubeconfig")
    parser.add_argument("--dry-run", action="store_true", help="contact no cluster; print and validate")
    parser.add_argument("--namespace", default="controlplane-instances", help="where instances go")
    parser.add_argument("--object-store", help="a barman-cloud ObjectStore in that namespace, for backups")
    parser.add_argument("--plan", default="dev", help="the plan to create (then resized to small)")
    parser.add_argument(
        "--pod-monitor",
        action="store_true",
        help="a PodMonitor per instance, as deploy/kubernetes makes them (the cluster needs the "
        "Prometheus Operator's CRDs)",
    )
    return parser.parse_args(argv)


def cluster_options(args: argparse.Namespace) -> cnpg.ClusterOptions:
    return cnpg.ClusterOptions(args.namespace, object_store=args.object_store, pod_monitor=args.pod_monitor)


# ---- what would be applied ---------------------------------------------------------------------


def rendered_kustomization() -> list[dict[str, Any]]:
    """The control plane's manifests as kustomize renders them, placeholders replaced."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise CheckFailed("kubectl is not installed (it renders the kustomization and applies it)")
    rendered = subprocess.run(
        [kubectl, "kustomize", str(KUSTOMIZATION)], capture_output=True, text=True, check=False, timeout=120
    )
    if rendered.returncode != 0:
        raise CheckFailed(f"kubectl kustomize failed: {rendered.stderr.strip()}")
    docs = [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]
    return fill_placeholders(docs)


def fill_placeholders(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Generated values for every REPLACE_ME: one database password in both places, a Fernet key."""
    password = secrets.token_urlsafe(24)
    key = base64.urlsafe_b64encode(secrets.token_bytes(32)).decode()
    values = {
        "CONTROLPLANE_DATABASE_URL": None,
        "CONTROLPLANE_SECRET_KEY": key,
        "CONTROLPLANE_STRIPE_WEBHOOK_SECRET": "whsec_" + secrets.token_hex(16),
        "password": password,
    }
    for doc in docs:
        data = doc.get("stringData") if doc["kind"] == "Secret" else None
        for name, value in list((data or {}).items()):
            if "REPLACE_ME" in str(value):
                assert data is not None
                data[name] = (
                    str(value).replace("REPLACE_ME", password) if values.get(name) is None else values[name]
                )
    return docs


def instance_manifests(options: cnpg.ClusterOptions, plan: str) -> list[dict[str, Any]]:
    return cnpg.all_manifests(uuid.uuid4(), InstanceSpec(plan, org_id=uuid.uuid4()), options, fence=1)


def validate_all(label: str, docs: Sequence[dict[str, Any]]) -> int:
    for doc in docs:
        cnpg_schema.validate(doc)
    print(f"  {label}: {len(docs)} manifests valid ({', '.join(sorted({d['kind'] for d in docs}))})")
    return len(docs)


def dry_run(args: argparse.Namespace) -> int:
    options = cluster_options(args)
    release = cnpg_schema.RELEASE_MANIFEST.relative_to(ROOT)
    print(f"would install CloudNativePG {cnpg_schema.OPERATOR_VERSION} from {release}")
    crds = [d for d in cnpg_schema.release_documents() if d["kind"] == "CustomResourceDefinition"]
    print(f"  {len(crds)} CRDs, among them {', '.join(sorted(cnpg_schema.custom_kinds()))}")
    print(f"would apply the control plane's manifests from {KUSTOMIZATION.relative_to(ROOT)}")
    validate_all("control plane", rendered_kustomization())
    print(f"would run one {args.plan} instance, as {SERVICE_ACCOUNT}: {' -> '.join(STEPS)}")
    validate_all("instance", instance_manifests(options, args.plan))
    if not args.object_store:
        print("  no --object-store: the backup step would be skipped, the delete take no final backup")
    print("dry run: nothing was applied; every manifest is valid")
    return 0


# ---- on a real cluster -------------------------------------------------------------------------


def kubectl(args: argparse.Namespace, *command: str, stdin: str | None = None, check: bool = True) -> str:
    base = ["kubectl"]
    if args.kubeconfig:
        base += ["--kubeconfig", args.kubeconfig]
    if args.context:
        base += ["--context", args.context]
    result = subprocess.run([*base, *command], input=stdin, capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise CheckFailed(f"kubectl {' '.join(command)}: {result.stderr.strip()}")
    return result.stdout + result.stderr


def install(args: argparse.Namespace) -> None:
    print("installing the operator")
    kubectl(args, "apply", "--server-side", "-f", str(cnpg_schema.RELEASE_MANIFEST))
    kubectl(args, "-n", OPERATOR[0], "rollout", "status", OPERATOR[1], "--timeout=5m")
    print("applying the control plane's manifests")
    kubectl(args, "apply", "--server-side", "-f", "-", stdin=yaml.safe_dump_all(rendered_kustomization()))
    kubectl(
        args,
        "-n",
        "controlplane",
        "wait",
        "--for=condition=Ready",
        "cluster/controlplane-db",
        "--timeout=10m",
    )
    print("  the control plane's database is ready")


def provisioner_for(args: argparse.Namespace) -> Any:
    import kubernetes

    from provisioners.kubernetes import KubernetesApi, KubernetesProvisioner

    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(  # type: ignore[no-untyped-call]
        config_file=args.kubeconfig, context=args.context, client_configuration=configuration
    )
    client = kubernetes.client.ApiClient(configuration)
    client.set_default_header("Impersonate-User", SERVICE_ACCOUNT)  # type: ignore[no-untyped-call]
    options = cluster_options(args)
    return KubernetesProvisioner(
        KubernetesApi(client), options, ready_wait_s=600, backup_wait_s=900, poll_s=5
    )


def psql(args: argparse.Namespace, instance: uuid.UUID, password: str, sql: str) -> tuple[bool, str]:
    """Run SQL as the customer, over TCP with TLS, on the instance's primary server."""
    primary = kubectl(
        args,
        "-n",
        args.namespace,
        "get",
        "cluster",
        cnpg.resource_name(instance),
        "-o",
        "jsonpath={.status.currentPrimary}",
    ).strip()
    conninfo = f"host=localhost user={cnpg.OWNER} dbname={cnpg.DBNAME} password={password} sslmode=require"
    out = kubectl(
        args,
        "-n",
        args.namespace,
        "exec",
        primary,
        "-c",
        "postgres",
        "--",
        "psql",
        conninfo,
        "-v",
        "ON_ERROR_STOP=1",
        "-c",
        sql,
        check=False,
    )
    return "ERROR" not in out, out.strip()


async def lifecycle(args: argparse.Namespace) -> None:
    k8s = provisioner_for(args)
    iid, fence = uuid.uuid4(), 1
    spec = InstanceSpec(args.plan, 1)
    print(f"create: instance {iid}")
    await k8s.allocate_storage(iid, spec, fence)
    await k8s.configure_network(iid, spec, fence)
    info = await k8s.initialize_database(iid, spec, fence)
    print(f"ready: {info.host}:{info.port} as {info.user}, sslmode={info.sslmode}")
    ok, out = psql(args, iid, info.password, WRITE)
    if not ok:
        raise CheckFailed(f"write refused on a ready instance: {out}")
    print("write: accepted")
    await k8s.apply_plan(iid, InstanceSpec("small", 2), 2)
    print("resize: small rolled out")
    await k8s.suspend(iid, InstanceSpec("small", 2), 3)
    ok, out = psql(args, iid, info.password, FORCED_WRITE)
    if ok or "read-only" not in out:
        raise CheckFailed(f"a write succeeded on a suspended instance: {out}")
    print("suspend: write refused even after SET default_transaction_read_only = off")
    await k8s.resume(iid, InstanceSpec("small", 2), 4)
    ok, out = psql(
        args, iid, info.password, "INSERT INTO kind_check VALUES (3); SELECT count(*) FROM kind_check;"
    )
    if not ok:
        raise CheckFailed(f"write refused after resume: {out}")
    print("resume: writes accepted, the rows written before are there")
    if args.object_store:
        backup = await k8s.take_backup(iid, InstanceSpec("small", 2), 5)
        print(f"backup: {backup.name} completed at {backup.completed_at}")
    else:
        print("backup: skipped (no --object-store)")
    result = await k8s.deprovision(iid, InstanceSpec("small", 2), 6, skip_backup=not args.object_store)
    print(f"delete: removed, final backup {result.backup}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        if args.dry_run:
            return dry_run(args)
        install(args)
        asyncio.run(lifecycle(args))
    except (CheckFailed, cnpg_schema.ManifestError) as exc:
        print(f"kind check failed: {exc}", file=sys.stderr)
        return 1
    print("kind check passed: " + " -> ".join(STEPS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
