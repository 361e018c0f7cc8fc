"""The embedded default model and its drafter: `hyspec generate` without --model / --drafter picks the shipped
drafter with the settings it recommends for the backend; explicit options win; a backend with no measured
speed-up, or a call outside the recommendation's measured bounds (max_slots, min_new_tokens), stays on plain
decoding."""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import pytest

from hyspec_jax import cli, launch
from hyspec_jax.io import drafter_io
from hyspec_jax.spec import options
from hyspec_jax.embedded import default_budget_table, default_drafter_dir, default_model_dir
from hyspec_jax.io.hf import load_pretrained
from hyspec_jax.runtime import engine as E
from hyspec_jax.spec.budget import BudgetTable, b_ver, model_id
from hyspec_jax.spec.options import RECOMMENDED_FILE, plain_decoding_reason, recommended_settings

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
    assert eng.spec.tree.depth == 2 and eng.spec.width_margin == E.SpecConfig.width_margin
    eng = launch.engine_from_args(_args(argv=["--spec-mode", "tree", "--width-margin", "0"]), target, model_dir,
                                  jnp.float32)
    assert eng.spec.width_margin == 0.0
    with pytest.raises(ValueError, match="width_margin"):
        launch.engine_from_args(_args(argv=["--spec-mode", "tree", "--width-margin", "1.5"]), target, model_dir,
                                jnp.float32)
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


def test_shipped_table_gives_an_h100_server_its_round_times(monkeypatch, target):
    """The shipped table's H100 entries (`bench/results/budget/width_buckets_h100.md`) hold the GPU default's round
    (tree-ready, the wide tree, kernels auto) at every width: an H100 server up to 64 slots and a 1,024-token
    context chooses its width each round by default; a longer context has no covering entry (fixed width)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    h100 = type("Device", (), {"device_kind": "NVIDIA H100 80GB HBM3"})()
    monkeypatch.setattr(jax, "devices", lambda *a: [h100])
    eng = launch.engine_from_args(_args(), target, default_model_dir(), jnp.float32)
    assert eng.spec.mode == "tree-ready" and eng.spec.verify_nodes == 32
    for slots in (1, 4, 16, 32, 64):
        seconds = eng.round_seconds(slots, 1040)
        assert seconds is not None and sorted(seconds) == [1, 2, 4, 8, 16, 32], slots
    assert eng.round_seconds(64, 2064) is None and eng.round_seconds(128, 1040) is None


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
        if (m := rec.get("serve_max_slots")) is not None:        # a server: bounded by what the server measured
            assert launch.engine_from_args(_args(), target, model_dir, jnp.float32, batch=m, server=True) is not None
            assert launch.engine_from_args(_args(), target, model_dir, jnp.float32, batch=m + 1, server=True) is None


def test_plain_decoding_reason_bounds():
    rec = {"spec_mode": "tree-ready", "max_slots": 1, "min_new_tokens": 100}
    assert plain_decoding_reason({}) is not None                              # nothing measured
    assert plain_decoding_reason(rec, slots=1, new_tokens=100) is None
    assert "max_slots" in plain_decoding_reason(rec, slots=2, new_tokens=100)
    assert "99 new tokens < min_new_tokens 100" in plain_decoding_reason(rec, slots=1, new_tokens=99)
    assert plain_decoding_reason(rec, slots=1) is None                        # a server: no per-call bound
    del rec["min_new_tokens"]
    assert plain_decoding_reason(rec, slots=1, new_tokens=1) is None          # no field: today's behaviour
    rec["serve_max_slots"] = 32                                                # measured through the server
    assert plain_decoding_reason(rec, slots=32, server=True) is None
    assert "serve_max_slots 32" in plain_decoding_reason(rec, slots=33, server=True)
    assert "max_slots 1" in plain_decoding_reason(rec, slots=2)                # generate: max_slots


def _bounded(monkeypatch, **bounds) -> dict:
    """The CPU recommendation with its bounds replaced by `bounds` (the gate reads it through options)."""
    rec = {k: v for k, v in recommended_settings(default_drafter_dir(), "cpu").items()
           if k not in ("max_slots", "min_new_tokens")}
    assert rec, "the embedded drafter recommends a CPU mode"
    rec.update(bounds)
    monkeypatch.setattr(options, "recommended_settings", lambda drafter_dir, backend: dict(rec))
    return rec


def _no_drafter_load(*a, **kw):
    raise AssertionError("the drafter was loaded")


def test_recommendation_bounded_by_new_tokens(monkeypatch, target):
    """Below `min_new_tokens` new tokens in the call, no --spec-mode decodes plainly, says why, and never loads
    the drafter; at the bound the recommendation runs; an explicit --spec-mode runs below it too."""
    model_dir = default_model_dir()
    rec = _bounded(monkeypatch, min_new_tokens=100)
    eng = launch.engine_from_args(_args(), target, model_dir, jnp.float32, batch=1, new_tokens=100)
    assert eng is not None and eng.spec.mode == rec["spec_mode"]
    eng = launch.engine_from_args(_args(argv=["--spec-mode", rec["spec_mode"]]), target, model_dir, jnp.float32,
                                  batch=1, new_tokens=1)
    assert eng is not None and eng.spec.mode == rec["spec_mode"]
    assert eng.spec.verify_nodes == rec["verify_nodes"]        # the other options still come from the file
    assert launch.engine_from_args(_args(), target, model_dir, jnp.float32, batch=1) is not None   # serve: no bound
    notes = []
    monkeypatch.setattr(drafter_io, "load_drafter", _no_drafter_load)
    assert launch.engine_from_args(_args(), target, model_dir, jnp.float32, batch=1, new_tokens=99,
                                   note=notes.append) is None
    assert len(notes) == 1 and "99 new tokens < min_new_tokens 100" in notes[0]


def test_recommendation_without_min_new_tokens_keeps_speculating(monkeypatch, target):
    rec = _bounded(monkeypatch)
    eng = launch.engine_from_args(_args(), target, default_model_dir(), jnp.float32, batch=1, new_tokens=1)
    assert eng is not None and eng.spec.mode == rec["spec_mode"]


def test_generate_counts_the_whole_call(monkeypatch, tmp_path, capsys):
    """`hyspec generate` bounds max_tokens x prompts, runs plainly below the bound without loading the drafter,
    and says so in one stderr line; the JSON stats say ar."""
    _bounded(monkeypatch, min_new_tokens=5)
    monkeypatch.setattr(drafter_io, "load_drafter", _no_drafter_load)
    prompts = tmp_path / "p.txt"
    prompts.write_text("The cat\nA dog\n")
    assert cli.main(["generate", "--prompts-file", str(prompts), "--max-tokens", "2", "--json"]) == 0
    out, err = capsys.readouterr()
    assert [json.loads(line)["stats"]["mode"] for line in out.strip().splitlines()] == ["ar", "ar"]
    (line,) = [ln for ln in err.splitlines() if "min_new_tokens" in ln]
    assert line.startswith("[hyspec] mode ar (default: 4 new tokens < min_new_tokens 5")


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