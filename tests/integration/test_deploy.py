"""deploy/: Kubernetes manifests against the API schemas, alert rules, systemd units, the image."""

from __future__ import annotations

import configparser
import json
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import kubernetes_validate
import pytest
import yaml
from prometheus_client import REGISTRY

import controlplane.runtime.metrics
from controlplane.db import connection as db
from controlplane.runtime import settings as settings_module
from controlplane.runtime.settings import Settings, env_name
from provisioners import cnpg_schema
from tests.support import ROOT

DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
ALERTS = DEPLOY / "prometheus" / "alerts.yaml"
ALERT_TESTS = DEPLOY / "prometheus" / "alerts.test.yaml"
SYSTEMD = DEPLOY / "systemd"
DOCKERFILE = DEPLOY / "Dockerfile"

# Oldest supported Kubernetes minor, and the newest the installed schemas know.
KUBERNETES_VERSIONS = sorted({"1.30", ".".join(kubernetes_validate.latest_version().split(".")[:2])})
IMAGE_UID = 10001
SETTING_VARIABLES = {entry.env for entry in settings_module.SETTINGS.values()}
SECRET_VARIABLES = {
    "CONTROLPLANE_DATABASE_URL",
    "CONTROLPLANE_STRIPE_WEBHOOK_SECRET",
    "CONTROLPLANE_SECRET_KEY",
}
ROLE_COMMANDS = {"api": "serve", "worker": "worker", "reconciler": "reconcile", "migrate": "migrate"}
# The roles that serve /metrics on CONTROLPLANE_METRICS_PORT (the API serves it on its own port).
METRICS_COMPONENTS = ("worker", "reconciler")
METRICS_PORT_VARIABLE = env_name("metrics_port")

Doc = dict[str, Any]


# --------------------------------------------------------------------------------------------
# Kubernetes manifests
# --------------------------------------------------------------------------------------------


def manifest_files() -> list[Path]:
    files = sorted([*KUBERNETES.glob("*.yaml"), *KUBERNETES.glob("*.yml")])
    return [path for path in files if path.name != "kustomization.yaml"]


def load_documents(path: Path) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def all_documents() -> list[tuple[Path, Doc]]:
    return [(path, doc) for path in manifest_files() for doc in load_documents(path)]


def doc_id(path: Path, doc: Doc) -> str:
    return f"{path.name}:{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


def of_kind(kind: str) -> list[Doc]:
    return [doc for _, doc in all_documents() if doc["kind"] == kind]


def workloads() -> list[Doc]:
    return of_kind("Deployment") + of_kind("Job")


def pod_spec(workload: Doc) -> Doc:
    spec: Doc = workload["spec"]["template"]["spec"]
    return spec


def containers(workload: Doc) -> list[Doc]:
    spec = pod_spec(workload)
    return [*spec.get("initContainers", []), *spec["containers"]]


