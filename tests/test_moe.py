"""Routed MoE (hyspec_jax/moe.py, models.layers.SparseMoe): every execution form against the dense computation
the model used before (a copy kept here as the reference) and against transformers' Qwen3-Next sparse block;
ties, renormalised or not, fp32 and bf16; gradients; the form rule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from hyspec_jax import moe
from hyspec_jax.io.hf import fill_params
from hyspec_jax.config import FULL, LINEAR, TargetConfig
from hyspec_jax.models.layers import SparseMoe

try:  # tests/ as a package (tests/__init__.py) or as a plain directory on sys.path
    from tests import hf_oracle as ho
except ImportError:
    import hf_oracle as ho

F32 = jnp.float32
E, K, H, I, SHARED = 8, 3, 32, 16, 24


# ------------------------------------------------------------------------------------------------
# The reference: the dense form as models/layers.py computed it before routing (verbatim math)
# ------------------------------------------------------------------------------------------------
def reference_experts(x, w_gu, w_d, combine):
    """x [T, H], combine [T, E] routing weights (zero for unchosen experts)."""
    gu = jnp.einsum("th,eoh->teo", x.astype(w_gu.dtype), w_gu, preferred_element_type=F32).astype(x.dtype)
    gate, up = jnp.split(gu, 2, axis=-1)
    h = jax.nn.silu(gate) * up
    y = jnp.einsum("tei,ehi->teh", h, w_d, preferred_element_type=F32).astype(x.dtype)
    return jnp.einsum("teh,te->th", y, combine.astype(y.dtype))


def reference_block(m: SparseMoe, x):
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    probs = jax.nn.softmax(m.gate(x).astype(F32), axis=-1)
    top_p, top_i = jax.lax.top_k(probs, m.top_k)
    if m.norm_topk:
        top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    top_p = top_p.astype(x.dtype)
    combine = jnp.zeros(probs.shape, x.dtype).at[jnp.arange(x.shape[0])[:, None], top_i].set(top_p)
    routed = reference_experts(x, m.experts.gate_up_proj[...], m.experts.down_proj[...], combine)
    shared = jax.nn.sigmoid(m.shared_expert_gate(x)) * m.shared_expert(x)
    return (routed + shared).reshape(shape)


# ------------------------------------------------------------------------------------------------
def config(norm_topk: bool = True, num_experts: int = E, top_k: int = K) -> TargetConfig:
    return TargetConfig(model_type="qwen3_next", vocab_size=16, hidden_size=H, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=32,
                        layer_types=(LINEAR, FULL), linear_num_key_heads=1, linear_num_value_heads=2,
                        linear_key_head_dim=8, linear_value_head_dim=8, num_experts=num_experts,
                        num_experts_per_tok=top_k, moe_intermediate_size=I, shared_expert_intermediate_size=SHARED,
                        norm_topk_prob=norm_topk)


def block(dtype, norm_topk: bool = True, seed: int = 0, router=None, num_experts: int = E) -> SparseMoe:
    """A SparseMoe with weights of unit-ish scale (so rounding, not tiny values, is what the tolerances see)."""
    m = SparseMoe(config(norm_topk, num_experts), dtype=dtype, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for path, p in nnx.to_flat_state(nnx.state(m, nnx.Param)):
        fan_in = p.get_value().shape[-1]
        p.set_value(jnp.asarray(rng.standard_normal(p.get_value().shape) / np.sqrt(fan_in), dtype))
    if router is not None:
        m.gate.weight.set_value(jnp.asarray(router, dtype))
    return m


def inputs(T: int, dtype, seed: int = 1):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((T, H)), dtype)


def as_fp32(m: SparseMoe) -> SparseMoe:
    """The same block with its (e.g. bf16) weights held in fp32: the bf16 forms' accuracy yardstick."""
    graphdef, params = nnx.split(m)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a.astype(F32) if a.dtype == jnp.bfloat16 else a, params))


