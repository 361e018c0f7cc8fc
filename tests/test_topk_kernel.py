"""The tree-level top-k kernel (pallas_kernels.topk) against lax.top_k + log-sum-exp, and the whole greedy tree
level (top-k, scores, kept beam) against its reference: interpret mode on CPU, the real kernels on a GPU; and the
greedy tree build through them equal to the pure-JAX build."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hyspec_jax.config import FULL, LINEAR, TargetConfig
from hyspec_jax.spec.select import tree_candidates
from hyspec_jax.tree import TreeExpansion
from hyspec_jax import kernels
from hyspec_jax.pallas_kernels import topk
from tests.tiny_drafter import tiny_draft_block

GPU = any(d.platform == "gpu" for d in jax.devices())
needs_gpu = pytest.mark.skipif(not GPU, reason="needs an NVIDIA GPU")


def _check(base, bias, k, interpret=True):
    ref = topk.biased_topk_reference(base, bias, k)
    got = topk.biased_topk_pallas(base, bias, k=k, interpret=interpret)
    assert [g.shape for g in got] == [r.shape for r in ref]
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(ref[1]))        # same children, same order
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(ref[0]))        # the logits themselves
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(ref[2]), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("B,W,V,k,seed", [(1, 1, 64, 8, 0), (2, 4, 256, 8, 1), (3, 2, 128, 5, 2), (1, 16, 512, 3, 3)])
def test_interpret_matches_reference(B, W, V, k, seed):
    r = np.random.default_rng(seed)
    base = jnp.asarray(r.standard_normal((B, V)) * 4, jnp.float32)
    bias = jnp.asarray(r.standard_normal((B, W, V)), jnp.float32)
    _check(base, bias, k)
    _check(base, None, k)
    _check(base.astype(jnp.bfloat16), bias, k)


def test_ties_and_minus_infinity_follow_lax_top_k():
    """Equal logits: the lower index first; fewer finite logits than k: the −inf ones by index, none twice."""
    row = [0.0, 1.0, 1.0, -np.inf, 1.0, 0.0] + [-np.inf] * 10
    base = jnp.asarray([row, row[::-1]], jnp.float32)
    _check(base, None, 8)
    _check(jnp.zeros((1, 16), jnp.float32), None, 6)            # all equal


def test_dispatch_fails_closed():
    base = jnp.zeros((1, 48), jnp.float32)                      # not a power of two
    ref = topk.biased_topk_reference(base, None, 4)
    got = kernels.biased_topk(base, None, 4, impl="auto")
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(ref[1]))
    with pytest.raises(ValueError, match="does not support"):
        kernels.biased_topk(base, None, 4, impl="interpret")
    if not GPU:
        with pytest.raises(ValueError, match="GPU"):
            kernels.biased_topk(jnp.zeros((1, 64)), None, 4, impl="pallas")


def test_greedy_tree_build_through_the_kernel_equals_the_reference():
    cfg_t = TargetConfig(
        model_type="qwen3_5_text", vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, intermediate_size=64, layer_types=(LINEAR, FULL, LINEAR),
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
    model, graphdef, params, blk, anchor = tiny_draft_block(cfg_t, seed=5, heads_seed=4, taps_seed=4)
    spec = TreeExpansion(depth=3, top_k=4, beam=8)
    build = lambda impl: jax.jit(lambda p, b, a: tree_candidates(nnx.merge(graphdef, p), b, a, spec,  # noqa: E731
                                                                  kernel_impl=impl))(params, blk, anchor)
    ref, got = build("reference"), build("interpret")
    for f in dataclasses.fields(ref):
        a, b = getattr(ref, f.name), getattr(got, f.name)
        if a is None:
            assert b is None
        elif f.name == "score":
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)
        else:
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=f.name)


def _level_inputs(B, L, W, V, seed, bias=True, dtype=jnp.float32):
    r = np.random.default_rng(seed)
    logits = jnp.asarray(np.round(r.standard_normal((B, L, V)) * 3, 1), dtype)       # rounded: tied logits
    b = jnp.asarray(np.round(r.standard_normal((B, W, V)), 1), dtype) if bias else None
    logrho = jnp.asarray(-np.abs(r.standard_normal((B, W))), jnp.float32)
    logscore = logrho - jnp.asarray(np.abs(r.standard_normal((B, W))) * (r.random((B, W)) < 0.5), jnp.float32)
    logscore = jnp.where(jnp.asarray(r.random((B, W)) < 0.8), logscore, -jnp.inf)     # invalid parents
    return logits, b, logrho, logscore


def _check_level(args, row, k, width, interpret=True, chunks=1):
    ref = topk.tree_level_reference(*args[:1], row, *args[1:], k=k, width=width)
    got = topk.tree_level_pallas(*args, row=row, k=k, width=width, chunks=chunks, interpret=interpret)
    names = ("token", "parent", "score", "rho")
    for name, g, r in zip(names, got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        if name in ("score", "rho"):       # the log-sum-exp of chunks: equal to rounding
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6, atol=1e-5, err_msg=name)
        else:
            np.testing.assert_array_equal(np.asarray(g), np.asarray(r), err_msg=name)


@pytest.mark.parametrize("B,W,V,k,width,chunks,seed", [(2, 1, 64, 4, 4, 1, 0), (3, 4, 128, 4, 8, 1, 1),
                                                       (1, 8, 256, 3, 8, 4, 2), (2, 2, 64, 8, 16, 2, 3),
                                                       (1, 4, 128, 2, 8, 1, 4)])
def test_tree_level_interpret_matches_reference(B, W, V, k, width, chunks, seed):
    """Invalid parents, capped scores, tied logits, fewer valid children than kept (−inf scores kept by index),
    chunked vocabularies, a bf16 bias and none."""
    args = _level_inputs(B, 3, W, V, seed)
    _check_level(args, 1, k, width, chunks=chunks)
    _check_level(_level_inputs(B, 3, W, V, seed, bias=False), 2, k, width, chunks=chunks)
    _check_level(_level_inputs(B, 3, W, V, seed, dtype=jnp.bfloat16), 0, k, width, chunks=chunks)


def test_tree_level_dispatch_fails_closed():
    args = _level_inputs(1, 2, 3, 64, 0)                        # a beam of 3: not a Triton block shape
    ref = topk.tree_level_reference(args[0], 0, *args[1:], k=4, width=4)
    got = kernels.tree_level(args[0], 0, *args[1:], k=4, width=4, impl="auto")
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(ref[0]))
    with pytest.raises(ValueError, match="does not support"):
        kernels.tree_level(args[0], 0, *args[1:], k=4, width=4, impl="interpret")
    # more children than one program ranks all against all (64 beam rows of 8): XLA's level
    assert topk.level_supported((1, 2, 8192), 0, None, 32, 8, 16)
    assert not topk.level_supported((1, 2, 8192), 0, None, 64, 8, 16)


@needs_gpu
@pytest.mark.parametrize("W,width,chunks", [(1, 8, 8), (16, 16, 8), (16, 16, 1), (32, 32, 8)])
def test_gpu_tree_level_matches_reference(W, width, chunks):
    _check_level(_level_inputs(4, 7, W, 8192, W + chunks, dtype=jnp.bfloat16), 3, 8, width, interpret=False,
                 chunks=chunks)


@needs_gpu
@pytest.mark.parametrize("W,V,k", [(1, 8192, 8), (16, 8192, 8), (16, 16384, 8)])
def test_gpu_matches_reference(W, V, k):
    r = np.random.default_rng(W + V)
    _check(jnp.asarray(r.standard_normal((2, V)), jnp.float32), jnp.asarray(r.standard_normal((2, W, V)),
                                                                             jnp.float32), k, interpret=False)


def test_bench_topk_interpret(tmp_path):
    """`hyspec bench topk --interpret` checks every tiling against XLA and writes its JSON and table."""
    from hyspec_jax import cli
    out = tmp_path / "topk.json"
    assert cli.main(["bench", "topk", "--json", str(out), "--interpret", "--vocab", "256", "--rows", "1", "2",
                     "--k", "4", "--tilings", "1:4", "4:2", "8:4"]) == 0
    rep = json.loads(out.read_text())
    assert len(rep["rows"]) == 2 * 4 and all(r["equal"] for r in rep["rows"])
    assert "| 2 | **pallas 8x4** |" in out.with_suffix(".md").read_text()     # the dispatcher's choice


def test_bench_topk_level_interpret(tmp_path):
    """`hyspec bench topk --level --interpret` checks a whole level, kernel pair against XLA."""
    from hyspec_jax import cli
    out = tmp_path / "level.json"
    assert cli.main(["bench", "topk", "--level", "--json", str(out), "--interpret", "--vocab", "256", "--rows", "4",
                     "--batch", "1", "2", "--k", "4", "--width", "8"]) == 0
    rep = json.loads(out.read_text())
    assert [(r["batch"], r["variant"]) for r in rep["rows"]] == [(1, "xla"), (1, "pallas"), (2, "xla"),
                                                                  (2, "pallas")]
    assert all(r["equal"] for r in rep["rows"])
    assert "| 2 | 4 | pallas |" in out.with_suffix(".md").read_text()
