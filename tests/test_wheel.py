"""A built wheel (not an editable install) ships the embedded model and finds it.

The wheel is built from a copy of the source tree (the checkout stays clean), unzipped — installing it into a
fresh virtual environment would take minutes — and `hyspec_jax.embedded.default_model_dir()` is called from
the unzipped tree alone (`python -S`: no site-packages, so neither the editable install nor the checkout is
importable).
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "hyspec_jax", "train", "serve", "bench", "pallas_kernels", "checkpoints")
DEFAULT = ROOT / "checkpoints" / "default"

pytestmark = pytest.mark.skipif(
    not (DEFAULT / "config.json").is_file() or importlib.util.find_spec("setuptools") is None,
    reason="needs the shipped model and setuptools (≥ 70.1 builds wheels without the `wheel` package)")


def test_wheel_ships_the_embedded_model(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "*.pyc", "data", "results")  # not shipped
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    drafter = src / "checkpoints" / "default" / "drafter"      # a drafter, once shipped, travels with the model
    if not (DEFAULT / "drafter").exists():
        (drafter / "reader").mkdir(parents=True)
        (drafter / "config.json").write_text("{}")
        (drafter / "reader" / "reader_config.json").write_text("{}")
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(dist)], check=True, timeout=300, cwd=tmp_path)
    (wheel,) = dist.glob("hyspec_jax-*.whl")

    names = set(zipfile.ZipFile(wheel).namelist())
    root = src / "checkpoints" / "default"
    shipped = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    assert {"config.json", "tokenizer.json", "drafter/config.json", "drafter/reader/reader_config.json"} <= set(shipped)
    missing = [f for f in shipped if f"hyspec_jax/checkpoints/default/{f}" not in names]
    assert not missing, f"not in the wheel: {missing}"
    assert not any(n.startswith(("checkpoints/", "train/", "serve/", "tests/")) for n in names)  # no top-level
    assert "hyspec_jax/cpu_kernels.cc" in names          # the native CPU kernel's source (built on first use)

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import hyspec_jax.embedded as e; "
            "print(e.__file__); print(e.default_model_dir()); print(e.default_drafter_dir())")
    out = subprocess.run([sys.executable, "-S", "-c", code, str(site)], capture_output=True, text=True, check=True,
                         timeout=60, cwd=tmp_path).stdout.split()
    module, model_dir, drafter_dir = map(Path, out)
    assert module.is_relative_to(site)
    assert model_dir == site / "hyspec_jax" / "checkpoints" / "default"
    assert drafter_dir == model_dir / "drafter"
    assert (model_dir / "config.json").read_bytes() == (DEFAULT / "config.json").read_bytes()


def test_checkout_resolves_the_repository_checkpoints():
    from hyspec_jax import cli
    from hyspec_jax.embedded import default_model_dir
    assert default_model_dir() == DEFAULT
    assert cli.resolve_model_dir(None) == (DEFAULT, None)