def assert_close(out, ref, dtype, truth=None):
    """Equal up to accumulation order (fp32), or to a few bf16 roundings (bf16); in bf16 also as accurate as the
    reference against `truth`, the fp32 evaluation of the same weights and inputs (rms error within 1.5×; both
    are ~1 bf16 ulp, a wrong expert or weight is 10× that). Under jit XLA may keep an intermediate in fp32
    where the reference rounds it (xla_allow_excess_precision), so the gather form can land an ulp or two
    away from the reference, on either side of the truth."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert out.shape == ref.shape and np.isfinite(out).all()
    scale = np.max(np.abs(ref))
    tol = 2e-6 if dtype == jnp.float32 else 2.5 * 2 ** -7       # bf16: ulp(1) = 2^-7
    err = np.max(np.abs(out - ref)) / scale
    assert err < tol, (err, tol)
    if truth is not None:
        truth = np.asarray(truth, np.float64)
        rms = lambda a: np.sqrt(np.mean((a - truth) ** 2))
        assert rms(out) <= 1.5 * rms(ref) + 1e-7 * scale, (rms(out), rms(ref))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("norm_topk", [True, False], ids=["renorm", "no-renorm"])
@pytest.mark.parametrize("form", moe.FORMS)
def test_every_form_equals_the_dense_reference(form, norm_topk, dtype):
    m = block(dtype, norm_topk)
    for T in (1, 9):                     # T·k below and above E
        x = inputs(T, dtype, seed=T)
        ref = jax.jit(lambda x: reference_block(m, x))(x)      # both jitted, as the model runs
        out = jax.jit(lambda x: m(x, form=form))(x)
        assert out.dtype == dtype
        truth = reference_block(as_fp32(m), x.astype(F32)) if dtype == jnp.bfloat16 else None
        assert_close(out, ref, dtype, truth)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_forms_agree_on_leading_batch_dims_and_default_rule(dtype):
    m = block(dtype)
    x = inputs(2 * 5, dtype).reshape(2, 5, H)
    ref = reference_block(m, x)
    for form in (None, *moe.FORMS):
        assert_close(m(x, form=form), ref, dtype)
    # the default is exactly the form the rule names
    big = block(dtype, num_experts=4 * K)                       # E = 4k: gather for one row, dense for two
    x1 = inputs(1, dtype)
    assert moe.choose_form(1, 4 * K, K) == "gather"
    np.testing.assert_array_equal(np.asarray(big(x1)), np.asarray(big(x1, form="gather")))
    assert moe.choose_form(10, E, K) == "dense"
    np.testing.assert_array_equal(np.asarray(m(x)), np.asarray(m(x, form="dense")))


def test_choose_form_follows_the_measured_crossover():
    """gather while the T·k routes are at most E/4, dense above: at Qwen3-Next-80B's E=512, k=10 that is
    gather for decode B=1 and B=8 (10 and 80 routes), dense from B=32 (320) on — the H100 measurement in
    bench/results/moe/moe_scale_h100.md (gather 8.5× faster than dense at T=1, 2.4× at T=8, 1.4× slower at T=32)."""
    assert [moe.choose_form(T, 512, 10) for T in (1, 8, 12, 13, 32, 256)] == \
        ["gather", "gather", "gather", "dense", "dense", "dense"]
    assert moe.choose_form(1, 4, 1) == "gather" and moe.choose_form(2, 4, 1) == "dense"   # the boundary T·k = E/4
    assert moe.choose_form(1, 3, 1) == "dense"


@pytest.mark.parametrize("form", moe.FORMS)
def test_ties(form):
    """Equal router probabilities: all experts tied (zero router), and pairs of identical router rows, so
    top-k breaks ties by expert index — the same choice in every form and in the reference."""
    zero = np.zeros((E, H))
    pairs = np.random.default_rng(3).standard_normal((E, H)) / np.sqrt(H)
    pairs[5], pairs[6], pairs[1] = pairs[2], pairs[2], pairs[0]
    for router in (zero, pairs):
        for dtype in (jnp.float32, jnp.bfloat16):
            m = block(dtype, router=router)
            x = inputs(9, dtype)
            _, top_i = moe.route(m.gate(x), K, True)
            if router is zero:
                np.testing.assert_array_equal(np.asarray(top_i), np.tile(np.arange(K), (9, 1)))
            assert_close(m(x, form=form), reference_block(m, x), dtype)


def test_route_matches_the_reference_routing():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((11, E)), jnp.bfloat16)
    for norm in (True, False):
        top_p, top_i = moe.route(logits, K, norm)
        probs = jax.nn.softmax(logits.astype(F32), axis=-1)
        ref_p, ref_i = jax.lax.top_k(probs, K)
        if norm:
            ref_p = ref_p / ref_p.sum(-1, keepdims=True)
        np.testing.assert_array_equal(np.asarray(top_i), np.asarray(ref_i))
        np.testing.assert_array_equal(np.asarray(top_p), np.asarray(ref_p))
        assert top_p.dtype == F32 and top_i.dtype == jnp.int32


def test_unknown_form_is_a_clear_error():
    m = block(jnp.float32)
    with pytest.raises(ValueError, match="unknown MoE form 'sparse'"):
        m(inputs(2, jnp.float32), form="sparse")


@pytest.mark.parametrize("form", moe.FORMS)
def test_gradients_equal_the_dense_reference(form):
    """d(cᵀ out)/d(x, every weight) of each form equals the reference's (routing is piecewise constant, so the
    two differentiate the same function at a point away from ties)."""
    m = block(jnp.float32)
    x = inputs(13, jnp.float32)
    c = jnp.asarray(np.random.default_rng(5).standard_normal((13, H)), F32)
    graphdef, params = nnx.split(m, nnx.Param)

    def loss(params, x, f):
        mm = nnx.merge(graphdef, params)
        out = reference_block(mm, x) if f is None else mm(x, form=f)
        return jnp.sum(out * c)

    g_ref = jax.grad(loss, argnums=(0, 1))(params, x, None)
    g = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(params, x, form)
    for (p, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(g_ref), jax.tree_util.tree_leaves_with_path(g)):
        a, b = np.asarray(a), np.asarray(b)
        assert np.max(np.abs(a - b)) <= 1e-5 * max(np.max(np.abs(a)), 1e-6), jax.tree_util.keystr(p)
    # the expert weights really receive gradient, and only the chosen experts'
    gu = np.asarray(g[0]["experts"]["gate_up_proj"][...])
    _, top_i = moe.route(m.gate(x), K, True)
    used = np.zeros(E, bool)
    used[np.asarray(top_i).ravel()] = True
    assert (np.abs(gu[used]).sum((1, 2)) > 0).all() and (gu[~used] == 0).all()


# ------------------------------------------------------------------------------------------------
# Against transformers' Qwen3-Next sparse block (torch, CPU, fp32)
# ------------------------------------------------------------------------------------------------
def _torch_block(norm_topk: bool, num_experts: int, top_k: int):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    hf = ho.qwen3_next_config(hidden=H, num_experts=num_experts, top_k=top_k, moe_inter=I, shared_inter=SHARED,
                              norm_topk_prob=norm_topk)
    torch.manual_seed(0)
    t = Qwen3NextSparseMoeBlock(hf).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in t.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(p.shape[-1]))
    return t


@pytest.mark.parametrize("norm_topk", [True, False], ids=["renorm", "no-renorm"])
def test_every_form_matches_transformers(norm_topk):
    num_experts, top_k = 6, 2
    t = _torch_block(norm_topk, num_experts, top_k)
    m = SparseMoe(config(norm_topk, num_experts, top_k), dtype=jnp.float32, rngs=nnx.Rngs(0))
    # transformers' parameters by name (experts fused, the shared expert's gate/up fused by the checkpoint mapping)
    fill_params(m, {k: v.detach().numpy() for k, v in t.state_dict().items()}, "transformers", jnp.float32)
    x = np.random.default_rng(2).standard_normal((2, 5, H)).astype(np.float32)
    with torch.no_grad():
        ref = t(torch.from_numpy(x)).numpy()
    for form in (None, *moe.FORMS):
        out = np.asarray(m(jnp.asarray(x), form=form))
        assert np.max(np.abs(out - ref)) < 1e-5 * np.max(np.abs(ref)), form
