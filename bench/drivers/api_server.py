"""Driver: the project's API (create_app) served by uvicorn as the product serves it, plus a baseline.

The baseline route `POST /bench/baseline` is mounted here, on the app object this driver creates,
never among the product's routes: it parses the same JSON body and does one INSERT, nothing else.
Settings come from CONTROLPLANE_* variables (CONTROLPLANE_PROVISIONER=noop for the bench).
"""

from __future__ import annotations

import argparse

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from psycopg.types.json import Jsonb

from controlplane.api.app import create_app
from controlplane.api.state import app_state
from controlplane.runtime import logs
from controlplane.runtime.settings import load

BASELINE_TABLE = "CREATE TABLE IF NOT EXISTS bench_baseline (id bigserial PRIMARY KEY, body jsonb NOT NULL)"


def bench_app() -> FastAPI:
    settings = load()
    app = create_app(settings)

    @app.post("/bench/baseline", status_code=201, include_in_schema=False)
    async def baseline(request: Request) -> JSONResponse:
        body = await request.json()
        async with app_state(request).pool.connection() as conn:
            await conn.execute("INSERT INTO bench_baseline (body) VALUES (%s)", (Jsonb(body),), prepare=True)
        return JSONResponse({"created": True}, status_code=201)

    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    logs.configure("WARNING")
    uvicorn.run(bench_app(), host=args.host, port=args.port, log_config=None, proxy_headers=True)
