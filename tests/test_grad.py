"""Gradients through the verify path, checked against central finite differences in fp64 on CPU.

`hyspec_jax.gdn`, `models.layers` and `models.target` compute in a module-level `F32` dtype. For the fp64
checks the `fp64` fixture enables x64 (scoped: `jax.enable_x64`) and points those module globals at float64
for the duration of one test (pytest's monkeypatch restores them), so every matmul, gate and solve runs in
fp64 — each test asserts that its outputs really are float64. Nothing here uses a module-level jitted
function, so no fp64 trace can leak into another test's cache.

Check: for random directions d and random cotangents c, the VJP cᵀJd equals the central difference
cᵀ(f(x + εd) − f(x − εd)) / 2ε (truncation O(ε²), round-off O(1e-16/ε)); with ε = 1e-6 the two agree to
~1e-9 relative, and the tolerance is 1e-6. A gradient with one wrong term (a dropped decay factor, a
transposed product) is off by O(1) relative, so the check cannot pass by accident.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hyspec_jax import gdn
from hyspec_jax import tree as tree_lib
from hyspec_jax.config import FULL, LINEAR, TargetConfig
from hyspec_jax.models import layers as layers_mod
from hyspec_jax.models import target as target_mod
from hyspec_jax.state import TargetState
from hyspec_jax import kernels

EPS = 1e-6
RTOL = 1e-6


@pytest.fixture
def fp64(monkeypatch):
    with jax.enable_x64(True):
        for mod in (gdn, layers_mod, target_mod):
            monkeypatch.setattr(mod, "F32", jnp.float64)
        yield
    # monkeypatch undoes the attribute changes after the context is left


def _rand(rng, shape, scale=1.0, dtype=np.float64):
    return jnp.asarray((scale * rng.standard_normal(shape)).astype(dtype))


def _like(rng, tree, dtype=np.float64):
    return jax.tree.map(lambda x: _rand(rng, x.shape, dtype=dtype), tree)


def _vdot(a, b) -> jax.Array:
    return sum(jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _axpy(x, d, s):
    return jax.tree.map(lambda a, b: a + s * b, x, d)


def check_vjp(f, args, rng, n_dirs=2, rtol=RTOL, eps=EPS):
    """f(*args) -> dict of pytrees of float64 arrays. For each entry separately (cotangent zero on the others),
    compares cᵀJd from jax.vjp with the central difference cᵀ(f(x + εd) − f(x − εd)) / 2ε.

    One compiled program, (x, c) -> (f(x), VJP(x)(c)): its primal output serves the differences."""
    out = jax.eval_shape(f, *args)
    assert all(x.dtype == jnp.float64 for x in jax.tree.leaves(out)), jax.tree.leaves(out)
    ct = _like(rng, out)

    @jax.jit
    def value_and_vjp(a, c):
        value, vjp = jax.vjp(f, *a)
        return value, vjp(c)

    zero_ct = jax.tree.map(jnp.zeros_like, ct)
    dirs = [_like(rng, args) for _ in range(n_dirs)]
    diffs = [jax.tree.map(lambda a, b: (a - b) / (2 * eps), value_and_vjp(_axpy(args, d, eps), zero_ct)[0],
                          value_and_vjp(_axpy(args, d, -eps), zero_ct)[0]) for d in dirs]
    for name in out:
        ct_name = {k: (v if k == name else zero_ct[k]) for k, v in ct.items()}
        grads = value_and_vjp(args, ct_name)[1]
        assert all(x.dtype == jnp.float64 for x in jax.tree.leaves(grads))
        assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(grads)) > 0, name
        for d, diff in zip(dirs, diffs):
            fd, an = _vdot(ct[name], diff[name]), _vdot(grads, d)
            np.testing.assert_allclose(float(an), float(fd), rtol=rtol, atol=1e-10, err_msg=name)


def gdn_inputs(rng, B, N, HV, dk, dv, depth, dtype=np.float64):
    parents = [tree_lib.random_parents(rng, N, depth, min_depth=depth) for _ in range(B)]
    tree = tree_lib.pack_forest(parents, tree_lib.TreeShape(N, depth))
    mask = tree_lib.ancestor_mask(tree)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(rng.standard_normal((B, N, HV, dk))) * dk ** -0.5
    k = unit(rng.standard_normal((B, N, HV, dk)))
    v = rng.standard_normal((B, N, HV, dv))
    g = -np.log1p(np.exp(rng.standard_normal((B, N, HV)) + 1.0))
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, N, HV))))
    S0 = 0.5 * rng.standard_normal((B, HV, dk, dv))
    args = tuple(jnp.asarray(x.astype(dtype)) for x in (S0, q, k, v, g, beta))
    return tree, mask, args


# ------------------------------------------------------------------------------------------------
# The GDN closed form and the factorized commit
# ------------------------------------------------------------------------------------------------
def test_masked_solve_and_node_state_vjp_match_finite_differences(fp64):
    """For each inverse method (solve, neumann, squaring): every output of the closed form (o and the factors
    Γ, k, V') and Bole's factorized commit of one node per row (node −1 = nothing accepted keeps S0),
    differentiated w.r.t. S0, q, k, v, g, β. (One program for the three methods: they share everything but
    the inverse, and one compile of all three is cheaper than three.)"""
    rng = np.random.default_rng(0)
    tree, mask, args = gdn_inputs(rng, B=3, N=7, HV=2, dk=4, dv=3, depth=4)
    node = jnp.asarray([6, 2, -1], jnp.int32)

    def f(S0, q, k, v, g, beta):
        out = {}
        for method in ("solve", "neumann", "squaring"):
            o, fac = gdn.masked_solve(S0, q, k, v, g, beta, mask, method=method, path_nodes=tree.envelope.path_nodes)
            out[method] = (o, fac, gdn.node_state(S0, fac, mask, node))
        return out

    check_vjp(f, args, rng)


# ------------------------------------------------------------------------------------------------
# The full target verify forward
# ------------------------------------------------------------------------------------------------
TINY = TargetConfig(
    model_type="qwen3_5_text", vocab_size=17, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=8, intermediate_size=24, layer_types=(LINEAR, FULL),
    linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=4, linear_value_head_dim=4)


def test_target_verify_vjp_matches_finite_differences(fp64):
    """jax.vjp of target.verify (logits and every TreeCache field) w.r.t. all parameters and the committed
    state (recurrent state, conv window, prefix KV), against central differences."""
    rng = np.random.default_rng(4)
    # shapes from the abstract model, values from numpy (eager random init would compile a PRNG program per
    # parameter shape); O(0.3) weights put every layer in a non-linear regime
    graphdef, params = nnx.split(target_mod.abstract_model(TINY, dtype=jnp.float64))
    params = jax.tree.map(lambda x: _rand(rng, x.shape, 0.3), params)
    assert all(x.dtype == jnp.float64 for x in jax.tree.leaves(params))
    B, S, N, depth = 2, 6, 6, 3
    Lg, La = len(TINY.gdn_layers), len(TINY.attn_layers)
    state = TargetState(
        ssm=_rand(rng, (Lg, B, 2, 4, 4), 0.5),
        conv=_rand(rng, (Lg, B, TINY.linear_conv_kernel_dim - 1, TINY.conv_dim)),
        keys=_rand(rng, (La, B, S, 1, 8)), values=_rand(rng, (La, B, S, 1, 8)),
        lengths=jnp.asarray([3, 1], jnp.int32))
    parents = [tree_lib.random_parents(rng, N, depth, min_depth=depth) for _ in range(B)]
    tree = tree_lib.pack_forest(parents, tree_lib.TreeShape(N, depth))
    tokens = jnp.asarray(rng.integers(0, TINY.vocab_size, (B, N)), jnp.int32)
    floats = (params, state.ssm, state.conv, state.keys, state.values)

    def f(params, ssm, conv, keys, values):
        st = TargetState(ssm=ssm, conv=conv, keys=keys, values=values, lengths=state.lengths)
        logits, cache = target_mod.verify(graphdef, params, st, tree, tokens, method="squaring")
        return {"logits": logits, "cache": (cache.factors, cache.conv_inputs, cache.keys, cache.values)}

    check_vjp(f, floats, rng)


# ------------------------------------------------------------------------------------------------
# The kernel dispatcher's custom_vjp
# ------------------------------------------------------------------------------------------------
def _outputs(res):
    o, fac = res
    return o, fac.log_decay, fac.keys, fac.corrected


def test_tree_solve_custom_vjp_matches_reference_and_kernel_forward():
    """The kernel path (Pallas interpret mode on CPU) is a jax.custom_vjp whose backward is the reference VJP.

    Padded node count (N = 11 → 16) and grouped key heads (HK = 1, HV = 2). Checks (i) its VJP equals the
    reference VJP for random cotangents on every output (o, Γ, keys, V'); (ii) that backward is the derivative
    of the *kernel's own* forward: central differences of the kernel (fp32, 'ieee' precision) in a random
    direction agree with the VJP to 2e-3 relative (fp32 round-off / ε with ε = 1e-3 bounds the difference
    quotient's error at ~1e-4 of the output scale); (iii) impl='auto' on a CPU takes the reference path, so
    its VJP is the reference VJP bit for bit.
    """
    rng = np.random.default_rng(6)
    B, N, HK, HV, dk, dv, depth = 1, 11, 1, 2, 16, 16, 4
    tree, mask, (S0, q, k, v, g, beta) = gdn_inputs(rng, B, N, HV, dk, dv, depth, dtype=np.float32)
    args = (S0, q[:, :, :HK], k[:, :, :HK], v, g, beta)
    kern = lambda *a: _outputs(kernels.tree_solve(*a, mask, depth + 1, impl="interpret",  # noqa: E731
                                                  block_v=16, precision="ieee"))
    ref = lambda *a: _outputs(kernels.tree_solve(*a, mask, depth + 1, impl="reference"))  # noqa: E731

    auto = lambda *a: _outputs(kernels.tree_solve(*a, mask, depth + 1))  # noqa: E731

    @jax.jit
    def kern_vv(a, c):
        value, vjp = jax.vjp(kern, *a)
        return value, vjp(c)

    @jax.jit
    def ref_and_auto(a, c):     # the reference's value and VJP, and the auto path's VJP, in one program
        value, vjp = jax.vjp(ref, *a)
        return value, vjp(c), jax.vjp(auto, *a)[1](c)

    ct = _like(rng, jax.eval_shape(ref, *args), np.float32)
    out_k, g_k = kern_vv(args, ct)
    out_r, g_r, g_a = ref_and_auto(args, ct)
    for a, b in zip(out_k, out_r):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    for a, b in zip(g_k, g_r):
        assert float(jnp.abs(b).max()) > 0
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    eps = 1e-3
    d = _like(rng, args, np.float32)
    plus, minus = kern_vv(_axpy(args, d, eps), ct)[0], kern_vv(_axpy(args, d, -eps), ct)[0]
    fd = float(_vdot(ct, jax.tree.map(lambda a, b: (a - b) / (2 * eps), plus, minus)))
    an = float(_vdot(g_k, d))
    assert abs(an - fd) <= 2e-3 * abs(an), (an, fd)
    if not kernels.gpu_kernels_available():
        for a, b in zip(g_a, g_r):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
