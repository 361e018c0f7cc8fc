"""The kernel benchmarks time the tree solve on what the model runs ([verify-fast] item 1): `verify_solve_call` (the
one source of the benchmarks' inputs) forms the same call of `kernels.tree_solve` as `TargetModel.verify` makes —
shapes, dtypes, key-head layout (no value-head copies), path_nodes and the compute dtype that picks the kernel's
operands and precision. If the verify's GDN path changes what it hands the dispatcher, this fails until the helper
(and so every benchmark) follows."""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hyspec_jax import gdn, kernels
from hyspec_jax import tree as tree_lib
from hyspec_jax.config import FULL, LINEAR, TargetConfig
from hyspec_jax.models.target import create_model, decode_step_call, verify_solve_call
from hyspec_jax.state import init_state

# two value heads per key head, so an expansion to value heads would show in the shapes
TCFG = TargetConfig(
    model_type="qwen3_5_text", vocab_size=48, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, intermediate_size=64, layer_types=(LINEAR, FULL),
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
ARGS = ("S0", "q", "k", "v", "g", "beta", "mask")


def _verify_calls(dtype, B: int, N: int, depth: int) -> list[dict]:
    """Every `kernels.tree_solve` call of one traced verify (abstract: nothing runs), its arguments by name; with
    kernel_impl "auto", as the engine's rounds run it (spec/round.py)."""
    graphdef, params = nnx.split(create_model(TCFG, seed=0, dtype=dtype))
    rng = np.random.default_rng(1)
    tree = tree_lib.pack_forest([tree_lib.random_parents(rng, N, depth, min_depth=depth) for _ in range(B)],
                                tree_lib.TreeShape(N, depth))
    tokens = jnp.asarray(rng.integers(0, TCFG.vocab_size, (B, N)), jnp.int32)
    return _calls_of("tree_solve", lambda: jax.eval_shape(
        lambda p, s: nnx.merge(graphdef, p).verify(s, tree, tokens, kernel_impl="auto"), params,
        init_state(TCFG, B, 16, dtype)))


def _calls_of(name: str, run) -> list[dict]:
    """Every call of `kernels.<name>` while run() traces a model entry point, its arguments by name (defaults in)."""
    calls, real = [], getattr(kernels, name)
    signature = inspect.signature(real)

    def spy(*args, **kw):
        bound = signature.bind(*args, **kw)
        bound.apply_defaults()
        calls.append(dict(bound.arguments))
        return real(*args, **kw)

    setattr(kernels, name, spy)
    try:
        run()
    finally:
        setattr(kernels, name, real)
    return calls


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_bench_call_is_the_verify_call(dtype):
    B, N, depth = 2, 6, 3
    calls = _verify_calls(dtype, B, N, depth)
    assert len(calls) == len(TCFG.gdn_layers)
    want = verify_solve_call(TCFG, B, N, depth=depth, dtype=dtype, seed=0)
    for got in calls:
        for name, arr in zip(ARGS, want.args):
            assert (got[name].shape, got[name].dtype) == (arr.shape, arr.dtype), name
        assert got["path_nodes"] == want.path_nodes
        assert jnp.dtype(got["compute_dtype"]) == want.compute_dtype == jnp.dtype(dtype)
        assert got["deferred"] is None
    # the unrolled verify hands over the whole state stack and each GDN layer's own row of it
    assert [c["layer"] for c in calls] == list(range(len(TCFG.gdn_layers)))
    assert want.S0.shape[0] == len(TCFG.gdn_layers) and want.layer == 0
    # key heads, never a copy per value head; the kernel's operands and precision follow the model's dtype
    assert want.q.shape[2] == want.k.shape[2] == TCFG.linear_num_key_heads < want.v.shape[2]
    operands, precision = kernels.verify_operands(dtype)
    assert precision == ("tf32x3" if jnp.dtype(dtype) == jnp.float32 else "tf32")
    assert operands == jnp.float32 == want.q.dtype == want.k.dtype == want.v.dtype      # the mixer's, uncast


def test_bench_call_values_are_the_mixers():
    """The helper's q, k, v, g, β are `gdn.mixer_inputs` of its stream (the GatedDeltaNet path), and its mask is
    the ancestor mask of its parents."""
    call = verify_solve_call(TCFG, 2, 6, depth=3, dtype=jnp.float32, seed=4)
    s = call.stream
    valid = s.parent > -2
    want = gdn.mixer_inputs(s.conv_out, s.b, s.a, valid, s.A_log, s.dt_bias, key_heads=TCFG.linear_num_key_heads,
                            key_dim=TCFG.linear_key_head_dim)
    for got, ref in zip(call.args[1:6], want):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    for b in range(2):
        for i in range(6):
            path, j = {i}, int(s.parent[b, i])
            while j >= 0:
                path.add(j)
                j = int(s.parent[b, j])
            assert set(np.flatnonzero(np.asarray(call.mask[b, i]))) == path


def test_kernel_bench_sets_are_the_dispatchers_operands():
    """bench/kernels.py's input sets are the helper's call as the dispatcher hands it to the kernel."""
    from hyspec_jax.bench import kernels as bench_kernels

    S0, q, k, v, g, beta = bench_kernels.make_set(0, 1, 16)
    call = verify_solve_call(bench_kernels.GEOMETRY, 1, 16, depth=bench_kernels.DEPTH_FOR_N[16] - 1,
                             dtype=jnp.bfloat16, seed=0)
    operands, _ = kernels.verify_operands(jnp.bfloat16)
    for got, ref in zip((S0, q, k, v, g, beta), (call.S0[call.layer], *call.args[1:6])):
        assert got.shape == ref.shape
    assert q.dtype == k.dtype == operands
    want_q, want_k, want_v, _ = kernels.kernel_operands(call.q, call.k, call.v, jnp.bfloat16)
    for got, want in ((q, want_q), (k, want_k), (v, want_v)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_bench_call_is_the_decoding_steps_call(dtype):
    """`decode_step_call` (the decode benchmarks' inputs) is what a decoding step hands `kernels.gdn_decode_layer`:
    the in-projection's output row as it is, and the layer's gated norm."""
    B = 3
    graphdef, params = nnx.split(create_model(TCFG, seed=0, dtype=dtype))
    calls = _calls_of("gdn_decode_layer", lambda: jax.eval_shape(
        lambda p, s: nnx.merge(graphdef, p).extend(s, jnp.zeros((B, 1), jnp.int32), jnp.ones((B, 1), bool)),
        params, init_state(TCFG, B, 16, dtype)))
    assert len(calls) == len(TCFG.gdn_layers)
    want = decode_step_call(TCFG, B, dtype=dtype)
    names = ("proj", "window", "conv_weight", "A_log", "dt_bias", "S", "valid")
    for got in calls:
        for name, arr in zip(names, want.args):
            assert (got[name].shape, got[name].dtype) == (arr.shape, arr.dtype), name
        assert (got["key_heads"], got["key_dim"]) == (want.key_heads, want.key_dim)
        assert (got["norm"].weight.shape, got["norm"].weight.dtype) == (want.norm.weight.shape, want.norm.weight.dtype)
        assert got["norm"].eps == want.norm.eps == TCFG.rms_norm_eps
        assert got["impl"] == "auto" and got["tiling"] is None
    # the unrolled model hands over the whole state stack and each GDN layer's own row of it (stepped in place)
    assert [c["layer"] for c in calls] == list(range(len(TCFG.gdn_layers)))
    assert want.S.shape[0] == len(TCFG.gdn_layers) and want.layer == 0


def test_operand_policy_is_the_kernel_paths_only(monkeypatch):
    """The dispatcher hands the *kernel* the policy's operands; where the reference runs (here: a CPU), it gets the
    mixer's fp32 inputs as they are, whatever the policy."""
    cfg = dataclasses.replace(TCFG, linear_key_head_dim=16, linear_value_head_dim=16)    # heads the kernel tiles
    call = verify_solve_call(cfg, 2, 6, depth=3, dtype=jnp.bfloat16, seed=2)
    monkeypatch.setitem(kernels.VERIFY_OPERANDS, jnp.dtype(jnp.bfloat16), (jnp.dtype(jnp.bfloat16), "tf32"))
    want = kernels.tree_solve(*call.args, call.path_nodes, impl="reference", layer=call.layer)
    got = kernels.tree_solve(*call.args, **call.kwargs, impl="auto")
    if not any(d.platform == "gpu" for d in jax.devices()):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    kern = kernels.tree_solve(*call.args, **call.kwargs, impl="interpret")     # the kernel: bf16 operands
    assert kern[1].keys.dtype == jnp.bfloat16
    err = float(jnp.linalg.norm(kern[0] - want[0]) / jnp.linalg.norm(want[0]))
    assert 1e-5 < err < 3e-2
