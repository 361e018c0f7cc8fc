"""The fused GDN decoding-step kernel (`pallas_kernels.gdn_decode`, Pallas interpret mode on CPU; the GPU twin where
one is) against its math, `gdn.decode_layer`: from the in-projection's output row as the layer's in_proj makes it,
with and without the gated output norm; and that math against the modules and the decode path it replaces."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hyspec_jax import gdn, kernels
from hyspec_jax.pallas_kernels import gdn_decode

GPU = any(d.platform == "gpu" for d in jax.devices())


def _inputs(seed: int, B=3, hk=2, hv=4, dk=16, dv=16, K=4, dtype=jnp.float32, norm=False):
    """(args by name, heads): a random in-projection row proj [B, HK·G] in its key-head groups, slot 0 valid and the
    last one not (its proj row is not zero: the kernel must zero its raw inputs itself)."""
    rng = np.random.default_rng(seed)
    C = 2 * hk * dk + hv * dv
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)   # noqa: E731
    valid = jnp.asarray(rng.random(B) < 0.7).at[0].set(True).at[-1].set(False)
    width = hk * sum(gdn.in_proj_widths(hk, hv, dk, dv).values())
    args = dict(proj=f(B, width).astype(dtype), window=f(B, K - 1, C).astype(dtype),
                conv_weight=(0.3 * f(C, K)).astype(dtype),
                A_log=jnp.log(jnp.asarray(rng.uniform(1, 16, hv), jnp.float32)).astype(dtype),
                dt_bias=jnp.ones((hv,), dtype), S=0.3 * f(B, hv, dk, dv), valid=valid)
    heads = dict(key_heads=hk, key_dim=dk)
    if norm:
        heads["norm"] = gdn.OutputNorm((1.0 + 0.2 * f(dv)).astype(dtype), 1e-6)
    return args, heads


def _check(got: gdn.DecodeStep, want: gdn.DecodeStep, tol: float, o_tol: float | None = None):
    for name, t in (("o", tol if o_tol is None else o_tol), ("state", tol)):
        g, w = np.asarray(getattr(got, name), np.float32), np.asarray(getattr(want, name), np.float32)
        assert g.shape == w.shape, name
        assert np.abs(g - w).max() <= t * np.abs(w).max(), (name, np.abs(g - w).max(), np.abs(w).max())
    assert got.o.dtype == want.o.dtype
    np.testing.assert_array_equal(np.asarray(got.window, np.float32), np.asarray(want.window, np.float32))
    assert got.window.dtype == want.window.dtype


def _pallas(args: dict, heads: dict, **kw) -> gdn.DecodeStep:
    norm = heads.get("norm")
    return gdn_decode.decode_layer_pallas(**args, key_heads=heads["key_heads"], key_dim=heads["key_dim"],
                                          norm_weight=None if norm is None else norm.weight,
                                          eps=None if norm is None else norm.eps, interpret=True, **kw)


# an output in bf16: the kernel and XLA may round an fp32 o that differs in its last bits to neighbouring bf16 values
O_TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("block_v,norm,hk", [(4, False, 2), (16, False, 4), (16, True, 2), (16, True, 1)])
def test_decode_kernel_equals_its_math_interpret(dtype, block_v, norm, hk):
    args, heads = _inputs(1 + block_v + hk, hk=hk, dtype=dtype, norm=norm)
    want = jax.jit(lambda a: gdn.decode_layer(**a, **heads))(args)
    got = _pallas(args, heads, block_v=block_v)
    assert got.o.dtype == (dtype if norm else jnp.float32)
    _check(got, want, 1e-5, O_TOL[dtype] if norm else None)
    valid = np.asarray(args["valid"])            # an invalid slot keeps its state and window
    np.testing.assert_array_equal(np.asarray(got.state)[~valid], np.asarray(args["S"])[~valid])
    np.testing.assert_array_equal(np.asarray(got.window)[~valid], np.asarray(args["window"])[~valid])


def test_decode_layer_math_is_the_modules_and_the_multi_token_path():
    """gdn.decode_layer = the module's split of the in-projection (`GatedDeltaNet.project`), the prefill path's
    pieces (conv, mixer inputs, the closed form over one token) and the module's gated norm (`GatedRMSNorm`)."""
    from hyspec_jax.models.layers import GatedRMSNorm

    args, heads = _inputs(7, dtype=jnp.bfloat16, norm=True)
    norm = heads.pop("norm")
    step = gdn.decode_layer(**args, **heads, norm=norm)
    plain = gdn.decode_layer(**args, **heads)
    B, HV, dv = 3, 4, 16
    x, z, b, a = gdn.split_in_proj(args["proj"], **heads, value_heads=HV, value_dim=dv)
    w = gdn.key_head_groups(np.asarray(args["proj"], np.float32), gdn.in_proj_widths(2, HV, 16, dv), 2)
    np.testing.assert_array_equal(np.asarray(x, np.float32)[:, :32], w["q"].reshape(B, -1))   # q of both key heads
    np.testing.assert_array_equal(np.asarray(z, np.float32), w["z"].reshape(B, HV, dv))
    x = jnp.where(args["valid"][:, None], x, 0)
    conv_out = gdn.causal_conv(x[:, None], args["window"], args["conv_weight"])
    q, k, v, g, beta = gdn.mixer_inputs(conv_out, b[:, None], a[:, None], args["valid"][:, None],
                                        args["A_log"], args["dt_bias"], **heads)
    o, fac = gdn.masked_solve(args["S"], q, k, v, g, beta, gdn.chain_mask(B, 1))
    S = gdn.node_state(args["S"], fac, gdn.chain_mask(B, 1), jnp.zeros((B,), jnp.int32))
    np.testing.assert_allclose(np.asarray(plain.o), np.asarray(o[:, 0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(plain.state), np.asarray(S), rtol=1e-5, atol=1e-5)
    module = GatedRMSNorm(dv, norm.eps, dtype=jnp.bfloat16)
    module.weight.value = norm.weight
    np.testing.assert_array_equal(np.asarray(step.o, np.float32),
                                  np.asarray(module(plain.o.astype(jnp.bfloat16), z), np.float32))


def test_dispatcher_takes_the_reference_off_gpu_and_refuses_what_it_cannot_run():
    args, heads = _inputs(3, norm=True)
    ref = kernels.gdn_decode_layer(**args, **heads, impl="reference")
    if not GPU:
        _check(kernels.gdn_decode_layer(**args, **heads), ref, 0.0)            # auto: the reference on a CPU
    _check(kernels.gdn_decode_layer(**args, **heads, impl="interpret"), ref, 1e-5)
    # a value tile narrower than the head: the kernel without the norm, the norm after it
    _check(kernels.gdn_decode_layer(**args, **heads, impl="interpret", tiling=(4, 1)), ref, 1e-5)
    bad, heads = _inputs(3, dk=12)
    with pytest.raises(ValueError, match="decode"):
        kernels.gdn_decode_layer(**bad, **heads, impl="interpret")


def test_kernel_refuses_a_norm_over_part_of_a_head():
    args, heads = _inputs(4, norm=True)
    with pytest.raises(ValueError, match="a norm over 16 needs block_v 16"):
        _pallas(args, heads, block_v=8)


@pytest.mark.skipif(not GPU, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("norm", [False, True])
def test_decode_kernel_equals_its_math_gpu(dtype, norm):
    args, heads = _inputs(5, B=4, hk=4, hv=8, dk=128, dv=128, dtype=dtype, norm=norm)
    want = jax.jit(lambda a: gdn.decode_layer(**a, **heads))(args)
    _check(kernels.gdn_decode_layer(**args, **heads, impl="pallas"), want, 1e-5, O_TOL[dtype] if norm else None)


def _stacked(args: dict, layers: int = 3) -> dict:
    """The args with stacks of `layers` GDN states and windows whose every row differs, the args' own at row 1."""
    rows = lambda x: jnp.stack([(x.astype(jnp.float32) * (1.0 + 0.5 * (i - 1))).astype(x.dtype)   # noqa: E731
                                for i in range(layers)])
    return {**args, "S": rows(args["S"]), "window": rows(args["window"])}


def _check_stacked(impl: str, args: dict, heads: dict, tol: float, o_tol: float | None = None) -> None:
    """Layer 1 of the stacks steps as its own state and window do (o, the new window, that row of the state); the
    state stack's other rows are as given, bit for bit."""
    stacked = _stacked(args)
    before = np.asarray(stacked["S"])
    want = kernels.gdn_decode_layer(**args, **heads, impl="reference")
    got = jax.jit(lambda s, w: kernels.gdn_decode_layer(**{**stacked, "S": s, "window": w}, **heads, layer=1,
                                                        impl=impl), donate_argnums=0)(stacked["S"], stacked["window"])
    assert got.state.shape == before.shape
    _check(got._replace(state=got.state[1]), want, tol, o_tol)
    for i in (0, 2):
        np.testing.assert_array_equal(np.asarray(got.state[i]), before[i])


@pytest.mark.parametrize("impl", ["reference", "interpret"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_step_of_one_layer_of_the_state_stack(impl, dtype):
    args, heads = _inputs(11, dtype=dtype, norm=True)
    _check_stacked(impl, args, heads, 1e-5, O_TOL[dtype])


def test_stacked_decode_refuses_a_layer_outside_the_stack():
    args, heads = _inputs(12)
    with pytest.raises(ValueError, match="layer 3"):
        _pallas(_stacked(args), heads, layer=3, block_v=16)


@pytest.mark.skipif(not GPU, reason="needs an NVIDIA GPU")
def test_decode_step_of_one_layer_of_the_state_stack_gpu():
    """In place on the GPU: the layer's tiles of the donated stack are written, the other layers are untouched."""
    args, heads = _inputs(13, B=4, hk=4, hv=8, dk=128, dv=128, dtype=jnp.bfloat16, norm=True)
    _check_stacked("pallas", args, heads, 1e-5, O_TOL[jnp.bfloat16])


# ------------------------------------------------------------------------------------------------
# The model's decoding step on the kernel path
# ------------------------------------------------------------------------------------------------
def _model_cfg():
    from hyspec_jax.config import FULL, LINEAR, TargetConfig
    # GDN heads of 16 × 16 (the kernel's smallest key head), two value heads a key head; a block that repeats (scan)
    return TargetConfig(model_type="qwen3_5_text", vocab_size=64, hidden_size=32, num_hidden_layers=4,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=48,
                        layer_types=(LINEAR, FULL) * 2, linear_num_key_heads=1, linear_num_value_heads=2,
                        linear_key_head_dim=16, linear_value_head_dim=16)


@pytest.mark.parametrize("scanned,dtype", [(False, jnp.float32), (True, jnp.float32), (False, jnp.bfloat16)])
def test_models_decoding_step_on_the_kernel_equals_the_reference(scanned, dtype):
    """Greedy decoding steps through the kernel (interpret mode; unrolled: the stacks stepped in place, scanned: the
    layer's state and window in and out) give the reference's tokens, logits and state; a slot that is not valid in
    a step keeps its state."""
    from flax import nnx

    from hyspec_jax.models.target import create_model, scan_layers
    from hyspec_jax.state import init_state

    cfg = _model_cfg()
    model = create_model(cfg, seed=2, dtype=dtype)
    if scanned:
        scan_layers(model)
        assert model.is_scanned
    graphdef, params = nnx.split(model)
    step = jax.jit(lambda p, s, t, v, impl: nnx.merge(graphdef, p).extend(s, t, v, kernel_impl=impl)[::2],
                   static_argnames="impl")
    rng = np.random.default_rng(3)
    B, T = 2, 5
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)), jnp.int32)
    logits, state0 = step(params, init_state(cfg, B, 16, dtype), prompt, jnp.ones((B, T), bool), "reference")
    runs = {}
    for impl in ("reference", "interpret"):
        state, tok, out = state0, jnp.argmax(logits[:, -1], -1), []
        for i in range(3):
            valid = jnp.asarray([[True], [i != 1]])           # slot 1 sits out the second step
            lg, state = step(params, state, tok[:, None], valid, impl)
            tok = jnp.argmax(lg[:, -1], -1)
            out.append((np.asarray(tok), np.asarray(lg, np.float32)))
        runs[impl] = out, state
    (ref, ref_state), (got, got_state) = runs["reference"], runs["interpret"]
    tol = 1e-4 if dtype == jnp.float32 else 5e-2
    for (t_ref, l_ref), (t_got, l_got) in zip(ref, got):
        np.testing.assert_array_equal(t_got, t_ref)
        np.testing.assert_allclose(l_got, l_ref, atol=tol, rtol=tol)
    for name in ("ssm", "conv"):
        np.testing.assert_allclose(np.asarray(getattr(got_state, name), np.float32),
                                   np.asarray(getattr(ref_state, name), np.float32), atol=tol, rtol=tol)
    np.testing.assert_array_equal(np.asarray(got_state.lengths), [T + 3, T + 2])


def test_models_decoding_step_hands_the_kernel_the_projection_and_the_norm():
    """In the decoding step's jaxpr (kernel path), a GDN layer's in-projection output reaches the decode kernel
    through layout-only ops (no regroup concatenate, no slices of b, a, z), and the kernel's output reaches the
    out-projection the same way (the gated norm's reduction is inside the kernel)."""
    import jax.extend.core
    from flax import nnx

    from hyspec_jax.models.target import abstract_model
    from hyspec_jax.state import init_state

    cfg = _model_cfg()
    model = abstract_model(cfg, jnp.bfloat16)             # shapes only: traced, never run
    graphdef, params = nnx.split(model)
    mixers = [layer.linear_attn for layer in model.model.layers if layer.is_linear]
    B = 2
    jaxpr = jax.make_jaxpr(lambda p, s, t, v: nnx.merge(graphdef, p).extend(s, t, v, kernel_impl="interpret"))(
        params, jax.eval_shape(lambda: init_state(cfg, B, 8, jnp.bfloat16)), jnp.zeros((B, 1), jnp.int32),
        jnp.ones((B, 1), bool)).jaxpr
    layout = {"convert_element_type", "squeeze", "reshape", "broadcast_in_dim", "expand_dims"}
    users = {}
    for e in jaxpr.eqns:
        for v in e.invars:
            if isinstance(v, jax.extend.core.Var):
                users.setdefault(v, []).append(e)

    def ends(var) -> list:
        """The first non-layout eqns var flows into."""
        out = []
        for e in users.get(var, []):
            out += [x for o in e.outvars for x in ends(o)] if e.primitive.name in layout else [e]
        return out

    def is_kernel(e) -> bool:
        return e.params.get("name") == "_decode_layer" and any(
            x.primitive.name == "pallas_call" for x in e.params["jaxpr"].jaxpr.eqns)

    def weight_of(e):
        return tuple(e.invars[1].aval.shape) if e.primitive.name == "dot_general" else None

    in_projs = [e for e in jaxpr.eqns if weight_of(e) == tuple(mixers[0].in_proj.weight.shape)]
    assert len(in_projs) == len(mixers)
    for e in in_projs:
        (kernel,) = ends(e.outvars[0])
        assert is_kernel(kernel), kernel.primitive.name
        (out_proj,) = ends(kernel.outvars[0])
        assert weight_of(out_proj) == tuple(mixers[0].out_proj.weight.shape), out_proj.primitive.name