def workload_for(component: str) -> Doc:
    found = [
        doc
        for doc in workloads()
        if doc["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == component
    ]
    assert len(found) == 1, f"expected one workload for {component}, found {len(found)}"
    return found[0]


# A Fernet key in place of the placeholder an operator replaces: the settings refuse a secret key
# that is not one (a placeholder left in a deployment fails at start, in one line).
FILLED_IN_SECRET_KEY = "Jg3T6aWMm4fGg0nZkXq3pQnVQ9bE6xYbU2rJ0cL8hPs="


def load_filled_in(values: dict[str, str]) -> Settings:
    """The settings a deployment's files give once the operator has replaced its placeholders."""
    key = settings_module.env_name("secret_key")
    if values.get(key) == "REPLACE_ME":
        values = {**values, key: FILLED_IN_SECRET_KEY}
    for name, value in values.items():
        if (
            name.endswith(settings_module.FILE_SUFFIX)
            and name.removesuffix(settings_module.FILE_SUFFIX) == key
        ):
            path = Path(value)
            if path.read_text().strip() == "REPLACE_ME":
                path.write_text(FILLED_IN_SECRET_KEY + "\n")
    return settings_module.load(values)


def config_map() -> Doc:
    (doc,) = of_kind("ConfigMap")
    return doc


def secret(name: str = "controlplane-secrets") -> Doc:
    """A Secret by name: the control plane's settings by default (database.yaml has the database's
    roles', migration-secret.yaml the owner's URL)."""
    (doc,) = [doc for doc in of_kind("Secret") if doc["metadata"]["name"] == name]
    return doc


MIGRATION_SECRET = "controlplane-migration"


def secret_values(doc: Doc) -> dict[str, str]:
    values: dict[str, str] = {**doc.get("data", {}), **doc.get("stringData", {})}
    return values


def selector_matches(selector: Doc, labels: dict[str, str]) -> bool:
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions", []):
        present = expression["key"] in labels
        value = labels.get(expression["key"])
        operator = expression["operator"]
        if operator == "In" and value not in expression["values"]:
            return False
        if operator == "NotIn" and value in expression["values"]:
            return False
        if operator == "Exists" and not present:
            return False
        if operator == "DoesNotExist" and present:
            return False
    return True


def pod_labels() -> list[dict[str, str]]:
    return [doc["spec"]["template"]["metadata"]["labels"] for doc in workloads()]


def test_manifests_exist_and_kustomization_lists_them_all() -> None:
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(path.name for path in manifest_files())
    kinds = {doc["kind"] for _, doc in all_documents()}
    expected = {
        "Namespace",
        "Deployment",
        "Service",
        "Job",
        "ConfigMap",
        "Secret",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "Cluster",
    }
    assert expected <= kinds


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(
    ("path", "doc"),
    [pytest.param(path, doc, id=doc_id(path, doc)) for path, doc in all_documents()],
)
def test_manifest_validates_against_the_kubernetes_schema(path: Path, doc: Doc, version: str) -> None:
    # strict: unknown fields are errors too. A kind without a schema raises, not skips; the
    # CloudNativePG Cluster is checked against the CRD of the operator's release manifest.
    cnpg_schema.validate(doc, f"{version}.0")


def test_manifests_leave_the_namespace_to_kustomize() -> None:
    instances_namespace = config_map()["data"]["CONTROLPLANE_KUBERNETES_NAMESPACE"]
    for path, doc in all_documents():
        namespace = doc["metadata"].get("namespace")
        if doc["kind"] in {"Role", "RoleBinding"}:
            assert namespace == instances_namespace, doc_id(path, doc)
        else:
            assert namespace is None, f"{doc_id(path, doc)} names a namespace"
    namespaces = {doc["metadata"]["name"] for doc in of_kind("Namespace")}
    assert namespaces == {"controlplane", instances_namespace}


def test_each_role_runs_its_command_from_the_same_image() -> None:
    images = set()
    for component, command in ROLE_COMMANDS.items():
        (container,) = containers(workload_for(component))
        assert container["args"] == [command]
        assert "command" not in container, "the image's ENTRYPOINT is the controlplane command"
        images.add(container["image"])
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    image_names = {entry["name"] for entry in kustomization.get("images", [])}
    assert {image.split(":")[0] for image in images} <= image_names
    # By digest, never a tag that can move (checkov CKV_K8S_43).
    for entry in kustomization["images"]:
        assert re.fullmatch(r"sha256:[0-9a-f]{64}", entry["digest"]) and "newTag" not in entry, entry


def test_reconciler_runs_two_replicas() -> None:
    assert workload_for("reconciler")["spec"]["replicas"] == 2


def test_serving_containers_have_probes_on_healthz_and_readyz() -> None:
    """The API's on its port; the worker's and the reconciler's on their metrics port, where /healthz
    and /readyz report what the role's own loop does (controlplane/runtime/liveness.py)."""
    api_port = int(config_map()["data"]["CONTROLPLANE_API_PORT"])
    probed = set()
    for workload in workloads():
        if workload["kind"] == "Job":
            continue
        for container in containers(workload):
            by_name = {port["name"]: port["containerPort"] for port in container["ports"]}
            metrics_only = set(by_name) == {"metrics"}
            wanted_port = by_name["metrics"] if metrics_only else api_port
            if metrics_only:
                env = {item["name"]: item.get("value") for item in container.get("env", [])}
                assert env[METRICS_PORT_VARIABLE] == str(wanted_port)
            for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
                http = container[probe]["httpGet"]
                assert http["path"] == path, f"{container['name']} {probe}"
                assert by_name.get(http["port"], http["port"]) == wanted_port, f"{container['name']} {probe}"
            probed.add(container["name"])
    assert probed == {"api", "worker", "reconciler"}


def test_pods_run_as_non_root_with_a_read_only_root_filesystem() -> None:
    for workload in workloads():
        name = workload["metadata"]["name"]
        spec = pod_spec(workload)
        pod_security = spec["securityContext"]
        assert pod_security["runAsNonRoot"] is True, name
        assert pod_security["runAsUser"] == IMAGE_UID, name
        assert pod_security["seccompProfile"]["type"] == "RuntimeDefault", name
        empty_dirs = {volume["name"] for volume in spec.get("volumes", []) if "emptyDir" in volume}
        for container in containers(workload):
            security = container["securityContext"]
            assert security["runAsNonRoot"] is True, name
            assert security["readOnlyRootFilesystem"] is True, name
            assert security["allowPrivilegeEscalation"] is False, name
            assert security["capabilities"]["drop"] == ["ALL"], name
            assert security.get("privileged", False) is False, name
            assert security.get("seccompProfile", pod_security["seccompProfile"])["type"] == "RuntimeDefault"
            tmp = [mount for mount in container["volumeMounts"] if mount["mountPath"] == "/tmp"]
            assert len(tmp) == 1 and tmp[0]["name"] in empty_dirs, f"{name}: /tmp is not an emptyDir"


def test_containers_have_resource_requests_and_limits() -> None:
    for workload in workloads():
        for container in containers(workload):
            resources = container["resources"]
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources[bound]), f"{container['name']} {bound}"


def test_every_controlplane_variable_is_a_setting() -> None:
    names: set[str] = set(config_map()["data"]) | set(secret_values(secret()))
    names |= set(secret_values(secret(MIGRATION_SECRET)))
    names |= {line.split("=", 1)[0] for line in env_example_lines("migrate.env.example")}
    for workload in workloads():
        for container in containers(workload):
            names |= {variable["name"] for variable in container.get("env", [])}
    names |= {line.split("=", 1)[0] for line in env_example_lines()}
    names |= set(re.findall(r"\b(CONTROLPLANE_[A-Z0-9_]+)=", DOCKERFILE.read_text()))
    for unit in unit_files():
        names |= set(re.findall(r"Environment=(CONTROLPLANE_[A-Z0-9_]+)=", unit.read_text()))
    controlplane_names = {name for name in names if name.startswith("CONTROLPLANE_")}
    assert controlplane_names, "no CONTROLPLANE_ variable found"
    secret_files = {
        entry.env + settings_module.FILE_SUFFIX for entry in settings_module.SETTINGS.values() if entry.secret
    }
    assert controlplane_names - SETTING_VARIABLES - secret_files == set()


SECRETS_DIR = "/etc/controlplane/secrets"
MIGRATION_DIR = "/etc/controlplane/migration"


def secret_mounts(workload: Doc, container: Doc) -> dict[str, str]:
    """Secret name -> where the container mounts it (read-only, as files)."""
    by_volume = {
        volume["name"]: volume["secret"]["secretName"]
        for volume in pod_spec(workload).get("volumes", [])
        if "secret" in volume
    }
    mounts = {}
    for mount in container.get("volumeMounts", []):
        if mount["name"] in by_volume:
            assert mount.get("readOnly") is True, mount
            mounts[by_volume[mount["name"]]] = mount["mountPath"]
    return mounts


