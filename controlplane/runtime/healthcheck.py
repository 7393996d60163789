"""The container image's HEALTHCHECK: `python -m controlplane.runtime.healthcheck`.

Asks the role in this container for its health over loopback: the metrics port's `/healthz` when
CONTROLPLANE_METRICS_PORT is set (`worker`, `reconcile`: what their own loop reports), else the
API's `/healthz` on CONTROLPLANE_API_PORT (`serve`). Exit 0 when it answers 200, else 1 with why.
Standard library only: it runs every interval, and must start fast.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping

TIMEOUT_S = 4.0


def health_url(environ: Mapping[str, str]) -> str:
    port = environ.get("CONTROLPLANE_METRICS_PORT") or environ.get("CONTROLPLANE_API_PORT") or "8700"
    return f"http://127.0.0.1:{port.strip()}/healthz"


def main(environ: Mapping[str, str] | None = None) -> int:
    url = health_url(os.environ if environ is None else environ)
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as answer:  # noqa: S310 (loopback, http)
            print(f"{url}: {answer.status} {answer.read(200).decode(errors='replace').strip()}")
            return 0 if answer.status == 200 else 1
    except urllib.error.HTTPError as exc:
        print(f"{url}: {exc.code} {exc.read(200).decode(errors='replace').strip()}", file=sys.stderr)
    except (urllib.error.URLError, OSError) as exc:
        print(f"{url}: {getattr(exc, 'reason', exc)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
