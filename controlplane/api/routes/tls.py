"""The CA that signs the databases' server certificates, for clients to verify them (no key needed)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from controlplane.api import problems as errors
from controlplane.api.problems import ProblemError
from controlplane.api.state import app_state, provisioner_of

router = APIRouter(tags=["reference"])

PEM_MEDIA_TYPE = "application/x-pem-file"


@router.get(
    "/v1/ca.pem",
    response_class=Response,
    responses={
        200: {"content": {PEM_MEDIA_TYPE: {"schema": {"type": "string"}}}},
        **errors.responses(404),
    },
    summary="The CA certificate to verify the databases with (libpq sslmode=verify-full, sslrootcert)",
    operation_id="getCaCertificate",
    description=(
        'The CA certificate (PEM) that the databases" server certificates are signed by: use it as '
        "`sslrootcert`."
    ),
)
async def ca_certificate(request: Request) -> Response:
    provisioner = provisioner_of(app_state(request))
    pem = await provisioner.ca_certificate()
    if pem is None:
        raise ProblemError("not-found", f"the {provisioner.name} provisioner issues no server certificates")
    return Response(pem, media_type=PEM_MEDIA_TYPE, headers={"Cache-Control": "public, max-age=3600"})
