"""The fused projections: one GEMM for a GDN layer's in-projection and one for an MLP's gate/up.

The decoding step's weight products are counted in its jaxpr (every weight product is `layers.dense`, under the
named scope "dense"): a regression to one GEMM per checkpoint tensor (4 for a Qwen3.5 GDN in-projection, 2 for
Qwen3-Next's, 2 for gate/up) changes the count. The checkpoint mapping's parts are checked against the
module's own split of the fused output (`project`, the SwiGLU) and against the HF reading of each on-disk
tensor: every on-disk row numbered, so each row's place is visible.
"""

from __future__ import annotations

import functools

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hyspec_jax.config import FULL, LINEAR, TargetConfig
from hyspec_jax.io import layout
from hyspec_jax.models import layers
from hyspec_jax.models.target import abstract_model, extend
from hyspec_jax.state import init_state

COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
              head_dim=16, intermediate_size=48, layer_types=(LINEAR, LINEAR, LINEAR, FULL), linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
CONFIGS = {
    "qwen3_5-split": TargetConfig(model_type="qwen3_5_text", **COMMON),
    "qwen3_next-interleaved-moe": TargetConfig(model_type="qwen3_next", num_experts=4, num_experts_per_tok=2,
                                               moe_intermediate_size=16, shared_expert_intermediate_size=24, **COMMON),
}


def _eqns(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for v in e.params.values():
            for sub in v if isinstance(v, tuple | list) else (v,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from _eqns(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _eqns(sub)


@pytest.mark.parametrize("cfg", list(CONFIGS.values()), ids=list(CONFIGS))
def test_decoding_step_runs_one_gemm_per_fused_projection(cfg):
    # bf16 weights: XLA's dot on a CPU (the native fp32 kernel of `kernels.dense` would hide the products)
    model = abstract_model(cfg, jnp.bfloat16)                        # shapes only: traced, never run
    graphdef, params = nnx.split(model)
    step = jax.make_jaxpr(functools.partial(extend, graphdef))(
        params, jax.eval_shape(lambda: init_state(cfg, 1, 8, jnp.bfloat16)), jnp.zeros((1, 1), jnp.int32),
        jnp.ones((1, 1), bool))
    weights = [tuple(e.invars[1].aval.shape) for e in _eqns(step.jaxpr)
               if e.primitive.name == "dot_general" and str(e.source_info.name_stack).startswith("dense")]
    gdn = [layer.linear_attn for layer in model.model.layers if layer.is_linear]
    mlps = [m for _, m in nnx.iter_graph(model) if isinstance(m, layers.MLP)]
    n_attn = cfg.layer_types.count(FULL)
    n_moe = sum(isinstance(layer.mlp, layers.SparseMoe) for layer in model.model.layers)
    # per GDN layer: in_proj, out_proj; per attention layer: q, k, v, o; per MLP: gate_up, down; per sparse MoE
    # block: the router and the shared-expert gate (the routed experts are `moe.experts`' own products); LM head
    assert len(weights) == 2 * len(gdn) + 4 * n_attn + 2 * len(mlps) + 2 * n_moe + 1, weights
    assert weights.count(tuple(gdn[0].in_proj.weight.shape)) == len(gdn)
    assert sum(weights.count(s) for s in {tuple(m.gate_up_proj.weight.shape) for m in mlps}) == len(mlps)
    assert len(mlps) == len(cfg.layer_types)                         # a dense MLP or a shared expert per layer


def _unit_rows(rows: int, hidden: int) -> np.ndarray:
    """A weight whose row i has the single entry i + 1 (so x = e_0 reads each output as its row number + 1)."""
    w = np.zeros((rows, hidden), np.float32)
    w[:, 0] = np.arange(1, rows + 1)
    return w


@pytest.mark.parametrize("cfg", list(CONFIGS.values()), ids=list(CONFIGS))
def test_checkpoint_parts_land_where_project_reads_them(cfg):
    """Each on-disk GDN tensor, its rows numbered, loaded through the mapping: `project` returns q/k/v, z, b, a
    as those tensors' rows in the HF reading (split: qkv = in_proj_qkv's rows, z/b/a their tensors; interleaved:
    per key-head group [q|k|v|z] and [b|a])."""
    g = layers.GatedDeltaNet(cfg, rngs=nnx.Rngs(0))
    f = layout.fused_params(g)["in_proj.weight"]
    H, offset, tensors = cfg.hidden_size, 0, {}
    for part in f.parts:
        tensors[part.key] = _unit_rows(part.shape[0], H) + 1000 * offset    # distinct values across tensors
        offset += 1
    w = np.empty(f.shape, np.float32)
    for part in f.parts:
        layout.scatter(part, tensors[part.key], w)
    g.in_proj.weight.set_value(jnp.asarray(w))
    x = np.zeros((1, 1, H), np.float32)
    x[..., 0] = 1
    qkv, z, b, a = (np.asarray(t)[0, 0].reshape(-1) for t in g.project(jnp.asarray(x)))
    t = {k.rsplit(".", 2)[-2]: v[:, 0] for k, v in tensors.items()}
    hk, hv, dk, dv = g.hk, g.hv, g.dk, g.dv
    if cfg.projection_layout == "split":
        np.testing.assert_array_equal(qkv, t["in_proj_qkv"])
        np.testing.assert_array_equal(z, t["in_proj_z"])
        np.testing.assert_array_equal(b, t["in_proj_b"])
        np.testing.assert_array_equal(a, t["in_proj_a"])
    else:   # transformers' Qwen3-Next fix_query_key_value_ordering
        r = hv // hk
        qkvz = t["in_proj_qkvz"].reshape(hk, -1)
        q, k, v, zz = np.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
        np.testing.assert_array_equal(qkv, np.concatenate([q.ravel(), k.ravel(), v.ravel()]))
        np.testing.assert_array_equal(z, zz.ravel())
        bb, aa = np.split(t["in_proj_ba"].reshape(hk, -1), 2, axis=1)
        np.testing.assert_array_equal(b, bb.ravel())
        np.testing.assert_array_equal(a, aa.ravel())
    # and the save direction gives the tensors back
    for part in f.parts:
        np.testing.assert_array_equal(layout.gather(part, w), tensors[part.key])


def test_mlp_gate_and_up_rows_pair_up():
    """gate_proj / up_proj loaded through the mapping: the fused MLP is SiLU(gate x)·(up x) of those tensors."""
    H, I = 8, 6
    rng = np.random.default_rng(0)
    m = layers.MLP(H, I, rngs=nnx.Rngs(0))
    f = layout.fused_params(m)["gate_up_proj.weight"]
    assert [p.key for p in f.parts] == ["gate_proj.weight", "up_proj.weight"]
    gate, up = rng.standard_normal((2, I, H)).astype(np.float32)
    w = np.empty(f.shape, np.float32)
    for part, t in zip(f.parts, (gate, up)):
        layout.scatter(part, t, w)
    m.gate_up_proj.weight.set_value(jnp.asarray(w))
    m.down_proj.weight.set_value(jnp.eye(H, I, dtype=jnp.float32))
    x = rng.standard_normal((3, H)).astype(np.float32)
    silu = lambda v: v / (1 + np.exp(-v))        # noqa: E731
    np.testing.assert_allclose(np.asarray(m(jnp.asarray(x)))[:, :I], silu(x @ gate.T) * (x @ up.T), rtol=1e-5,
                               atol=1e-6)
    # each device of a split into whole pairs holds gate i next to up i
    np.testing.assert_array_equal(w[0::2], gate)
    np.testing.assert_array_equal(w[1::2], up)
