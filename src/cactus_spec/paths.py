"""Where cactus-spec keeps what it builds: one root for models, kernels and measurements."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The root: ``$CACTUS_SPEC_CACHE``, else ``~/.cache/cactus-spec``."""
    return Path(os.environ.get("CACTUS_SPEC_CACHE") or Path.home() / ".cache" / "cactus-spec")
