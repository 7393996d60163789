"""`python -m controlplane.cli`: the same command as the `controlplane` console script."""

from __future__ import annotations

import sys

from controlplane.cli import main

sys.exit(main())
