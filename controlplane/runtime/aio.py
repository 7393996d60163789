"""How the control plane's processes run their event loop: on uvloop where it is installed.

uvloop (installed with uvicorn's standard extras on Linux and macOS) roughly halves the client
CPU of a database round trip against asyncio's default loop; see bench/FINDINGS.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)`, on uvloop when it can be imported."""
    try:
        import uvloop
    except ImportError:  # Windows, PyPy: the default loop
        return asyncio.run(main)
    return uvloop.run(main)
