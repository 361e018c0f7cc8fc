"""Each kernel the model launches in a decoding step and a verify lowers to Triton IR for an H100, on CPU, at the
Qwen3.8-27B geometry and from the calls the model makes (`target.decode_step_call`, `target.verify_solve_call`),
through the dispatchers as they choose on a GPU (tests/gpu_lowering.py: what this covers and what it does not)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from hyspec_jax import gdn, kernels
from hyspec_jax.models.target import decode_step_call, verify_solve_call
from hyspec_jax.spec.memory import qwen38_27b
from tests.gpu_lowering import calls_of_the_kernels_function, dispatch_as_on_a_gpu, lower_for_h100, triton_kernels

TRITON = "custom_call @__gpu$xla.gpu.triton"


@pytest.mark.parametrize("batch", [1, 8, 32])
@pytest.mark.parametrize("tiling", [None, (32, 1), (64, 1)])
def test_decode_kernel_lowers_for_an_h100_at_the_27b_geometry(monkeypatch, batch, tiling):
    """The decoding step's kernel as the dispatcher launches it in the model (the 27B layer's call,
    `target.decode_step_call`; the default tiling applies the norm inside the kernel, the narrower ones leave it to
    XLA) lowers to Triton IR for an H100 — on CPU, without allocating the call's arrays."""
    cfg = qwen38_27b()
    args = jax.eval_shape(lambda: decode_step_call(cfg, batch).args)             # shapes only: nothing allocated
    norm = gdn.OutputNorm(jnp.ones((cfg.linear_value_head_dim,), jnp.bfloat16), cfg.rms_norm_eps)
    dispatch_as_on_a_gpu(monkeypatch)

    def step(*args):                      # the norm's eps a Python float, as the module holds it
        return kernels.gdn_decode_layer(*args, norm=norm, key_heads=cfg.linear_num_key_heads,
                                        key_dim=cfg.linear_key_head_dim, layer=0, tiling=tiling)

    text = lower_for_h100(step, *args)
    block_v = (tiling or kernels.gdn_decode_tiling(batch, cfg.linear_num_value_heads, cfg.linear_value_head_dim,
                                                   True))[0]
    grid = (batch, cfg.linear_num_value_heads, cfg.linear_value_head_dim // block_v)
    assert text.count(TRITON) == 1, text[:2000]
    assert "grid_x = {} : i32, grid_y = {} : i32, grid_z = {} : i32".format(*grid) in text


@pytest.mark.parametrize("batch,nodes", [(1, 8), (1, 32), (8, 8), (8, 32), (32, 8)])
def test_tree_solve_lowers_for_an_h100_at_the_27b_geometry(monkeypatch, batch, nodes):
    """The verify's tree solve as the dispatcher picks it on an H100 (`kernels.tree_solve`, method auto, the
    model's compute dtype) lowers for an H100: one kernel launch."""
    cfg = qwen38_27b()
    depth = min(8, nodes - 1)
    kwargs = verify_solve_call(cfg, 1, nodes, depth=depth).kwargs                 # static: from the tree's shape
    args = jax.eval_shape(lambda: verify_solve_call(cfg, batch, nodes, depth=depth).args)
    dispatch_as_on_a_gpu(monkeypatch)
    monkeypatch.setattr(kernels, "hopper_available", lambda: True)
    text = lower_for_h100(lambda *a: kernels.tree_solve(*a, **kwargs), *args)
    assert text.count(TRITON) == 1, text[:2000]


def test_every_layer_of_a_decoding_step_runs_one_triton_kernel(monkeypatch):
    """The model's decoding step (unrolled, each GDN layer stepping its rows of the state stack) launches the decode
    kernel once a GDN layer, and every launch is the same Triton kernel: the layer's index is an operand (a static
    index made each layer's kernel different code, each compiled on its own)."""
    from flax import nnx

    from hyspec_jax.models.target import abstract_model
    from hyspec_jax.state import init_state
    from tests.test_decode_kernel import _model_cfg

    cfg = _model_cfg()
    graphdef, params = nnx.split(abstract_model(cfg, jnp.bfloat16))          # shapes only
    dispatch_as_on_a_gpu(monkeypatch)
    B = 2
    text = lower_for_h100(lambda p, s, t, v: nnx.merge(graphdef, p).extend(s, t, v, kernel_impl="auto"), params,
                          jax.eval_shape(lambda: init_state(cfg, B, 8, jnp.bfloat16)),
                          jax.ShapeDtypeStruct((B, 1), jnp.int32), jax.ShapeDtypeStruct((B, 1), bool))
    decode = [k for k in triton_kernels(text) if 'name = "gdn_decode_layer"' in k]
    assert len(set(decode)) == 1                      # one decode kernel in the module (JAX lowers a jit once) ...
    assert calls_of_the_kernels_function(text, "gdn_decode_layer") == len(cfg.gdn_layers) == 2   # ... every GDN layer's
    # the residual adds with their norms: one Triton kernel (every pair has the same shapes), called for every add of
    # the stack — two a layer: the mixer's with the post-attention norm, the MLP's with the next input norm or the
    # final norm (whose caller JAX lowers as a function of its own: only the normed output is used)
    adds = [k for k in triton_kernels(text) if 'name = "add_rms_norm"' in k]
    assert len(set(adds)) == 1
    assert text.count("call @_add_rms_norm") == 2 * cfg.num_hidden_layers


@pytest.mark.parametrize("rows", [1, 8, 32 * 8])
def test_add_norm_kernel_lowers_for_an_h100_at_the_27b_geometry(monkeypatch, rows):
    """The residual add and the norm after it (`kernels.add_rms_norm`, the decoder layer's [rows, 5120] bf16
    stream: a decoding step's batch, or a verify's nodes) lower to one Triton kernel for an H100, one program a row."""
    cfg = qwen38_27b()
    H = cfg.hidden_size
    x = jax.ShapeDtypeStruct((rows, 1, H), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((H,), jnp.bfloat16)
    dispatch_as_on_a_gpu(monkeypatch)
    text = lower_for_h100(lambda a, b, w: kernels.add_rms_norm(a, b, w, cfg.rms_norm_eps, zero_centred=True), x, x, w)
    assert text.count(TRITON) == 1, text[:2000]
    assert f"grid_x = {rows} : i32" in text


def test_the_verifys_tree_solve_is_one_triton_kernel_for_every_layer(monkeypatch):
    """The verify's tree solve reading two layers of the state stack (as the unrolled model calls it: `layer=j`,
    `target.verify_solve_call`) is one Triton kernel, called once a layer."""
    cfg = qwen38_27b()
    kwargs = {k: v for k, v in verify_solve_call(cfg, 1, 8, depth=7).kwargs.items() if k != "layer"}
    args = jax.eval_shape(lambda: verify_solve_call(cfg, 1, 8, depth=7).args)   # args[0]: the GDN layers' stack
    dispatch_as_on_a_gpu(monkeypatch)
    monkeypatch.setattr(kernels, "hopper_available", lambda: True)
    text = lower_for_h100(lambda *a: [kernels.tree_solve(*a, **kwargs, layer=j)[0] for j in (0, 1)], *args)
    assert len(triton_kernels(text)) == 1
    assert calls_of_the_kernels_function(text) == 2
