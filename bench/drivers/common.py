"""Shared by the drivers that run in the project's venv: timing, JSON output, logging off the hot path."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from typing import Any


def quiet_logs() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)


def emit(result: dict[str, Any]) -> None:
    """The driver's result: one JSON object on the last line of stdout."""
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


async def sleep_until(wall_time: float) -> None:
    delay = wall_time - time.time()
    if delay > 0:
        await asyncio.sleep(delay)
