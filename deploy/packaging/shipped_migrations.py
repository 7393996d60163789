"""The build step that ships the migrations inside the package: `alembic/` and `alembic.ini` stay at
the repository's top level, and a built wheel carries them as `controlplane/db/migrations/`, where
`controlplane.db.connection` looks first (pyproject.toml names this step in [tool.setuptools.cmdclass])."""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools.command.build_py import build_py

# What the migrations are made of (alembic's environment, its template, every revision).
PATTERNS = ("alembic.ini", "alembic/env.py", "alembic/script.py.mako", "alembic/versions/*.py")


class BuildWithMigrations(build_py):  # type: ignore[misc]
    """Builds the packages as usual, then copies the migrations into controlplane/db/migrations/."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:  # an editable install reads them from the checkout
            return
        root = Path(__file__).resolve().parents[2]
        target = Path(self.build_lib) / "controlplane" / "db" / "migrations"
        for pattern in PATTERNS:
            for source in sorted(root.glob(pattern)):
                relative = source.relative_to(root)
                parts = relative.parts[1:] if relative.parts[0] == "alembic" else relative.parts
                destination = target.joinpath(*parts)
                destination.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, destination)
