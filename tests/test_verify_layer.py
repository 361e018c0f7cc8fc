"""The fused GDN verify layer ([verify-fast] item 4): `kernels.verify_layer` runs the tree's conv, the gates, the q/k
l2norm and the tree solve in one launch (`gdn_tree_solve.verify_layer_pallas`) and must equal `gdn.tree_inputs`
followed by the reference solve — in Pallas interpret mode on CPU, for the kernel call and for the model's verify —
and lower for an H100 as one Triton kernel that every GDN layer of a verify calls."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hyspec_jax import gdn, kernels
from hyspec_jax import tree as tree_lib
from hyspec_jax.models.target import create_model, scan_layers, verify_layer_call
from hyspec_jax.pallas_kernels import gdn_tree_solve
from hyspec_jax.spec.memory import qwen38_27b
from hyspec_jax.state import init_state
from tests.gpu_lowering import calls_of_the_kernels_function, dispatch_as_on_a_gpu, lower_for_h100, triton_kernels
from tests.test_decode_kernel import _model_cfg
from tests.test_verify_inputs import _calls_of

CFG = _model_cfg()      # GDN heads the kernel tiles (16 × 16), two value heads a key head, two GDN layers


def _fused_calls(monkeypatch) -> list:
    """Records each launch of the fused kernel."""
    seen, real = [], gdn_tree_solve.verify_layer_pallas

    def spy(*a, **kw):
        seen.append(kw)
        return real(*a, **kw)

    monkeypatch.setattr(gdn_tree_solve, "verify_layer_pallas", spy)
    return seen


def _close(got, want, rtol):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * max(1.0, float(np.abs(b).max())))


@pytest.mark.parametrize("nodes,depth,layer", [(6, 3, 0), (20, 9, 1)])
def test_fused_layer_equals_conv_gates_and_reference_solve(monkeypatch, nodes, depth, layer):
    """A bf16 model's verify layer: the kernel (one launch, a node count under and over the 16-node tile, each layer
    of the stacks) equals XLA's conv and gates (`gdn.tree_inputs`) and the reference solve — o, Γ, V' and the
    normalised keys the commit takes."""
    call = verify_layer_call(CFG, 2, nodes, depth=depth, dtype=jnp.bfloat16, seed=nodes, layer=layer)
    seen = _fused_calls(monkeypatch)
    want = kernels.verify_layer(*call.args, **call.kwargs, impl="reference")
    got = kernels.verify_layer(*call.args, **call.kwargs, impl="interpret")
    assert len(seen) == 1
    _close(got, want, 2e-5)


def test_fused_layer_merges_pending_rows(monkeypatch):
    """With deferred updates the fused kernel folds them into its state tile, as the reference folds them first."""
    call = verify_layer_call(CFG, 2, 8, depth=4, dtype=jnp.bfloat16, seed=3, layer=1)
    B, HV, dk, dv = call.S0.shape[1:]
    P = 16
    ks = jax.random.split(jax.random.key(5), 3)
    pend = gdn.DeferredUpdates(
        log_decay=-0.3 * jnp.ones((B, HV)), row_decay=-0.1 * jnp.arange(P, dtype=jnp.float32)[None, None] * jnp.ones(
            (B, HV, 1)),
        keys=jnp.repeat(gdn.l2norm(jax.random.normal(ks[0], (B, call.key_heads, P, dk))), HV // call.key_heads, 1),
        values=jax.random.normal(ks[1], (B, HV, P, dv)),                   # keys shared in a value-head group
        count=jnp.asarray([3, 7], jnp.int32))
    seen = _fused_calls(monkeypatch)
    want = kernels.verify_layer(*call.args, **call.kwargs, impl="reference", deferred=pend)
    got = kernels.verify_layer(*call.args, **call.kwargs, impl="interpret", deferred=pend)
    assert len(seen) == 1
    _close(got, want, 2e-5)


def test_fp32_models_keep_the_split_form(monkeypatch):
    """An fp32 model's verify takes fp32-accurate products, whose form is the split one (`auto_method`): nothing is
    fused, and the kernel path still equals the reference."""
    call = verify_layer_call(CFG, 1, 6, depth=3, dtype=jnp.float32, seed=1)
    seen = _fused_calls(monkeypatch)
    got = kernels.verify_layer(*call.args, **call.kwargs, impl="interpret")
    assert not seen
    _close(got, kernels.verify_layer(*call.args, **call.kwargs, impl="reference"), 1e-5)


def test_fused_layer_gradient_is_the_references():
    """The fused path's backward is the reference's VJP (as `tree_solve`'s kernel path): gradients through it equal
    the reference's."""
    call = verify_layer_call(CFG, 1, 6, depth=3, dtype=jnp.bfloat16, seed=2)

    def loss(S0, qkv, impl):
        stream = call.stream._replace(qkv=qkv)
        o, fac = kernels.verify_layer(S0, call.window, stream, *call.args[3:], **call.kwargs, impl=impl)
        return jnp.sum(o ** 2) + jnp.sum(fac.corrected)

    qkv = call.stream.qkv.astype(jnp.float32).astype(jnp.bfloat16)
    got = jax.grad(loss, argnums=(0, 1))(call.S0, qkv, "interpret")
    want = jax.grad(loss, argnums=(0, 1))(call.S0, qkv, "reference")
    _close(got, want, 1e-4)


def test_layer_call_is_the_verifys_call():
    """`verify_layer_call` (the fused layer's benchmark and lowering inputs) is what the unrolled verify hands
    `kernels.verify_layer`: shapes and dtypes, the state and window stacks with each layer's index."""
    B, N, depth = 2, 6, 3
    dtype = jnp.bfloat16
    graphdef, params = nnx.split(create_model(CFG, seed=0, dtype=dtype))
    rng = np.random.default_rng(1)
    tree = tree_lib.pack_forest([tree_lib.random_parents(rng, N, depth, min_depth=depth) for _ in range(B)],
                                tree_lib.TreeShape(N, depth))
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, N)), jnp.int32)
    calls = _calls_of("verify_layer", lambda: jax.eval_shape(
        lambda p, s: nnx.merge(graphdef, p).verify(s, tree, tokens, kernel_impl="auto"), params,
        init_state(CFG, B, 16, dtype)))
    want = verify_layer_call(CFG, B, N, depth=depth, dtype=dtype)
    names = ("S0", "window", "stream", "conv_weight", "A_log", "dt_bias", "mask")
    assert len(calls) == len(CFG.gdn_layers)
    for got in calls:
        for name, arr in zip(names, want.args):
            shapes = lambda t: jax.tree.map(lambda x: (x.shape, jnp.dtype(x.dtype)), t)   # noqa: E731
            assert shapes(got[name]) == shapes(arr), name
        for key, value in want.kwargs.items():
            if key != "layer":
                assert got[key] == value, key
    assert [c["layer"] for c in calls] == list(range(len(CFG.gdn_layers)))


