"""The fused GDN decoding-step kernel (`pallas_kernels.gdn_decode`, Pallas interpret mode on CPU; the GPU twin where
one is) against its math, `gdn.decode_step`, and that math against the decode path it replaces."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hyspec_jax import gdn, kernels
from hyspec_jax.pallas_kernels import gdn_decode

GPU = any(d.platform == "gpu" for d in jax.devices())


def _inputs(seed: int, B=3, hk=2, hv=4, dk=16, dv=16, K=4, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    C = 2 * hk * dk + hv * dv
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)   # noqa: E731
    valid = jnp.asarray(rng.random(B) < 0.7).at[0].set(True).at[-1].set(False)
    x = jnp.where(valid[:, None], f(B, C), 0).astype(dtype)           # the decode path zeroes invalid rows
    return dict(x=x, window=f(B, K - 1, C).astype(dtype), weight=(0.3 * f(C, K)).astype(dtype),
                a=f(B, hv).astype(dtype), b=f(B, hv).astype(dtype),
                A_log=jnp.log(jnp.asarray(rng.uniform(1, 16, hv), jnp.float32)).astype(dtype),
                dt_bias=jnp.ones((hv,), dtype), S=0.3 * f(B, hv, dk, dv), valid=valid), dict(key_heads=hk, key_dim=dk)


def _check(got: gdn.DecodeStep, want: gdn.DecodeStep, tol: float):
    for name in ("o", "state"):
        g, w = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
        assert np.abs(g - w).max() <= tol * np.abs(w).max(), name
    np.testing.assert_array_equal(np.asarray(got.window, np.float32), np.asarray(want.window, np.float32))
    assert got.window.dtype == want.window.dtype


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("block_v", [4, 16])
def test_decode_kernel_equals_its_math_interpret(dtype, block_v):
    args, heads = _inputs(1 + block_v, dtype=dtype)
    want = jax.jit(lambda a: gdn.decode_step(**a, **heads))(args)
    got = gdn_decode.decode_step_pallas(**args, **heads, block_v=block_v, interpret=True)
    _check(got, want, 1e-5)
    valid = np.asarray(args["valid"])            # an invalid slot keeps its state and window
    np.testing.assert_array_equal(np.asarray(got.state)[~valid], np.asarray(args["S"])[~valid])
    np.testing.assert_array_equal(np.asarray(got.window)[~valid], np.asarray(args["window"])[~valid])


def test_decode_math_is_the_multi_token_path():
    """gdn.decode_step = the prefill path's pieces (conv, mixer inputs, the closed form over one token)."""
    args, heads = _inputs(7)
    step = gdn.decode_step(**args, **heads)
    conv_out = gdn.causal_conv(args["x"][:, None], args["window"], args["weight"])
    q, k, v, g, beta = gdn.mixer_inputs(conv_out, args["b"][:, None], args["a"][:, None], args["valid"][:, None],
                                        args["A_log"], args["dt_bias"], **heads)
    o, fac = gdn.masked_solve(args["S"], q, k, v, g, beta, gdn.chain_mask(3, 1))
    S = gdn.node_state(args["S"], fac, gdn.chain_mask(3, 1), jnp.zeros((3,), jnp.int32))
    np.testing.assert_allclose(np.asarray(step.o), np.asarray(o[:, 0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(step.state), np.asarray(S), rtol=1e-5, atol=1e-5)


def test_dispatcher_takes_the_reference_off_gpu_and_refuses_what_it_cannot_run():
    args, heads = _inputs(3)
    ref = kernels.gdn_decode(**args, **heads, impl="reference")
    if not GPU:
        _check(kernels.gdn_decode(**args, **heads), ref, 0.0)            # auto: the reference on a CPU
    _check(kernels.gdn_decode(**args, **heads, impl="interpret"), ref, 1e-5)
    bad, heads = _inputs(3, dk=12)
    with pytest.raises(ValueError, match="decode"):
        kernels.gdn_decode(**bad, **heads, impl="interpret")


@pytest.mark.skipif(not GPU, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_kernel_equals_its_math_gpu(dtype):
    args, heads = _inputs(5, B=4, hk=4, hv=8, dk=128, dv=128, dtype=dtype)
    want = jax.jit(lambda a: gdn.decode_step(**a, **heads))(args)
    _check(kernels.gdn_decode(**args, **heads, impl="pallas"), want, 1e-5)


def _stacked(args: dict, layers: int = 3) -> dict:
    """The args with stacks of `layers` GDN states and windows whose every row differs, the args' own at row 1."""
    rows = lambda x: jnp.stack([(x.astype(jnp.float32) * (1.0 + 0.5 * (i - 1))).astype(x.dtype)   # noqa: E731
                                for i in range(layers)])
    return {**args, "S": rows(args["S"]), "window": rows(args["window"])}


def _check_stacked(impl: str, args: dict, heads: dict, tol: float) -> None:
    """Layer 1 of the stacks steps as its own state and window do (o, the new window, that row of the state); the
    state stack's other rows are as given, bit for bit."""
    stacked = _stacked(args)
    before = np.asarray(stacked["S"])
    want = kernels.gdn_decode(**args, **heads, impl="reference")
    got = jax.jit(lambda s, w: kernels.gdn_decode(**{**stacked, "S": s, "window": w}, **heads, layer=1, impl=impl),
                  donate_argnums=0)(stacked["S"], stacked["window"])
    assert got.state.shape == before.shape
    _check(got._replace(state=got.state[1]), want, tol)
    for i in (0, 2):
        np.testing.assert_array_equal(np.asarray(got.state[i]), before[i])


@pytest.mark.parametrize("impl", ["reference", "interpret"])
def test_decode_step_of_one_layer_of_the_state_stack(impl):
    args, heads = _inputs(11)
    _check_stacked(impl, args, heads, 1e-5)


def test_stacked_decode_refuses_a_layer_outside_the_stack():
    args, heads = _inputs(12)
    with pytest.raises(ValueError, match="layer 3"):
        gdn_decode.decode_step_pallas(**_stacked(args), **heads, layer=3, block_v=16, interpret=True)


@pytest.mark.skipif(not GPU, reason="needs an NVIDIA GPU")
def test_decode_step_of_one_layer_of_the_state_stack_gpu():
    """In place on the GPU: the layer's tiles of the donated stack are written, the other layers are untouched."""
    args, heads = _inputs(13, B=4, hk=4, hv=8, dk=128, dv=128, dtype=jnp.bfloat16)
    _check_stacked("pallas", args, heads, 1e-5)