def test_every_role_gets_the_config_map_and_the_secrets_as_files() -> None:
    """Secrets are mounted files read through CONTROLPLANE_*_FILE, never environment variables
    (checkov CKV_K8S_35): the environment shows in /proc and crash reports."""
    config_name = config_map()["metadata"]["name"]
    secret_name = secret()["metadata"]["name"]
    for workload in workloads():
        for container in containers(workload):
            assert container["envFrom"] == [{"configMapRef": {"name": config_name}}]
            assert "secretKeyRef" not in json.dumps(container.get("env", []))
            assert secret_mounts(workload, container)[secret_name] == SECRETS_DIR
            env = {item["name"]: item.get("value") for item in container.get("env", [])}
            for variable in SECRET_VARIABLES:
                assert env[variable + settings_module.FILE_SUFFIX] == f"{SECRETS_DIR}/{variable}"


def test_only_the_migration_gets_the_owner_role() -> None:
    """The API, worker and reconciler connect as the runtime role; the owner's URL reaches the
    migration alone (its own Secret, its own environment file)."""
    assert set(secret_values(secret(MIGRATION_SECRET))) == {"CONTROLPLANE_MIGRATION_DATABASE_URL"}
    for workload in workloads():
        for container in containers(workload):
            gets_it = MIGRATION_SECRET in secret_mounts(workload, container)
            assert gets_it == (workload["metadata"]["name"] == "controlplane-migrate"), workload["metadata"]
            env = {item["name"]: item.get("value") for item in container.get("env", [])}
            named = env.get("CONTROLPLANE_MIGRATION_DATABASE_URL_FILE")
            assert named == (f"{MIGRATION_DIR}/CONTROLPLANE_MIGRATION_DATABASE_URL" if gets_it else None)
    settings = load_filled_in(
        {**config_map()["data"], **secret_values(secret()), **secret_values(secret(MIGRATION_SECRET))}
    )
    assert db.url_user(settings.database.url_value) == "controlplane_app"
    target = db.migration_target(settings)
    assert (db.url_user(target.url), target.runtime_role) == ("controlplane", "controlplane_app")
    for name in UNIT_COMMANDS:
        files = re.findall(r"^EnvironmentFile=(.+)$", (SYSTEMD / name).read_text(), re.MULTILINE)
        migrate = name == "controlplane-migrate.service"
        assert files == (["/etc/controlplane/migrate.env"] if migrate else []) + ["/etc/controlplane/env"]
    (line,) = env_example_lines("migrate.env.example")
    assert line.startswith("CONTROLPLANE_MIGRATION_DATABASE_URL=") and "REPLACE_ME" in line


def pod_environ(container: Doc, secrets_dir: Path) -> dict[str, str]:
    """What the container's process reads: the ConfigMap as variables, its own env, and each secret
    from a file (written under `secrets_dir`) that its _FILE variable names."""
    files = {**secret_values(secret()), **secret_values(secret(MIGRATION_SECRET))}
    environ = {**config_map()["data"], **container_env(container)}
    for name, value in list(environ.items()):
        if name.endswith(settings_module.FILE_SUFFIX):
            key = value.rsplit("/", 1)[1]
            (secrets_dir / key).write_text(files[key] + "\n")  # as a Secret volume may end a value
            environ[name] = str(secrets_dir / key)
    return environ


def test_the_secrets_as_mounted_files_load_as_the_settings(tmp_path: Path) -> None:
    (container,) = containers(workload_for("migrate"))
    settings = load_filled_in(pod_environ(container, tmp_path))
    assert settings.database.url_value == secret_values(secret())["CONTROLPLANE_DATABASE_URL"]
    assert db.url_user(db.migration_target(settings).url) == "controlplane"


def test_secret_holds_the_secrets_as_marked_placeholders() -> None:
    values = secret_values(secret())
    assert set(values) == SECRET_VARIABLES
    assert all("REPLACE_ME" in value for value in values.values())
    assert not SECRET_VARIABLES & set(config_map()["data"]), "a secret in the ConfigMap"
    data = config_map()["data"]
    assert data["CONTROLPLANE_PROVISIONER"] == "kubernetes"
    assert data["CONTROLPLANE_API_HOST"] == "0.0.0.0"
    assert data["CONTROLPLANE_LOG_FORMAT"] == "json"


def kubernetes_settings() -> Settings:
    return load_filled_in({**config_map()["data"], **secret_values(secret())})


def database_cluster() -> Doc:
    (doc,) = of_kind("Cluster")
    return doc


def test_the_database_is_a_three_instance_cluster_with_synchronous_commits() -> None:
    cluster = database_cluster()
    spec = cluster["spec"]
    assert spec["instances"] == 3
    assert spec["postgresql"]["synchronous"] == {"method": "any", "number": 1, "dataDurability": "required"}
    assert "hostnossl all all 0.0.0.0/0 reject" in spec["postgresql"]["pg_hba"]
    assert spec["enableSuperuserAccess"] is False
    initdb = spec["bootstrap"]["initdb"]
    (owner,) = [d for d in of_kind("Secret") if d["metadata"]["name"] == initdb["secret"]["name"]]
    (app_role,) = spec["managed"]["roles"]
    (app,) = [d for d in of_kind("Secret") if d["metadata"]["name"] == app_role["passwordSecret"]["name"]]
    for role in (owner, app):
        assert role["type"] == "kubernetes.io/basic-auth" and "REPLACE_ME" in role["stringData"]["password"]
    # The runtime role: a login and nothing else (migrate grants it its privileges).
    assert app_role["login"] is True and not any(app_role[k] for k in ("superuser", "createdb", "createrole"))
    name = cluster["metadata"]["name"]
    runtime = urlsplit(secret_values(secret())["CONTROLPLANE_DATABASE_URL"])
    migration = urlsplit(secret_values(secret(MIGRATION_SECRET))["CONTROLPLANE_MIGRATION_DATABASE_URL"])
    assert runtime.username == app["stringData"]["username"] == app_role["name"]
    assert migration.username == owner["stringData"]["username"] == initdb["owner"]
    # Both to the -rw Service of that Cluster, to its database, TLS verified with its CA.
    for url in (runtime, migration):
        assert url.hostname == f"{name}-rw" and url.port == 5432
        assert url.path == "/" + initdb["database"]
        assert url.query == runtime.query
    query = parse_qs(runtime.query)
    assert query["sslmode"] == ["verify-full"]
    (ca_path,) = query["sslrootcert"]
    for workload in workloads():
        volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
        for container in containers(workload):
            (mount,) = [m for m in container["volumeMounts"] if ca_path.startswith(m["mountPath"] + "/")]
            assert volumes[mount["name"]]["secret"]["secretName"] == f"{name}-ca"


