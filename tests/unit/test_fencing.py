"""Fences at a downstream resource: the pure rule and the file-based store."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from controlplane.core.step_errors import StaleFence
from controlplane.runtime.fencing import FileFences, admit


def test_admit_keeps_the_highest_and_refuses_lower() -> None:
    assert admit("r", None, 5) == 5
    assert admit("r", 5, 5) == 5  # the same claim may call again
    assert admit("r", 5, 9) == 9
    with pytest.raises(StaleFence) as refused:
        admit("r", 9, 4)
    assert (refused.value.resource, refused.value.fence, refused.value.highest) == ("r", 4, 9)


def test_file_fences_per_key(tmp_path: Path) -> None:
    fences = FileFences(tmp_path / "fences")
    assert fences.highest("inst-1") is None
    assert fences.check("inst-1", 10) == 10
    assert fences.check("inst-2", 3) == 3  # keys are independent
    assert fences.check("inst-1", 12) == 12
    with pytest.raises(StaleFence):
        fences.check("inst-1", 11)
    assert fences.highest("inst-1") == 12
    # A new store on the same directory (another process, a restart) sees the same fences.
    with pytest.raises(StaleFence):
        FileFences(tmp_path / "fences").check("inst-1", 10)


def test_keys_must_be_plain_names(tmp_path: Path) -> None:
    fences = FileFences(tmp_path)
    for key in ("../escape", "", "a/b", ".hidden"):
        with pytest.raises(ValueError):
            fences.check(key, 1)


def test_hold_keeps_lower_fences_out_while_the_resource_is_touched(tmp_path: Path) -> None:
    """Many threads race with random fences: the writes that happen are in increasing fence order."""
    fences = FileFences(tmp_path)
    written: list[int] = []
    refused: list[int] = []
    order = list(range(1, 201))
    random.Random(7).shuffle(order)

    def attempt(fence: int) -> None:
        try:
            with fences.hold("inst", fence):
                written.append(fence)
        except StaleFence:
            refused.append(fence)

    threads = [threading.Thread(target=attempt, args=(f,)) for f in order]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert written == sorted(written) and 200 in written
    assert sorted(written + refused) == list(range(1, 201))
    assert fences.highest("inst") == 200


async def test_async_check(tmp_path: Path) -> None:
    fences = FileFences(tmp_path)
    assert await fences.check_async("k", 2) == 2
    with pytest.raises(StaleFence):
        await fences.check_async("k", 1)
