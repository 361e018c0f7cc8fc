"""The fused residual add + RMSNorm kernel (`pallas_kernels.add_norm`, Pallas interpret mode on CPU; the GPU twin
where one is) against its math, `gdn.add_rms_norm`; the dispatcher's fail-closed choice; and the target's stack, whose
every residual add goes through it: the kernel path equals the reference, and the reference path is the model's
math as it was (the plain adds and norms of `TargetModel._layer`), bit for bit."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hyspec_jax import gdn, kernels
from hyspec_jax.pallas_kernels import add_norm

GPU = any(d.platform == "gpu" for d in jax.devices())
EPS = 1e-6


def _inputs(seed: int, shape: tuple[int, ...], dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32).astype(dtype)   # noqa: E731
    return f(*shape), f(*shape), (0.3 * f(shape[-1])).astype(dtype)


def _reference(x, y, w, zero_centred: bool):
    # jitted, as the model runs it: XLA may keep the fp32 of s = x + y (in bf16) through the norm's convert, as the
    # kernel's interpret mode does too
    return jax.jit(lambda x, y, w: gdn.add_rms_norm(x, y, w, EPS, zero_centred=zero_centred))(x, y, w)


def _check(got, want, dtype) -> None:
    (s, h), (s_ref, h_ref) = got, want
    assert s.dtype == s_ref.dtype and h.dtype == h_ref.dtype and s.shape == s_ref.shape and h.shape == h_ref.shape
    np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(s_ref, np.float32))     # the add: exact
    h, h_ref = np.asarray(h, np.float32), np.asarray(h_ref, np.float32)
    if dtype == jnp.bfloat16:            # the fp32 sum of squares in another order: at most one bf16 ulp apart
        ulp = np.spacing(np.abs(h_ref).astype(np.float32)) * 2.0 ** 16
        assert np.all(np.abs(h - h_ref) <= ulp), np.abs(h - h_ref).max()
    else:
        np.testing.assert_allclose(h, h_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("hidden", [512, 5120, 48])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("zero_centred", [True, False])
def test_add_norm_kernel_equals_its_math_interpret(hidden, dtype, zero_centred):
    x, y, w = _inputs(hidden + zero_centred, (3, 2, hidden), dtype)
    got = kernels.add_rms_norm(x, y, w, EPS, zero_centred=zero_centred, impl="interpret")
    _check(got, _reference(x, y, w, zero_centred), dtype)
    rows = add_norm.add_rms_norm_pallas(x.reshape(6, hidden), y.reshape(6, hidden), w, eps=EPS,
                                        zero_centred=zero_centred, interpret=True)
    _check(rows, _reference(x.reshape(6, hidden), y.reshape(6, hidden), w, zero_centred), dtype)


def test_chunks_are_powers_of_two_that_divide_the_row():
    assert [add_norm.chunk(h) for h in (512, 5120, 48, 4096, 40)] == [512, 1024, 16, 1024, 8]
    assert add_norm.supported(48) and add_norm.supported(5120) and not add_norm.supported(40)


def test_dispatcher_takes_the_reference_off_gpu_and_refuses_what_it_cannot_run():
    x, y, w = _inputs(1, (2, 64), jnp.float32)
    ref = gdn.add_rms_norm(x, y, w, EPS, zero_centred=True)
    got = kernels.add_rms_norm(x, y, w, EPS, zero_centred=True, impl="reference")
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if not GPU:
        for a, b in zip(kernels.add_rms_norm(x, y, w, EPS, zero_centred=True), ref):     # auto: the reference
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
            kernels.add_rms_norm(x, y, w, EPS, zero_centred=True, impl="pallas")
    bad = _inputs(2, (2, 40), jnp.float32)                   # no power-of-two chunk of ≥ 16 divides 40
    for a, b in zip(kernels.add_rms_norm(*bad, EPS, zero_centred=False),
                    gdn.add_rms_norm(*bad, EPS, zero_centred=False)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="add \\+ RMSNorm kernel does not support"):
        kernels.add_rms_norm(*bad, EPS, zero_centred=False, impl="interpret")
    with pytest.raises(ValueError, match="add \\+ RMSNorm kernel does not support"):       # mixed dtypes
        kernels.add_rms_norm(x, y.astype(jnp.bfloat16), w, EPS, zero_centred=True, impl="interpret")


def _rms_norm_before(x, weight, eps, *, zero_centred):
    """`gdn.rms_norm` as it was written before its split into `rms_inverse` and `rms_apply`."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if zero_centred:
        return (y * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * y.astype(x.dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("zero_centred", [True, False])
def test_rms_norm_is_bit_for_bit_what_it_was(dtype, zero_centred):
    x, _, w = _inputs(5, (4, 3, 320), dtype)
    for run in (lambda f: f(x, w, EPS, zero_centred=zero_centred),
                lambda f: jax.jit(lambda x, w: f(x, w, EPS, zero_centred=zero_centred))(x, w)):
        np.testing.assert_array_equal(np.asarray(run(gdn.rms_norm), np.float32),
                                      np.asarray(run(_rms_norm_before), np.float32))


@pytest.mark.skipif(not GPU, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_add_norm_kernel_equals_its_math_gpu(dtype):
    x, y, w = _inputs(7, (3, 5120), dtype)
    _check(kernels.add_rms_norm(x, y, w, EPS, zero_centred=True, impl="pallas"), _reference(x, y, w, True), dtype)


# ------------------------------------------------------------------------------------------------
# The target's stack
# ------------------------------------------------------------------------------------------------
def _stack_before(self, x, gdn_mixer, attn_mixer, tap_layers, carry=None, norm_impl="reference"):
    """`TargetModel._stack` unrolled as it was before the fused adds: `_layer` after `_layer`, then the final norm."""
    taps = {}
    outs = {True: [], False: []}
    for i, layer in enumerate(self.model.layers):
        x, carry, out = self._layer(layer, x, self.config.layer_slot(i), carry, gdn_mixer, attn_mixer)
        outs[layer.is_linear].append(out)
        if i in tap_layers:
            taps[i] = x
    from hyspec_jax.models.target import _stack_outs
    tap_stack = jnp.stack([taps[i] for i in tap_layers]) if tap_layers else None
    return self.model.norm(x), tap_stack, carry, _stack_outs(outs[True]), _stack_outs(outs[False])


@pytest.fixture(scope="module")
def embedded_sized():
    """A random target of the embedded default model's geometry (hidden 512), fp32, and its prompt's state."""
    from flax import nnx

    from hyspec_jax.config import TargetConfig
    from hyspec_jax.embedded import checkpoint_roots
    from hyspec_jax.models.target import create_model

    found = [r / "default" / "config.json" for r in checkpoint_roots() if (r / "default" / "config.json").is_file()]
    if not found:
        pytest.skip("no embedded model config in this checkout")
    cfg = TargetConfig.from_hf_dict(json.loads(found[0].read_text()))
    return cfg, nnx.split(create_model(cfg, seed=3, dtype=jnp.float32))


def _run(cfg, graphdef, params, tokens, valid, state, impl: str, taps: tuple[int, ...]):
    from flax import nnx
    return jax.jit(lambda p, s, t, v: nnx.merge(graphdef, p).extend(s, t, v, kernel_impl=impl, tap_layers=taps))(
        params, state, tokens, valid)


def test_models_stack_on_the_kernel_equals_the_reference_and_what_it_was(embedded_sized, monkeypatch):
    """A prefill and a decoding step of the embedded-size target: the fused adds' kernel (interpret mode) give the
    reference's logits and taps; the reference path gives, bit for bit, what the stack of `_layer`s gave."""
    from hyspec_jax.models.target import TargetModel
    from hyspec_jax.state import init_state

    cfg, (graphdef, params) = embedded_sized
    B, T = 2, 4
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)), jnp.int32)
    step_tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, 1)), jnp.int32)
    taps = (0, 3, cfg.num_hidden_layers - 1)
    state0 = init_state(cfg, B, 8, jnp.float32)

    def run(impl):
        logits, hidden, state = _run(cfg, graphdef, params, prompt, jnp.ones((B, T), bool), state0, impl, taps)
        step_logits, step_hidden, _ = _run(cfg, graphdef, params, step_tokens, jnp.ones((B, 1), bool), state, impl, ())
        return [np.asarray(a) for a in (logits, hidden, step_logits, step_hidden)]

    ref, got = run("reference"), run("interpret")
    for r, g in zip(ref, got):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(TargetModel, "_stack", _stack_before)
    for r, b in zip(ref, run("reference")):
        np.testing.assert_array_equal(r, b)