def test_config_map_and_secret_load_as_settings() -> None:
    settings = kubernetes_settings()
    assert settings.provisioner.kind == "kubernetes"
    assert settings.api.host == "0.0.0.0" and settings.logging.format == "json"
    assert settings.database.url_value and settings.secret_key and settings.billing.stripe_webhook_secret


def stop_budget(settings: Settings) -> float:
    """Longest graceful stop of a worker: running steps' grace, then hand-back writes retried
    until the jobs would be reclaimed anyway, plus a margin."""
    return settings.worker.shutdown_grace_s + settings.worker.reclaim_after_s + 5


def test_worker_grace_period_outlasts_the_graceful_shutdown() -> None:
    period = pod_spec(workload_for("worker"))["terminationGracePeriodSeconds"]
    assert period >= stop_budget(kubernetes_settings())


def test_role_binds_exactly_the_provisioner_resources_in_the_instances_namespace() -> None:
    assert not of_kind("ClusterRole") and not of_kind("ClusterRoleBinding")
    (role,) = of_kind("Role")
    (binding,) = of_kind("RoleBinding")
    namespace = config_map()["data"]["CONTROLPLANE_KUBERNETES_NAMESPACE"]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == namespace
    verbs = {verb for rule in role["rules"] for verb in rule["verbs"]}
    groups = {group for rule in role["rules"] for group in rule["apiGroups"]}
    resources = {resource for rule in role["rules"] for resource in rule["resources"]}
    assert "*" not in verbs | groups | resources
    # Which verbs: exactly the provisioner's calls, checked by tests/test_kubernetes_rbac.py.
    assert "watch" not in verbs and "update" not in verbs, "the provisioner only applies and reads"
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    (subject,) = binding["subjects"]
    assert subject["kind"] == "ServiceAccount"
    accounts = {doc["metadata"]["name"] for doc in of_kind("ServiceAccount")}
    assert subject["name"] in accounts
    for component in ("worker", "reconciler"):
        assert pod_spec(workload_for(component))["serviceAccountName"] == subject["name"]
    for component in ("api", "migrate"):
        spec = pod_spec(workload_for(component))
        assert spec["serviceAccountName"] != subject["name"]
        assert spec["automountServiceAccountToken"] is False


def test_selectors_match_the_pods() -> None:
    labels = pod_labels()
    for deployment in of_kind("Deployment"):
        template_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selector_matches(deployment["spec"]["selector"], template_labels)
    for budget in of_kind("PodDisruptionBudget"):
        assert sum(selector_matches(budget["spec"]["selector"], pod) for pod in labels) == 1
    for component in ("api", "worker", "reconciler"):
        pods = workload_for(component)["spec"]["template"]["metadata"]["labels"]
        assert any(selector_matches(b["spec"]["selector"], pods) for b in of_kind("PodDisruptionBudget"))
    (service,) = of_kind("Service")
    api = workload_for("api")
    assert selector_matches(
        {"matchLabels": service["spec"]["selector"]}, api["spec"]["template"]["metadata"]["labels"]
    )
    (container,) = containers(api)
    port_names = {port["name"] for port in container["ports"]}
    assert {port["targetPort"] for port in service["spec"]["ports"]} <= port_names


def allowed_ports(policies: list[Doc], labels: dict[str, str], direction: str) -> set[tuple[str, int]]:
    ports: set[tuple[str, int]] = set()
    for policy in policies:
        if not selector_matches(policy["spec"]["podSelector"], labels):
            continue
        for rule in policy["spec"].get(direction, []):
            ports |= {(port.get("protocol", "TCP"), port["port"]) for port in rule.get("ports", [])}
    return ports


def test_network_policy_denies_by_default_and_allows_what_each_role_needs() -> None:
    policies = of_kind("NetworkPolicy")
    assert any(
        p["spec"]["podSelector"] == {} and set(p["spec"]["policyTypes"]) == {"Ingress", "Egress"}
        for p in policies
    ), "no default-deny policy"
    api_port = int(config_map()["data"]["CONTROLPLANE_API_PORT"])
    needs = {"TCP": {5432}, "UDP": {53}}
    for component in ROLE_COMMANDS:
        labels = workload_for(component)["spec"]["template"]["metadata"]["labels"]
        egress = allowed_ports(policies, labels, "egress")
        ingress = allowed_ports(policies, labels, "ingress")
        for protocol, numbers in needs.items():
            assert {(protocol, n) for n in numbers} <= egress, component
        reaches_kubernetes = ("TCP", 443) in egress
        assert reaches_kubernetes == (component in {"worker", "reconciler"}), component
        assert (("TCP", api_port) in ingress) == (component == "api"), component
        if component in METRICS_COMPONENTS:
            assert ingress == {("TCP", metrics_port(component))}, f"{component} admits more than /metrics"
        if component == "migrate":
            assert ingress == set()