@pytest.mark.parametrize("scanned", [False, True])
def test_models_verify_on_the_fused_kernel_equals_the_reference(monkeypatch, scanned):
    """A bf16 model's verify through the fused kernel (interpret mode; unrolled: the stacks read at each layer's
    index, scanned: the layer's own state and window) gives the reference verify's logits and commit factors."""
    cfg = _model_cfg()
    model = create_model(cfg, seed=0, dtype=jnp.bfloat16)
    if scanned:
        model = scan_layers(model)
    graphdef, params = nnx.split(model)
    B, N, depth = 2, 7, 4
    rng = np.random.default_rng(3)
    tree = tree_lib.pack_forest([tree_lib.random_parents(rng, N, depth, min_depth=depth) for _ in range(B)],
                                tree_lib.TreeShape(N, depth))
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, N)), jnp.int32)
    state = init_state(cfg, B, 16, jnp.bfloat16)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, 5)), jnp.int32)
    state = nnx.merge(graphdef, params).extend(state, prompt, jnp.ones((B, 5), bool), kernel_impl="reference")[2]
    seen = _fused_calls(monkeypatch)

    def run(impl):
        return nnx.merge(graphdef, params).verify(state, tree, tokens, kernel_impl=impl)

    got, want = run("interpret"), run("reference")
    assert len(seen) == (1 if scanned else len(cfg.gdn_layers))       # scanned: the block is traced once
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), atol=3e-2)   # bf16 activations
    _close(got[2].factors.log_decay, want[2].factors.log_decay, 1e-2)


