"""The OpenAPI document is fit to generate clients from: every operation has a stable camelCase
operationId, a summary, a description, tags and every response declared (problems with the
Problem schema, headers by reference), every field a description; and it passes a validator.

These checks run over whatever routes exist: a route added later without them fails here."""

from __future__ import annotations

import re
from typing import Any

import pytest
from openapi_spec_validator import validate

from controlplane.api.app import create_app
from controlplane.api.openapi import COMMON_HEADERS, HEADERS
from controlplane.api.ratelimit import UNLIMITED_PATHS
from controlplane.runtime.settings import Settings

CAMEL = re.compile(r"[a-z]+(?:[A-Z][a-z0-9]*)*")
PROBLEM_REF = "#/components/schemas/Problem"


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    return create_app(Settings()).openapi()


def operations(document: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (method, path, op)
        for path, item in document["paths"].items()
        for method, op in item.items()
        if method in ("get", "post", "put", "patch", "delete")
    ]


def test_the_document_passes_the_openapi_validator(document: dict[str, Any]) -> None:
    validate(document)


def test_every_operation_has_a_stable_camel_case_id_summary_description_and_tags(
    document: dict[str, Any],
) -> None:
    ids = []
    for method, path, op in operations(document):
        where = f"{method.upper()} {path}"
        assert CAMEL.fullmatch(op.get("operationId", "")), f"{where}: operationId {op.get('operationId')!r}"
        assert op.get("summary"), f"{where}: no summary"
        assert op.get("description") and len(op["description"]) > 20, f"{where}: no description"
        assert op.get("tags"), f"{where}: no tags"
        ids.append(op["operationId"])
    assert len(ids) == len(set(ids)), "operationIds are unique"
    # The ids clients are generated with do not move: the main ones, as published.
    assert {"createInstance", "getInstance", "listInstances", "updateInstance", "deleteInstance"} <= set(ids)
    described = {tag["name"] for tag in document["tags"]}
    assert {t for _m, _p, op in operations(document) for t in op["tags"]} <= described


def test_every_operation_declares_its_problems_with_the_problem_schema_and_headers(
    document: dict[str, Any],
) -> None:
    for method, path, op in operations(document):
        where = f"{method.upper()} {path}"
        answers = op["responses"]
        limited = not path.startswith(UNLIMITED_PATHS)  # health and metrics: no rate limit
        wanted = {"500", "422"} | ({"429"} if limited else set())  # 422: an unknown query parameter
        assert "security" in op, f"{where}: says nothing of its security (public: [])"
        if op.get("security"):
            wanted |= {"401", "403"}
        if "{instance_id}" in path or "{job_id}" in path or "{key_id}" in path or "{org_id}" in path:
            wanted.add("404")
        assert wanted <= set(answers), f"{where}: missing {sorted(wanted - set(answers))}"
        assert limited or "429" not in answers, f"{where}: no rate limit counts it, yet 429"
        assert any(s.startswith("2") for s in answers), f"{where}: no success declared"
        for status, answer in answers.items():
            assert answer.get("description"), f"{where} {status}: no description"
            for name in COMMON_HEADERS if limited else COMMON_HEADERS[:1]:
                assert name in answer["headers"], f"{where} {status}: no {name} header"
            if status == "400" and not path.startswith("/v1/webhooks/"):
                assert "signature" not in answer["description"].lower(), f"{where}: 400 is no signature error"
            if status in ("429", "503"):
                assert "Retry-After" in answer["headers"], f"{where} {status}: no Retry-After"
            if status[0] in "45":
                schema = answer["content"]["application/problem+json"]["schema"]
                assert schema == {"$ref": PROBLEM_REF}, f"{where} {status}"
    assert set(document["components"]["headers"]) == set(HEADERS)


def test_the_document_names_its_servers_and_licence_and_plans_by_one_schema(document: dict[str, Any]) -> None:
    assert document["servers"] == [{"url": "/", "description": "the host serving this document"}]
    assert document["info"]["license"] == {"name": "Apache License 2.0", "identifier": "Apache-2.0"}
    schemas = document["components"]["schemas"]
    ref = {"$ref": "#/components/schemas/PlanName"}
    assert schemas["PlanName"]["enum"] == ["dev", "small", "medium"]
    assert schemas["Plan"]["properties"]["name"]["$ref"] == ref["$ref"]  # what /v1/plans lists ...
    assert schemas["InstanceCreate"]["properties"]["plan"]["$ref"] == ref["$ref"]  # ... create takes
    assert ref in schemas["InstanceUpdate"]["properties"]["plan"]["anyOf"]


def test_request_fields_that_may_be_left_out_are_optional_for_client_generators(
    document: dict[str, Any],
) -> None:
    """openapi-typescript makes a field with a `default` required; a request's may be left out."""
    schemas = document["components"]["schemas"]
    create = schemas["InstanceCreate"]
    assert create["required"] == ["name", "plan"]
    for name, schema in schemas.items():
        if not name.endswith("Create") and name not in ("InstanceUpdate", "JobAction", "RestoreFromBackup"):
            continue
        defaults = [field for field, prop in schema.get("properties", {}).items() if "default" in prop]
        assert defaults == [], f"{name}: {defaults} declare a default"


def test_the_instance_routes_declare_etag_location_and_replay(document: dict[str, Any]) -> None:
    paths = document["paths"]
    create = paths["/v1/instances"]["post"]["responses"]["202"]["headers"]
    assert {"Location", "ETag", "Idempotent-Replayed"} <= set(create)
    assert "ETag" in paths["/v1/instances/{instance_id}"]["get"]["responses"]["200"]["headers"]
    for method in ("patch", "delete"):
        assert "ETag" in paths["/v1/instances/{instance_id}"][method]["responses"]["202"]["headers"]
    for method in ("patch", "delete"):
        assert {"409", "412"} <= set(paths["/v1/instances/{instance_id}"][method]["responses"])


def test_every_field_has_a_description(document: dict[str, Any]) -> None:
    missing = [
        f"{name}.{field}"
        for name, schema in document["components"]["schemas"].items()
        for field, prop in schema.get("properties", {}).items()
        if not prop.get("description")
    ]
    assert missing == []


def test_request_bodies_carry_examples(document: dict[str, Any]) -> None:
    create = document["components"]["schemas"]["InstanceCreate"]
    assert create["properties"]["name"].get("examples") and create["properties"]["plan"].get("examples")