def pod_annotations(workload: Doc) -> dict[str, str]:
    annotations: dict[str, str] = workload["spec"]["template"]["metadata"].get("annotations", {})
    return annotations


def container_env(container: Doc) -> dict[str, str]:
    return {
        variable["name"]: variable["value"] for variable in container.get("env", []) if "value" in variable
    }


def metrics_port(component: str) -> int:
    (container,) = containers(workload_for(component))
    by_name = {port["name"]: port for port in container.get("ports", []) if "name" in port}
    assert "metrics" in by_name, f"{component} has no container port named metrics"
    assert by_name["metrics"].get("protocol", "TCP") == "TCP"
    port: int = by_name["metrics"]["containerPort"]
    return port


@pytest.mark.parametrize("component", METRICS_COMPONENTS)
def test_metrics_roles_serve_the_port_they_declare(component: str, tmp_path: Path) -> None:
    workload = workload_for(component)
    (container,) = containers(workload)
    port = metrics_port(component)
    env = container_env(container)
    assert env.get(METRICS_PORT_VARIABLE) == str(port), f"{component}: {METRICS_PORT_VARIABLE}"
    # What the process sees: the ConfigMap, then the container's own env, the secrets as files.
    settings = load_filled_in(pod_environ(container, tmp_path))
    assert settings.metrics_port == port
    assert settings.api.host == "0.0.0.0", "the metrics server binds CONTROLPLANE_API_HOST"
    assert port != settings.api.port
    annotations = pod_annotations(workload)
    assert annotations.get("prometheus.io/scrape") == "true", component
    assert annotations.get("prometheus.io/port") == str(port), component
    assert annotations.get("prometheus.io/path") == "/metrics", component
    labels = workload["spec"]["template"]["metadata"]["labels"]
    assert ("TCP", port) in allowed_ports(of_kind("NetworkPolicy"), labels, "ingress"), component


def test_every_scraped_pod_declares_and_admits_its_scrape_port() -> None:
    # Set per Deployment, not in the ConfigMap: only the worker and the reconciler start a
    # metrics server, and the port must agree with each pod's own declarations.
    assert METRICS_PORT_VARIABLE not in config_map()["data"]
    policies = of_kind("NetworkPolicy")
    scraped = set()
    for workload in workloads():
        annotations = pod_annotations(workload)
        labels = workload["spec"]["template"]["metadata"]["labels"]
        if annotations.get("prometheus.io/scrape") != "true":
            assert workload["kind"] == "Job", f"{workload['metadata']['name']} is not scraped"
            continue
        scraped.add(labels["app.kubernetes.io/component"])
        port = int(annotations["prometheus.io/port"])
        declared = {p["containerPort"] for c in containers(workload) for p in c.get("ports", [])}
        assert port in declared, workload["metadata"]["name"]
        assert ("TCP", port) in allowed_ports(policies, labels, "ingress"), workload["metadata"]["name"]
        assert annotations["prometheus.io/path"] == "/metrics"
    assert scraped == {"api", *METRICS_COMPONENTS}


def kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build", str(KUBERNETES)]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize", str(KUBERNETES)]
    return None


def test_kustomize_build_places_resources_in_their_namespaces() -> None:
    command = kustomize_command()
    if command is None:
        pytest.skip("neither kustomize nor kubectl is installed")
    rendered = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert rendered.returncode == 0, rendered.stderr
    docs = [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]
    assert len(docs) == len(all_documents())
    instances = config_map()["data"]["CONTROLPLANE_KUBERNETES_NAMESPACE"]
    for doc in docs:
        cnpg_schema.validate(doc, f"{KUBERNETES_VERSIONS[0]}.0")
        namespace = doc["metadata"].get("namespace")
        if doc["kind"] == "Namespace":
            assert namespace is None
        elif doc["kind"] in {"Role", "RoleBinding"}:
            assert namespace == instances
        else:
            assert namespace == "controlplane", doc["metadata"]["name"]
    (binding,) = [doc for doc in docs if doc["kind"] == "RoleBinding"]
    assert binding["subjects"][0]["namespace"] == "controlplane"
    images = {c["image"] for d in docs if d["kind"] in {"Deployment", "Job"} for c in containers(d)}
    assert len(images) == 1


# --------------------------------------------------------------------------------------------
# Alert rules
# --------------------------------------------------------------------------------------------

PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless"}
# The control plane's metrics, and the API's request metrics (OpenTelemetry's HTTP server names).
METRIC_NAME = r"(?:controlplane|http_server)_[a-z0-9_]+"


def alert_rules() -> list[Doc]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    assert groups
    return [rule for group in groups for rule in group["rules"]]


def exported_series() -> dict[str, set[str]]:
    """Each series name the control plane's registry exports, with the labels of its metric."""
    assert controlplane.runtime.metrics.TRANSITIONS is not None  # registered on import
    labels_of = {
        getattr(metric, "_name", ""): set(getattr(metric, "_labelnames", ()))
        for metric in vars(controlplane.runtime.metrics).values()
        if hasattr(metric, "_labelnames")
    }
    suffixes = {
        "counter": ("_total", "_created"),
        "gauge": ("",),
        "histogram": ("_bucket", "_count", "_sum", "_created"),
        "summary": ("", "_count", "_sum", "_created"),
        "info": ("_info",),
    }
    series: dict[str, set[str]] = {}
    for family in REGISTRY.collect():
        labels = labels_of.get(family.name, set())
        for suffix in suffixes.get(family.type, ("",)):
            extra = {"le"} if suffix == "_bucket" else set()
            series[family.name + suffix] = labels | extra
    return series


def strip_strings(expr: str) -> str:
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)


def balanced(text: str) -> bool:
    pairs = {")": "(", "]": "[", "}": "{"}
    stack: list[str] = []
    for char in text:
        if char in "([{":
            stack.append(char)
        elif char in pairs and (not stack or stack.pop() != pairs[char]):
            return False
    return not stack


