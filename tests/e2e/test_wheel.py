"""The project as a user installs it: `python -m build`, the wheel into a clean virtualenv, and its
`controlplane migrate` run against the test PostgreSQL from a folder that holds no checkout."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import psycopg

from controlplane.db import connection as db
from tests.support import ROOT


def run(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_the_built_wheel_installs_and_migrates_a_database(tmp_path: Path, empty_database: str) -> None:
    dist = tmp_path / "dist"
    run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)], cwd=tmp_path)
    (wheel,) = dist.glob("controlplane-*.whl")

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    python = str(venv / "bin" / "python")
    # The dependencies are this environment's (the same pinned versions a `pip install` resolves);
    # the project itself comes from the wheel alone (no index, no dependency of its own installed).
    purelib = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path)
    (Path(purelib.strip()) / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)], cwd=tmp_path)

    where = run([python, "-c", "import controlplane; print(controlplane.__file__)"], cwd=tmp_path)
    assert where.strip().startswith(str(venv)), where

    env = {k: v for k, v in os.environ.items() if not k.startswith("CONTROLPLANE_")}
    env["CONTROLPLANE_DATABASE_URL"] = empty_database
    out = run([str(venv / "bin" / "controlplane"), "migrate"], cwd=tmp_path, env=env)
    assert f"database migrated to revision {db.head_revision()}" in out

    with psycopg.connect(empty_database) as conn:
        row = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    assert row == (db.head_revision(),)
