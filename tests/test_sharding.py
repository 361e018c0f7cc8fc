"""The target over a (data, model) mesh of 4 fake CPU devices equals the single-device target: prefill, decode
steps and a tree verify, for the split (qwen3_5_text) and interleaved MoE (qwen3_next) layouts; the parameters
and state really are sharded where the rule table says so, and fall back to replication where not divisible."""

from __future__ import annotations

import functools
import os
import re
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from hyspec_jax import sharding as shd
from hyspec_jax import tree as tree_lib
from hyspec_jax.config import FULL, LINEAR, TargetConfig
from hyspec_jax.models.target import create_model, extend, verify
from hyspec_jax.state import init_state

B, T, S, STEPS = 4, 8, 32, 4
PROMPT_LENS = np.array([8, 5, 7, 3])
N_NODES = 8
TREES = [np.array([-1, 0, 0, 1, 1, 2, 3, 5]),          # one tree per slot (anchor = node 0), depth ≤ 3
         np.array([-1, 0, 1, 2, 0, 4]),
         np.array([-1, 0, 0, 0, 1, 2, 3, 4]),
         np.array([-1, 0, 1])]
MESHES = [(1, 4), (2, 2), (4, 1)]

# Compile time dominates this file (26 small programs); LLVM's optimisation level changes no semantics.
JIT_OPTS = dict(compiler_options={"xla_backend_optimization_level": 0})
QKV_OPT_IN = dict(shd.LOGICAL_AXIS_RULES, gdn_qkv=shd.MODEL)    # also split the [q | k | v] concatenations


def _cfg(model_type: str) -> TargetConfig:
    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=128, layer_types=(LINEAR, FULL),
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                  linear_value_head_dim=16)
    if model_type == "qwen3_next":
        return TargetConfig(model_type="qwen3_next", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            shared_expert_intermediate_size=64, mlp_only_layers=(1,), **common)
    return TargetConfig(model_type=model_type, **common)