def test_alert_rules_have_severity_summary_and_runbook() -> None:
    rules = alert_rules()
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names))
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}
        assert rule["alert"] and rule["expr"].strip()
        assert rule["labels"]["severity"] in {"page", "warning"}, rule["alert"]
        assert rule["annotations"]["summary"]
        assert rule["annotations"]["runbook_url"].startswith("docs/operations.md#")
        if "for" in rule:
            assert re.fullmatch(r"(\d+[smhd])+", rule["for"])


def test_alert_expressions_use_exported_metrics_and_parse_structurally() -> None:
    series = exported_series()
    for rule in alert_rules():
        expr = strip_strings(rule["expr"])
        assert balanced(expr), f"{rule['alert']}: unbalanced brackets"
        assert rule["expr"].count('"') % 2 == 0
        used = set(re.findall(rf"\b({METRIC_NAME})\b", expr))
        assert used, f"{rule['alert']} uses no control plane metric"
        assert used <= set(series), f"{rule['alert']}: unknown {used - set(series)}"
        known_labels = set().union(*(series[name] for name in used))
        for name, matchers in re.findall(rf"\b({METRIC_NAME})\{{([^}}]*)\}}", rule["expr"]):
            for label in re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=|!=|=~|!~)", matchers):
                assert label in series[name], f"{rule['alert']}: {name} has no label {label}"
        for grouping in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
            for label in (part.strip() for part in grouping.split(",") if part.strip()):
                assert label in known_labels and label not in PROMQL_WORDS, f"{rule['alert']}: {label}"


def rule_using(metric: str) -> Doc:
    found = [rule for rule in alert_rules() if metric in rule["expr"]]
    assert found, f"no alert on {metric}"
    return found[0]


def test_alerts_page_and_warn_on_what_the_design_asks() -> None:
    for metric in ("controlplane_illegal_transitions_total", "controlplane_invariant_violations_total"):
        rule = rule_using(metric)
        assert rule["labels"]["severity"] == "page"
        assert f"increase({metric}[5m])) > 0" in rule["expr"]
        assert "for" not in rule, "a page on the first occurrence"
    over_deadline = rule_using("controlplane_instances_over_deadline")
    assert over_deadline["labels"]["severity"] == "warning" and over_deadline["for"] == "10m"
    assert "> 0" in over_deadline["expr"]
    stale = rule_using("time() - max(controlplane_reconciler_last_success_timestamp_seconds)")
    assert stale["labels"]["severity"] == "warning" and "> 120" in stale["expr"]
    data_lost = rule_using("controlplane_data_loss_total")
    assert data_lost["labels"]["severity"] == "page" and "for" not in data_lost
    failed = rule_using('controlplane_entities{entity="job", state="failed"}')
    assert failed["labels"]["severity"] == "warning" and failed["for"] == "15m"
    faults = rule_using("controlplane_instance_alerting_transitions_total")
    assert faults["labels"]["severity"] == "warning" and "for" not in faults
    lagging = rule_using("controlplane_consumer_lag_seconds")
    assert lagging["labels"]["severity"] == "warning" and "max by (consumer)" in lagging["expr"]
    errors = rule_using('status_class="5xx"')
    assert errors["labels"]["severity"] == "page" and "> 0.05" in errors["expr"]
    slow = rule_using("histogram_quantile(0.99")
    assert slow["labels"]["severity"] == "warning" and ".*/watch" in slow["expr"]
    for rule in (errors, slow):  # what customers ask for: probes and scrapes left out
        assert rule["expr"].count("http_server_request_duration_seconds") == rule["expr"].count('route!~"'), (
            rule["alert"]
        )
    backlog = rule_using("controlplane_queue_oldest_age_seconds")
    assert backlog["labels"]["severity"] == "warning" and "max by (kind)" in backlog["expr"]
    absent = rule_using("absent(controlplane_worker_slots)")
    assert absent["labels"]["severity"] == "page" and absent["for"] == "5m"


# A reconciler that led and stood down keeps exporting the gauges of its last pass; the rules
# read those gauges only from the process with the newest pass.
LEADER_ONLY = (
    "and on (job, instance) (controlplane_reconciler_last_success_timestamp_seconds"
    " == scalar(max(controlplane_reconciler_last_success_timestamp_seconds)))"
)
LEADER_GAUGES = (
    "controlplane_instances_over_deadline",
    "controlplane_entities",
    "controlplane_queue_depth",
    "controlplane_queue_oldest_age_seconds",
    "controlplane_billing_organisations",
)


def test_alerts_read_reconciler_gauges_from_the_leader_only() -> None:
    leader_only = re.sub(r"\s+", "", LEADER_ONLY)
    uses = 0
    for rule in alert_rules():
        used = sum(len(re.findall(rf"\b{gauge}\b", rule["expr"])) for gauge in LEADER_GAUGES)
        assert re.sub(r"\s+", "", rule["expr"]).count(leader_only) == used, (
            f"{rule['alert']}: a reconciler gauge not from the leader"
        )
        uses += used
    assert uses >= 3


