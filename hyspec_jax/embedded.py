"""Where the embedded default model lives — one resolver for `hyspec generate`, `hyspec serve` and the benches.

The repository keeps it under `checkpoints/default/` (its drafter, once shipped, under
`checkpoints/default/drafter/`). A wheel ships the same files as package data of `hyspec_jax.checkpoints`
(`pyproject.toml` maps `checkpoints/` there), so an installed package finds them next to its modules:

    repository checkout / editable install   <repo>/checkpoints/default
    installed wheel                          <site-packages>/hyspec_jax/checkpoints/default

Its calibration table (Bole's B_ver per device kind and bucket) is `default/budget_table.json`.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def checkpoint_roots() -> list[Path]:
    """The `checkpoints/` folders to look in, in order: installed package data, then the repository checkout."""
    return [_PACKAGE / "checkpoints", _PACKAGE.parent / "checkpoints"]


def default_model_dir() -> Path | None:
    """The embedded default model's directory (it has a config.json), or None when none is shipped."""
    for root in checkpoint_roots():
        d = root / "default"
        if (d / "config.json").is_file():
            return d
    return None


def default_drafter_dir() -> Path | None:
    """The embedded default model's drafter directory (`default/drafter/`, DeepSpec layout), or None."""
    model = default_model_dir()
    if model is None:
        return None
    d = model / "drafter"
    return d if (d / "config.json").is_file() else None


def default_budget_table() -> Path | None:
    """The embedded model's calibration table (`default/budget_table.json`: `hyspec calibrate` entries per
    device kind, e.g. the H200 and this project's CPU host), or None."""
    model = default_model_dir()
    if model is None:
        return None
    f = model / "budget_table.json"
    return f if f.is_file() else None


__all__ = ["checkpoint_roots", "default_model_dir", "default_drafter_dir", "default_budget_table"]
