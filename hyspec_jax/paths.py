"""Where hyspec_jax keeps files it makes (models, built kernels, compiled programs): one directory, $HYSPEC_CACHE
or ~/.cache/hyspec_jax. A leaf module: it imports nothing from hyspec_jax."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("HYSPEC_CACHE", Path.home() / ".cache" / "hyspec_jax"))


__all__ = ["cache_dir"]