def _params(cfg: TargetConfig, seed: int):
    """(graphdef, params) initialised on the host (numpy): no per-shape compiles of jax.random.

    Matrices are N(0, 0.02) as in create_model: larger random weights make this family ill-conditioned in
    fp32 (GatedRMSNorm over dv renormalises near-zero GDN outputs), so that even jit vs eager on ONE device
    differs by ~1e-4 and a 1e-5 bound would test rounding luck. Every vector gets distinct per-head /
    per-channel values (norms start all-0 / all-1 and dt_bias all-1, which would hide a permuted head)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: create_model(cfg)))
    rng = np.random.default_rng(seed)

    def init(path, x):
        name = shd._path_name(path)
        if name.endswith("A_log"):
            return np.log(rng.uniform(1, 16, x.shape)).astype(np.float32)
        if x.ndim == 1:
            base = 1.0 if name.endswith(("dt_bias", "linear_attn.norm.weight")) else 0.0
            return (base + 0.1 * rng.standard_normal(x.shape)).astype(np.float32)
        std = 0.3 if "conv1d" in name else 0.02
        return (std * rng.standard_normal(x.shape)).astype(np.float32)
    params = jax.tree_util.tree_map_with_path(init, abstract)
    return graphdef, jax.device_put(params)


def _no_mixing_logits(params, cfg: TargetConfig, toks: np.ndarray) -> np.ndarray:
    """embed -> final norm -> lm_head with every decoder layer skipped (what the layers must move away from)."""
    p = {shd._path_name(k): np.asarray(x) for k, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    x = p["model.embed_tokens.weight"][toks]
    x = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.rms_norm_eps) * (1 + p["model.norm.weight"])
    return x @ p["lm_head.weight"].T


def _inputs(cfg: TargetConfig):
    rng = np.random.default_rng(0)
    toks = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    valid = np.arange(T)[None] < PROMPT_LENS[:, None]
    decode = rng.integers(0, cfg.vocab_size, (STEPS, B, 1)).astype(np.int32)
    tree = tree_lib.pack_forest(TREES, tree_lib.TreeShape(N_NODES, 3), B)
    tree_toks = rng.integers(0, cfg.vocab_size, (B, N_NODES)).astype(np.int32)
    return toks, valid, decode, tree, tree_toks


def _run(exe, params, state, inputs):
    """prefill → STEPS decode steps → tree verify; returns every logits array, the final state and the cache."""
    prefill, decode_step, verify_fn = exe
    toks, valid, decode, tree, tree_toks = inputs
    outs = []
    logits, state = prefill(params, state, toks, valid)
    outs.append(np.where(valid[..., None], np.asarray(logits), 0))
    for t in range(STEPS):
        logits, state = decode_step(params, state, decode[t], np.ones((B, 1), bool))
        outs.append(np.asarray(logits))
    logits, cache = verify_fn(params, state, tree, tree_toks)
    outs.append(np.where(np.asarray(tree.valid)[..., None], np.asarray(logits), 0))
    return outs, state, cache


def _plan(cfg, graphdef, params, inputs, mesh_shape, axis_rules=shd.LOGICAL_AXIS_RULES):
    """Placed params, initial state and the three lowered programs for one mesh (None: one device)."""
    kw = dict(axis_rules=axis_rules)
    if mesh_shape is None:
        mesh, state = None, init_state(cfg, B, S)
        step = jax.jit(functools.partial(extend, graphdef), **JIT_OPTS)
        ver = jax.jit(functools.partial(verify, graphdef), **JIT_OPTS)
    else:
        mesh = shd.make_mesh(*mesh_shape)
        p_sh = shd.param_shardings(params, mesh, cfg, **kw)
        params = shd.shard_params(params, mesh, cfg, **kw)
        state = shd.init_state_sharded(cfg, B, S, mesh, **kw)
        st_sh = shd.state_shardings(cfg, state, mesh, **kw)
        step = shd.jit_extend(graphdef, mesh, p_sh, st_sh, **JIT_OPTS)
        ver = shd.jit_verify(graphdef, mesh, p_sh, st_sh, shd.cache_shardings(cfg, B, mesh, **kw), **JIT_OPTS)
    toks, valid, decode, tree, tree_toks = inputs
    lowered = [step.lower(params, state, toks, valid), step.lower(params, state, decode[0], np.ones((B, 1), bool)),
               ver.lower(params, state, tree, tree_toks)]
    return dict(mesh=mesh, params=params, state=state, lowered=lowered)


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_next"])
def case(request):
    assert jax.device_count() >= 4, ("needs 4 devices: run under tests/conftest.py "
                                     "(XLA_FLAGS=--xla_force_host_platform_device_count=4)")
    cfg = _cfg(request.param)
    graphdef, params = _params(cfg, seed=1)
    inputs = _inputs(cfg)
    plans = {ms: _plan(cfg, graphdef, params, inputs, ms) for ms in [None, *MESHES]}
    plans["qkv"] = _plan(cfg, graphdef, params, inputs, (1, 4), QKV_OPT_IN)
    plans["qkv"]["lowered"] = plans["qkv"]["lowered"][:1]                     # prefill only
    # XLA compiles dominate: run the 13 compiles on all cores (they release the GIL)
    lowered = [lo for p in plans.values() for lo in p["lowered"]]
    with ThreadPoolExecutor(max(2, min(4, os.cpu_count() or 1))) as pool:
        compiled = iter(list(pool.map(lambda lo: lo.compile(), lowered)))
    for p in plans.values():
        p["exe"] = [next(compiled) for _ in p["lowered"]]
    ref = _run(plans[None]["exe"], params, plans[None]["state"], inputs)
    assert all(np.isfinite(o).all() for o in ref[0])
    # the decoder layers (where the sharding acts) move the logits far more than the 1e-5 tolerance
    moved = np.abs(ref[0][1] - _no_mixing_logits(params, cfg, inputs[2][0])).max()
    assert moved > 1e-2, moved
    return cfg, plans, inputs, ref


def _shard_shape(x) -> tuple[int, ...]:
    shapes = {s.data.shape for s in x.addressable_shards}
    assert len(shapes) == 1 and len(x.addressable_shards) == 4
    return shapes.pop()


def _expected_param_shards(cfg: TargetConfig, m: int) -> dict[str, tuple[int, ...]]:
    """Hand-written: the shard shape of representative parameters on a mesh with model axis m."""
    kv = 32 if m == 4 else 32 // m             # 2 KV heads: sharded for m ≤ 2, replicated for m = 4
    out = {
        "model.embed_tokens.weight": (128 // m, 64),
        "lm_head.weight": (128 // m, 64),
        "model.norm.weight": (64,),
        "model.layers.1.self_attn.q_proj.weight": (128 // m, 64),
        "model.layers.1.self_attn.k_proj.weight": (kv, 64),
        "model.layers.1.self_attn.v_proj.weight": (kv, 64),
        "model.layers.1.self_attn.o_proj.weight": (64, 64 // m),
        "model.layers.0.linear_attn.A_log": (4 // m,),
        "model.layers.0.linear_attn.dt_bias": (4 // m,),
        "model.layers.0.linear_attn.out_proj.weight": (64, 64 // m),
        "model.layers.0.linear_attn.conv1d.weight": (128, 1, 4),                     # [q|k|v]: replicated
        "model.layers.1.mlp.gate_up_proj.weight": (256 // m, 64),                  # 128 gate/up row pairs
        "model.layers.1.mlp.down_proj.weight": (64, 128 // m),
        # both layouts: 2 key-head groups of 16 + 16 + 32 + 32 + 2 + 2 rows, whole groups for m ≤ 2, replicated
        # for m = 4
        "model.layers.0.linear_attn.in_proj.weight": (200 if m == 4 else 200 // m, 64),
    }
    if cfg.projection_layout == "interleaved":
        out.update({
            "model.layers.0.mlp.experts.gate_up_proj": (4 // m, 64, 64),
            "model.layers.0.mlp.experts.down_proj": (4 // m, 64, 32),
            "model.layers.0.mlp.gate.weight": (4, 64),
            "model.layers.0.mlp.shared_expert.gate_up_proj.weight": (128 // m, 64),
            "model.layers.0.mlp.shared_expert.down_proj.weight": (64, 64 // m),
        })
    return out


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_sharded_equals_single_device(case, mesh_shape):
    cfg, plans, inputs, (ref_logits, ref_state, ref_cache) = case
    d, m = mesh_shape
    plan = plans[mesh_shape]
    sparams, state = plan["params"], plan["state"]
    st_sh = shd.state_shardings(cfg, state, plan["mesh"])

    # the layout is the one the table promises (hand-written expectations, including the fallbacks)
    flat = {shd._path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(sparams)[0]}
    for name, shape in _expected_param_shards(cfg, m).items():
        assert _shard_shape(flat[name]) == shape, (name, mesh_shape)
    assert _shard_shape(state.ssm) == (1, B // d, 4 // m, 16, 16)
    assert _shard_shape(state.conv) == (1, B // d, 3, cfg.conv_dim)
    assert _shard_shape(state.keys) == (1, B // d, S, 2 if m == 4 else 2 // m, 16)
    assert _shard_shape(state.lengths) == (B // d,)

    logits, state, cache = _run(plan["exe"], sparams, state, inputs)

    names = ["prefill"] + [f"decode{t}" for t in range(STEPS)] + ["verify"]
    for name, got, want in zip(names, logits, ref_logits):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg=f"{name} {mesh_shape}")
    # state and commit factors: also relative (the log decays Γ reach |Γ| ~ 1e2; fp32 rounding alone is ~1e-5)
    for name in ("ssm", "conv", "keys", "values", "lengths"):
        np.testing.assert_allclose(getattr(state, name), getattr(ref_state, name), rtol=1e-5, atol=1e-5,
                                   err_msg=f"state.{name} {mesh_shape}")
        assert getattr(state, name).sharding.is_equivalent_to(getattr(st_sh, name), getattr(state, name).ndim)
    for got, want in zip(jax.tree.leaves(cache), jax.tree.leaves(ref_cache)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"tree cache {mesh_shape}")
    assert _shard_shape(cache.factors.corrected) == (1, B // d, 4 // m, N_NODES, 16)
    assert _shard_shape(cache.mask) == (B // d, N_NODES, N_NODES)


def test_qkv_concatenation_opt_in_is_still_exact(case):
    """Mapping `gdn_qkv` to "model" splits conv1d / the conv window across the q/k/v blocks:
    not the default (communication), but GSPMD must still give the same numbers."""
    cfg, plans, inputs, (ref_logits, _, _) = case
    plan = plans["qkv"]
    flat = {shd._path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(plan["params"])[0]}
    assert _shard_shape(flat["model.layers.0.linear_attn.conv1d.weight"]) == (cfg.conv_dim // 4, 1, 4)
    assert _shard_shape(plan["state"].conv) == (1, B, 3, cfg.conv_dim // 4)
    toks, valid = inputs[:2]
    logits, state = plan["exe"][0](plan["params"], plan["state"], toks, valid)
    np.testing.assert_allclose(np.where(valid[..., None], np.asarray(logits), 0), ref_logits[0], rtol=0, atol=1e-5)
    assert _shard_shape(state.conv) == (1, B, 3, cfg.conv_dim // 4)


def test_every_parameter_has_a_rule_and_specs_are_whole_units():
    mesh = shd.make_mesh(2, 2)
    for mt in ("qwen3_5_text", "qwen3_next"):
        cfg = _cfg(mt)
        model = nnx.eval_shape(lambda: create_model(cfg))
        specs = shd.describe(shd.param_shardings(model, mesh))
        assert len(specs) == len(jax.tree.leaves(nnx.state(model)))
        # at 2-way model parallel everything with whole units is sharded: only norms, router, [q|k|v] replicated
        replicated = {n for n, s in specs.items() if s == P()}
        assert all(re.search(r"norm|conv1d|mlp\.gate\.|shared_expert_gate", n) for n in replicated), \
            replicated


def test_fail_closed():
    cfg = _cfg("qwen3_next")
    mesh = shd.make_mesh(1, 4)
    with pytest.raises(shd.ShardingRuleError, match="no sharding rule"):
        shd.param_spec("model.layers.0.linear_attn.new_proj.weight", (8, 64), cfg, mesh)
    with pytest.raises(shd.ShardingRuleError, match="rank"):
        shd.param_spec("lm_head.weight", (128,), cfg, mesh)
    with pytest.raises(shd.ShardingRuleError, match="whole number"):     # 130 rows are not 4 whole heads
        shd.param_spec("model.layers.1.self_attn.q_proj.weight", (130, 64), cfg, mesh)
    # non-divisible units fall back to replication: 2 key-head groups / 2 KV heads over 4 devices, even
    # though the element counts alone would divide (200 % 4 == 32 % 4 == 0): units decide, not sizes
    assert shd.param_spec("model.layers.0.linear_attn.in_proj.weight", (200, 64), cfg, mesh) == P()
    # a fused MLP's rows are gate/up pairs: 6 pairs do not split over 4 devices though 12 rows would; an odd row
    # count is not whole pairs
    assert shd.param_spec("model.layers.1.mlp.gate_up_proj.weight", (12, 64), cfg, mesh) == P()
    assert shd.param_spec("model.layers.1.mlp.gate_up_proj.weight", (16, 64), cfg, mesh) == P("model")
    with pytest.raises(shd.ShardingRuleError, match="whole number"):
        shd.param_spec("model.layers.1.mlp.gate_up_proj.weight", (13, 64), cfg, mesh)
    assert shd.param_spec("model.layers.1.self_attn.k_proj.weight", (32, 64), cfg, mesh) == P()
    assert shd.param_spec("model.layers.1.self_attn.q_proj.weight", (128, 64), cfg, mesh) == P("model")
    # batch not divisible by "data" -> slots replicated
    odd = jax.eval_shape(lambda: init_state(cfg, 3, 8))
    assert shd.state_shardings(cfg, odd, shd.make_mesh(2, 2)).lengths.spec == P()
    # opting the [q|k|v] concatenation into "model" is possible (GSPMD stays correct; costs communication)
    rules = dict(shd.LOGICAL_AXIS_RULES, gdn_qkv=shd.MODEL)
    assert shd.param_spec("model.layers.0.linear_attn.conv1d.weight", (128, 1, 4), cfg, mesh,
                          axis_rules=rules) == P("model")
    with pytest.raises(TypeError, match="cfg"):
        shd.param_shardings(nnx.split(nnx.eval_shape(lambda: create_model(cfg)))[1], mesh)
    with pytest.raises(ValueError, match="devices"):
        shd.make_mesh(4, 2, devices=jax.devices()[:4])

