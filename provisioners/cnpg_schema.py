"""Validation of manifests against the real schemas: CloudNativePG's CRDs from the release manifest
in deploy/cnpg, the core kinds from kubernetes-validate, the Prometheus Operator's PodMonitor from
the schema of its fields in deploy/prometheus-operator. Tooling only (tests, the cluster check): it
needs the dev extra (jsonschema, kubernetes-validate) and a checkout of the repository."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

OPERATOR_VERSION = "1.30.0"
ROOT = Path(__file__).resolve().parent.parent
RELEASE_MANIFEST = ROOT / "deploy" / "cnpg" / f"cnpg-{OPERATOR_VERSION}.yaml"
CNPG_GROUP = "postgresql.cnpg.io"
MONITORING_GROUP = "monitoring.coreos.com"
# The PodMonitor's fields this project may set (written here: the upstream CRD is not vendored).
POD_MONITOR_SCHEMA = ROOT / "deploy" / "prometheus-operator" / "podmonitor-v1.schema.json"
# The oldest Kubernetes minor the manifests are checked against (the newest installed too).
KUBERNETES_VERSION = "1.30.0"


class ManifestError(ValueError):
    """A manifest that the API server (or the operator's CRD) would refuse."""


@functools.cache
def release_documents() -> tuple[dict[str, Any], ...]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with RELEASE_MANIFEST.open() as handle:
        return tuple(doc for doc in yaml.load_all(handle, Loader=loader) if doc)


def strict(schema: Any) -> Any:
    """The schema with unknown fields refused where the CRD does not preserve them.

    A real API server prunes unknown fields of a custom resource silently (a misspelt field would
    just be dropped); the provisioner applies with fieldValidation=Strict, which refuses them, and
    this mirrors that.
    """
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) for key, value in schema.items()}
    if (
        out.get("type") == "object"
        and "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def _validators() -> dict[str, Any]:
    import jsonschema

    found: dict[str, Any] = {}
    for doc in release_documents():
        if doc["kind"] != "CustomResourceDefinition" or doc["spec"]["group"] != CNPG_GROUP:
            continue
        (version,) = [v for v in doc["spec"]["versions"] if v.get("storage")]
        schema = strict(version["schema"]["openAPIV3Schema"])
        # metadata is the API server's, not the CRD's: any object.
        schema["properties"]["metadata"] = {"type": "object"}
        found[doc["spec"]["names"]["kind"]] = jsonschema.Draft7Validator(schema)
    return found


@functools.cache
def _monitoring_validators() -> dict[str, Any]:
    import jsonschema

    return {"PodMonitor": jsonschema.Draft7Validator(json.loads(POD_MONITOR_SCHEMA.read_text()))}


def custom_kinds() -> frozenset[str]:
    return frozenset(_validators())


def is_custom(doc: Mapping[str, Any]) -> bool:
    """A kind of a CRD (CloudNativePG's, the Prometheus Operator's), not of Kubernetes itself."""
    return str(doc.get("apiVersion", "")).startswith((CNPG_GROUP + "/", MONITORING_GROUP + "/"))


def validate(doc: Mapping[str, Any], kubernetes_version: str = KUBERNETES_VERSION) -> None:
    """Raise ManifestError unless `doc` is valid: a custom kind against its schema, others strictly."""
    if is_custom(doc):
        cnpg = str(doc.get("apiVersion", "")).startswith(CNPG_GROUP + "/")
        validator = (_validators() if cnpg else _monitoring_validators()).get(str(doc.get("kind")))
        if validator is None:
            source = RELEASE_MANIFEST if cnpg else POD_MONITOR_SCHEMA
            raise ManifestError(f"no kind {doc.get('apiVersion')}/{doc.get('kind')} in {source.name}")
        errors = sorted(validator.iter_errors(dict(doc)), key=lambda e: list(e.path))
        if errors:
            raise ManifestError(
                _describe(doc, (f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors))
            )
        return
    import kubernetes_validate

    try:
        kubernetes_validate.validate(dict(doc), kubernetes_version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        raise ManifestError(_describe(doc, [str(exc)])) from None


def _describe(doc: Mapping[str, Any], problems: Iterable[str]) -> str:
    name = (doc.get("metadata") or {}).get("name")
    return f"{doc.get('kind')}/{name}: " + "; ".join(problems)