@pytest.mark.parametrize("batch,nodes", [(1, 8), (1, 32), (8, 8), (8, 32), (32, 8)])
def test_fused_layer_lowers_for_an_h100_at_the_27b_geometry(monkeypatch, batch, nodes):
    """The verify's GDN layer as the dispatcher launches it on an H100 at the 27B geometry (`verify_layer_call`) is
    one Triton kernel, the fused one."""
    cfg = qwen38_27b()
    depth = min(8, nodes - 1)
    kwargs = verify_layer_call(cfg, 1, nodes, depth=depth).kwargs
    args = jax.eval_shape(lambda: verify_layer_call(cfg, batch, nodes, depth=depth).args)
    dispatch_as_on_a_gpu(monkeypatch)
    text = lower_for_h100(lambda *a: kernels.verify_layer(*a, **kwargs), *args)
    assert len(triton_kernels(text)) == 1 and "gdn_verify_layer_" in text


def test_every_gdn_layer_of_a_verify_runs_one_fused_kernel(monkeypatch):
    """A bf16 model's verify lowered for an H100: every GDN layer calls the same fused kernel (the layer's index an
    operand), and no other GDN kernel runs."""
    cfg = _model_cfg()
    graphdef, params = nnx.split(create_model(cfg, seed=0, dtype=jnp.bfloat16))
    params = jax.eval_shape(lambda: params)
    dispatch_as_on_a_gpu(monkeypatch)
    B, N, depth = 2, 8, 4
    rng = np.random.default_rng(0)
    tree = tree_lib.pack_forest([tree_lib.random_parents(rng, N, depth, min_depth=depth) for _ in range(B)],
                                tree_lib.TreeShape(N, depth))
    text = lower_for_h100(lambda p, s, t: nnx.merge(graphdef, p).verify(s, tree, t, kernel_impl="auto")[0], params,
                          jax.eval_shape(lambda: init_state(cfg, B, 16, jnp.bfloat16)),
                          jax.ShapeDtypeStruct((B, N), jnp.int32))
    gdn_kernels = [k for k in triton_kernels(text) if 'name = "gdn_' in k]
    assert len(gdn_kernels) == 1 and 'name = "gdn_verify_layer_' in gdn_kernels[0]
    assert calls_of_the_kernels_function(text, "gdn_verify_layer_") == len(cfg.gdn_layers) == 2


@pytest.mark.skipif(not kernels.gpu_kernels_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("batch,nodes", [(1, 8), (8, 32)])
def test_fused_layer_on_a_gpu_equals_the_unfused_kernel_and_the_reference(batch, nodes):
    """GPU twin at the 27B geometry: the fused kernel gives what XLA's conv and gates with the unfused solve kernel
    give (the same one-pass tf32 products), and the fp32 reference within their error."""
    cfg = qwen38_27b()
    call = verify_layer_call(cfg, batch, nodes, depth=min(8, nodes - 1), layer=3)
    got = kernels.verify_layer(*call.args, **call.kwargs, impl="pallas")
    q, k, v, g, beta = gdn.tree_inputs(call.stream, call.window[call.layer], call.conv_weight, call.A_log,
                                       call.dt_bias, key_heads=call.key_heads, key_dim=call.key_dim)
    unfused = kernels.tree_solve(call.S0, q, k, v, g, beta, call.mask, call.path_nodes, impl="pallas",
                                 compute_dtype=call.compute_dtype, layer=call.layer)
    want = kernels.verify_layer(*call.args, **call.kwargs, impl="reference")
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))          # noqa: E731
    assert rel(got[1].keys, want[1].keys) < 1e-5 and rel(got[1].log_decay, want[1].log_decay) < 1e-5
    assert rel(got[0], unfused[0]) < 1e-4 and rel(got[1].corrected, unfused[1].corrected) < 1e-4
    assert rel(got[0], want[0]) < 5e-3 and rel(got[1].corrected, want[1].corrected) < 5e-3