def test_promtool_checks_and_unit_tests_the_rules() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed; the structural checks above still ran")
    check = subprocess.run(
        [promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60, check=False
    )
    assert check.returncode == 0, check.stdout + check.stderr
    tests = subprocess.run(
        [promtool, "test", "rules", ALERT_TESTS.name],
        cwd=ALERT_TESTS.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert tests.returncode == 0, tests.stdout + tests.stderr


# --------------------------------------------------------------------------------------------
# Grafana dashboard
# --------------------------------------------------------------------------------------------

DASHBOARD = DEPLOY / "grafana" / "controlplane.json"
# What the dashboard's queries may use beyond the metrics' own labels: Prometheus's target labels.
TARGET_LABELS = {"job", "instance"}
# Grafana's variables in the queries, as a query is run (what promtool checks).
GRAFANA_VARIABLES = {"$job": ".*", "$__rate_interval": "5m"}


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expression) of every query of the dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    return [(panel["title"], target["expr"]) for panel in panels for target in panel.get("targets", [])]


def test_dashboard_is_importable_into_any_grafana() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "controlplane" and dashboard["title"]
    source = next(v for v in dashboard["templating"]["list"] if v["name"] == "datasource")
    assert source["type"] == "datasource" and source["query"] == "prometheus"
    occupied: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        cells = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & occupied, f"{panel['title']} overlaps another panel"
        occupied |= cells
        if panel["type"] == "row":
            continue
        assert panel["description"] and panel["targets"], panel["title"]
        # No data source of one installation: the one chosen on import.
        for holder in (panel, *panel["targets"]):
            assert holder["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]


def test_dashboard_queries_use_exported_metrics_and_labels() -> None:
    series = exported_series()
    for title, expr in dashboard_queries():
        stripped = strip_strings(expr)
        assert balanced(stripped), f"{title}: unbalanced brackets"
        used = set(re.findall(rf"\b({METRIC_NAME})\b", stripped))
        assert used and used <= set(series), f"{title}: unknown {used - set(series)}"
        known = set().union(*(series[name] for name in used)) | TARGET_LABELS
        for name, matchers in re.findall(rf"\b({METRIC_NAME})\{{([^}}]*)\}}", expr):
            for label in re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=|!=|=~|!~)", matchers):
                assert label in series[name] | TARGET_LABELS, f"{title}: {name} has no label {label}"
        for grouping in re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", stripped):
            for label in (part.strip() for part in grouping.split(",") if part.strip()):
                assert label in known, f"{title}: {label}"


def test_dashboard_shows_what_an_operator_watches() -> None:
    queries = "\n".join(expr for _, expr in dashboard_queries())
    for wanted in (
        "rate(http_server_request_duration_seconds_count",  # API rate
        'status_class="5xx"',  # API errors
        "histogram_quantile(0.99, sum by (le) (rate(http_server_request_duration_seconds_bucket",  # latency
        "controlplane_queue_depth",
        "controlplane_queue_oldest_age_seconds",
        "controlplane_worker_slots_in_use",
        "time() - max(controlplane_reconciler_last_success_timestamp_seconds",  # freshness
        "controlplane_billing_organisations",
        "controlplane_audit_last_checkpoint_timestamp_seconds",
    ):
        assert wanted in queries, wanted
    # The leader's gauges are read from the leader only, as the alert rules do.
    for title, expr in dashboard_queries():
        if any(re.search(rf"\b{gauge}\b", expr) for gauge in LEADER_GAUGES):
            assert "== scalar(max(controlplane_reconciler_last_success_timestamp_seconds" in expr, title


def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed; the structural checks above still ran")
    rules = []
    for number, (_, expr) in enumerate(dashboard_queries()):
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        rules.append({"record": f"dashboard:query_{number}", "expr": expr})
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    check = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert check.returncode == 0, check.stdout + check.stderr


def heading_anchors(markdown: str) -> set[str]:
    anchors = set()
    for heading in re.findall(r"^#+\s+(.+?)\s*#*\s*$", markdown, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    anchors |= set(re.findall(r'<a\s+(?:name|id)="([^"]+)"', markdown))
    return anchors


def test_runbook_links_point_at_existing_anchors() -> None:
    operations = ROOT / "docs" / "operations.md"
    if not operations.exists():
        pytest.skip("docs/operations.md is not written yet")
    anchors = heading_anchors(operations.read_text())
    for rule in alert_rules():
        anchor = rule["annotations"]["runbook_url"].partition("#")[2]
        assert anchor in anchors, f"{rule['alert']}: docs/operations.md has no #{anchor}"


# --------------------------------------------------------------------------------------------
# systemd units
# --------------------------------------------------------------------------------------------

UNIT_COMMANDS = {
    "controlplane-api.service": "serve",
    "controlplane-worker.service": "worker",
    "controlplane-reconciler.service": "reconcile",
    "controlplane-migrate.service": "migrate",
}


def unit_files() -> list[Path]:
    return sorted(SYSTEMD.glob("*.service"))


def parse_unit(path: Path) -> configparser.ConfigParser:
    # systemd repeats keys (Environment=); strict=False keeps the last, which is enough here.
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment, method-assign]
    parser.read_string(path.read_text(), source=str(path))
    return parser


def env_example_lines(name: str = "env.example") -> Iterator[str]:
    for line in (SYSTEMD / name).read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            yield line.strip()


def seconds(value: str) -> float:
    units = {"": 1, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value):
        total += float(number) * units[unit]
    return total


def test_one_unit_per_role() -> None:
    assert {path.name for path in unit_files()} == set(UNIT_COMMANDS)


@pytest.mark.parametrize("name", sorted(UNIT_COMMANDS))
def test_unit_runs_its_role_hardened_as_a_dedicated_user(name: str) -> None:
    unit = parse_unit(SYSTEMD / name)
    assert unit["Unit"]["Description"]
    service = unit["Service"]
    command = shlex.split(service["ExecStart"])
    assert Path(command[0]).name == "controlplane" and command[1:] == [UNIT_COMMANDS[name]]
    assert service["User"] == "controlplane" and service["Group"] == "controlplane"
    assert service["EnvironmentFile"] == "/etc/controlplane/env"
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
    }.items():
        assert service[key] == value, f"{name}: {key}"
    assert "/var/lib/controlplane" in service["ReadWritePaths"].split()
    assert service["CapabilityBoundingSet"] == ""
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    if name == "controlplane-migrate.service":
        assert service["Type"] == "oneshot" and service["RemainAfterExit"] == "yes"
    else:
        assert "controlplane-migrate.service" in unit["Unit"]["Requires"].split()
        assert "controlplane-migrate.service" in unit["Unit"]["After"].split()
        assert service["Restart"] == "on-failure"


