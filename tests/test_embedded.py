"""The embedded default model and its drafter: `hyspec generate` without --model / --drafter picks the shipped
drafter with the settings it recommends for the backend; explicit options win; a backend with no measured
speed-up stays on plain decoding."""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import pytest

from hyspec_jax import cli, launch
from hyspec_jax.embedded import default_budget_table, default_drafter_dir, default_model_dir
from hyspec_jax.io.hf import load_pretrained
from hyspec_jax.spec import engine as E
from hyspec_jax.spec.budget import BudgetTable, b_ver, model_id
from hyspec_jax.spec.options import RECOMMENDED_FILE, recommended_settings

pytestmark = pytest.mark.skipif(default_drafter_dir() is None, reason="no embedded drafter in this checkout")


def _args(**kw):
    return cli.build_parser().parse_args(["generate", "x", *kw.pop("argv", [])])


@pytest.fixture(scope="module")
def target():
    return load_pretrained(default_model_dir(), dtype=jnp.float32)[1]


def test_recommended_file_is_well_formed():
    raw = json.loads((default_drafter_dir() / RECOMMENDED_FILE).read_text())
    for backend in ("cpu", "gpu"):
        rec = recommended_settings(default_drafter_dir(), backend)
        assert rec == {} or rec["spec_mode"] in E.MODES, raw


def test_embedded_defaults_follow_the_backend(monkeypatch, target):
    model_dir = default_model_dir()
    for backend in ("cpu", "gpu"):
        monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
        rec = recommended_settings(default_drafter_dir(), backend)
        eng = launch.engine_from_args(_args(), target, model_dir, jnp.float32)
        if not rec or rec["spec_mode"] == "ar":
            assert eng is None
            continue
        assert eng.spec.mode == rec["spec_mode"]
        if eng.spec.is_tree:
            assert (eng.spec.tree.depth, eng.spec.tree.top_k, eng.spec.tree.beam) == (
                rec["tree_depth"], rec["tree_topk"], rec["tree_beam"])
            assert eng.spec.verify_nodes == rec["verify_nodes"]


def test_explicit_options_win(monkeypatch, target):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    model_dir = default_model_dir()
    eng = launch.engine_from_args(_args(argv=["--spec-mode", "chain", "--chain-length", "3"]), target, model_dir,
                             jnp.float32)
    assert eng.spec.mode == "chain" and eng.spec.chain_length == 3 and eng.drafter is not None
    eng = launch.engine_from_args(_args(argv=["--spec-mode", "tree", "--tree-depth", "2"]), target, model_dir,
                             jnp.float32)
    assert eng.spec.tree.depth == 2
    assert launch.engine_from_args(_args(argv=["--spec-mode", "ar"]), target, model_dir, jnp.float32) is None
    # another model directory never picks up the embedded drafter implicitly
    ns = _args(argv=["--model", str(model_dir)])
    assert launch.engine_from_args(ns, target, model_dir, jnp.float32) is None


def test_shipped_budget_table_covers_the_embedded_model(monkeypatch, target):
    """checkpoints/default/budget_table.json: `hyspec calibrate` entries of this very model (config hash) on the
    H200 and on a CPU, each B_ver consistent with its own timings; the embedded engine loads it by default."""
    path = default_budget_table()
    assert path is not None
    table = BudgetTable.load(path)
    name = model_id(target.config, default_model_dir().name)
    assert {"NVIDIA H200", "cpu"} <= {e["device_kind"] for e in table.entries.values() if e["model"] == name}
    for e in table.entries.values():
        t_ver = {int(n): t for n, t in e["t_ver_ms"].items()}
        assert (e["b_ver"], e["within_tolerance"]) == b_ver(t_ver, e["t_dec_ms"], e["eps"]), e
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    eng = launch.engine_from_args(_args(argv=["--spec-mode", "chain"]), target, default_model_dir(), jnp.float32)
    assert eng.budget_table is not None and eng.budget_table.entries == table.entries


def test_recommendation_bounded_by_slots(monkeypatch, target):
    """A recommendation measured up to `max_slots` concurrent requests: more prompts (or --slots) decode plainly
    unless a mode is asked for explicitly."""
    model_dir = default_model_dir()
    for backend in ("cpu", "gpu"):
        rec = recommended_settings(default_drafter_dir(), backend)
        if not rec or rec.get("max_slots") is None:
            continue
        monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
        k = rec["max_slots"]
        assert launch.engine_from_args(_args(), target, model_dir, jnp.float32, batch=k) is not None
        assert launch.engine_from_args(_args(), target, model_dir, jnp.float32, batch=k + 1) is None
        assert launch.engine_from_args(_args(argv=["--slots", str(k + 1)]), target, model_dir, jnp.float32) is None
        eng = launch.engine_from_args(_args(argv=["--spec-mode", rec["spec_mode"]]), target, model_dir, jnp.float32,
                                 batch=k + 1)
        assert eng is not None and eng.spec.mode == rec["spec_mode"]


def test_serve_speculative_mode_uses_the_embedded_drafter(target):
    """`hyspec serve --spec-mode M` without a model directory serves the embedded model with its drafter; with one
    it still asks for --drafter (the server builds its engine through `launch.engine_from_args`)."""
    from hyspec_jax.serve import server
    p = argparse.ArgumentParser()
    server.add_arguments(p)
    args = p.parse_args(["--spec-mode", "tree-ready", "--max-batch", "2", "--max-model-len", "256"])
    backend = server.build_backend(args, target, default_model_dir(), 256)
    assert backend.mode == "tree-ready" and backend.round_shapes[False].reader
    with pytest.raises(ValueError, match="--drafter"):
        server.build_backend(p.parse_args(["--model", str(default_model_dir()), "--spec-mode", "chain"]), target,
                             default_model_dir(), 256)