def env_example_settings() -> Settings:
    return load_filled_in(dict(line.split("=", 1) for line in env_example_lines()))


def unit_environment(path: Path) -> dict[str, str]:
    """Every Environment= assignment of a unit, later lines winning (parse_unit keeps one line)."""
    assignments: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line.startswith("Environment="):
            for word in shlex.split(line.removeprefix("Environment=")):
                name, _, value = word.partition("=")
                assignments[name] = value
    return assignments


UNIT_METRICS = ("controlplane-worker.service", "controlplane-reconciler.service")


def test_units_serving_metrics_have_ports_of_their_own() -> None:
    environment = dict(line.split("=", 1) for line in env_example_lines())
    # EnvironmentFile= overrides Environment=: one value there would give every role one port.
    assert METRICS_PORT_VARIABLE not in environment
    settings = env_example_settings()
    ports = {}
    for name in sorted(UNIT_COMMANDS):
        assignments = unit_environment(SYSTEMD / name)
        if name not in UNIT_METRICS:
            assert METRICS_PORT_VARIABLE not in assignments, name
            continue
        unit_settings = load_filled_in({**assignments, **environment})
        assert unit_settings.metrics_port is not None, f"{name} serves no metrics"
        ports[name] = unit_settings.metrics_port
    assert set(ports) == set(UNIT_METRICS)
    assert len(set(ports.values())) == len(ports), "two roles on one host would share a port"
    assert settings.api.port not in ports.values()
    assert not any(
        settings.provisioner.local_port_min <= port <= settings.provisioner.local_port_max
        for port in ports.values()
    )


def test_worker_unit_waits_for_the_graceful_shutdown() -> None:
    stop = seconds(parse_unit(SYSTEMD / "controlplane-worker.service")["Service"]["TimeoutStopSec"])
    assert stop >= stop_budget(env_example_settings())


def test_env_example_names_the_secrets_as_placeholders() -> None:
    settings = dict(line.split("=", 1) for line in env_example_lines())
    assert set(settings) >= SECRET_VARIABLES
    assert env_example_settings().database.url_value == settings["CONTROLPLANE_DATABASE_URL"]
    assert all("REPLACE_ME" in settings[name] for name in SECRET_VARIABLES)


def test_systemd_analyze_verifies_the_units(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    true = shutil.which("true") or "/bin/true"
    for path in unit_files():
        text = path.read_text().replace("/opt/controlplane/venv/bin/controlplane", true)
        (tmp_path / path.name).write_text(text)
    units = sorted(str(path) for path in tmp_path.glob("*.service"))
    result = subprocess.run(
        [analyze, "verify", *units], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --------------------------------------------------------------------------------------------
# Container image
# --------------------------------------------------------------------------------------------


def dockerfile_stages() -> list[list[str]]:
    """The Dockerfile's instructions (continuations joined, comments dropped), by stage."""
    logical: list[str] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    stages: list[list[str]] = []
    for instruction in logical:
        if instruction.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(instruction)
    return stages


def instructions(stage: list[str], keyword: str) -> list[str]:
    return [line.split(None, 1)[1] for line in stage if line.split(None, 1)[0].upper() == keyword]


def test_image_is_multi_stage_on_python_slim() -> None:
    stages = dockerfile_stages()
    assert len(stages) >= 2
    builder, runtime = stages[0], stages[-1]
    builder_from = instructions(builder, "FROM")[0].split()
    assert len(builder_from) == 3 and builder_from[1].upper() == "AS", "the builder stage is named"
    assert instructions(runtime, "FROM")[0].split()[0].startswith("python:3.11-slim")
    copies_from_builder = [
        c for c in instructions(runtime, "COPY") if c.startswith(f"--from={builder_from[2]}")
    ]
    assert any("/opt/controlplane/venv" in copy for copy in copies_from_builder)


def test_image_has_a_healthcheck_of_the_roles_own_health() -> None:
    (check,) = instructions(dockerfile_stages()[-1], "HEALTHCHECK")
    assert '"python", "-m", "controlplane.runtime.healthcheck"' in check and "--interval=" in check


def test_image_runs_as_a_fixed_non_root_user() -> None:
    runtime = dockerfile_stages()[-1]
    users = instructions(runtime, "USER")
    assert users, "no USER in the final stage"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}
    assert user == str(IMAGE_UID)
    assert instructions(runtime, "ENTRYPOINT") == ['["controlplane"]']
    api_port = str(Settings().api.port)
    assert api_port in " ".join(instructions(runtime, "EXPOSE"))


def test_image_has_no_build_tools_at_runtime() -> None:
    stages = dockerfile_stages()
    forbidden = re.compile(r"\b(gcc|g\+\+|clang|make|build-essential|[\w.+-]+-dev)\b")
    for run in instructions(stages[-1], "RUN"):
        assert not forbidden.search(run), run
    assert any("build-essential" in run for run in instructions(stages[0], "RUN"))


def test_image_keeps_the_migrations_beside_the_package() -> None:
    # controlplane/db/connection.py finds alembic.ini and alembic/ in the directory above the package.
    builder = dockerfile_stages()[0]
    sources = {copy.split()[0] for copy in instructions(builder, "COPY") if not copy.startswith("--")}
    assert {"alembic.ini", "alembic", "controlplane", "reconciler", "provisioners"} <= sources
    assert any("--editable" in run for run in instructions(builder, "RUN"))


def test_dockerignore_admits_exactly_what_the_image_copies() -> None:
    lines = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*", "the build context is an allow-list"
    admitted = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    copied = set()
    for stage in dockerfile_stages():
        for copy in instructions(stage, "COPY"):
            if not copy.startswith("--from"):
                copied |= set(copy.split()[:-1])
    assert copied <= admitted
