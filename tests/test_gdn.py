"""Property tests of `hyspec_jax.gdn` against an independent float64 numpy serial recurrence.

The oracle follows docs/reference/target_model.md §5.5 literally (decay, read with the decayed state, delta, rank-1
write, output from the updated state) and, for trees, runs it along every node's root-to-node path from S0.
It shares no code with `gdn` (not even `gdn.step`); the ancestor mask is built here from the parent array.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hyspec_jax import gdn

RTOL = 1e-5  # fp32 closed forms vs float64 serial oracle, relative to the largest oracle magnitude


# ------------------------------------------------------------------------------------------------
# The oracle (numpy, float64)
# ------------------------------------------------------------------------------------------------
def np_prepare_qk(q, k, hv):
    """[..., HK, dk] -> [..., HV, dk]: l2-normalised (eps 1e-6 inside the sqrt), q scaled by dk^-1/2,
    value head j <- key head j // r."""
    q, k = q.astype(np.float64), k.astype(np.float64)
    q = q / np.sqrt(np.sum(q * q, -1, keepdims=True) + 1e-6) / np.sqrt(q.shape[-1])
    k = k / np.sqrt(np.sum(k * k, -1, keepdims=True) + 1e-6)
    idx = np.arange(hv) // (hv // q.shape[-2])
    return q[..., idx, :], k[..., idx, :]


def np_step(S, q, k, v, g, beta):
    """One token for one (batch) element, all heads: S [H,dk,dv]; q,k [H,dk]; v [H,dv]; g, beta [H]."""
    S = np.exp(g)[:, None, None] * S                       # 1. decay
    m = np.einsum("hkv,hk->hv", S, k)                      # 2. read with the decayed state
    delta = beta[:, None] * (v - m)                        # 3. delta
    S = S + k[:, :, None] * delta[:, None, :]              # 4. rank-1 write
    return np.einsum("hkv,hk->hv", S, q), S                # 5. output from the updated state


def np_path(parent, i):
    path = []
    while i >= 0:
        path.append(i)
        i = parent[i]
    return path[::-1]


def np_tree_oracle(S0, q, k, v, g, beta, parents):
    """Per batch element b, per node i: run np_step along root→i from S0[b]. Returns (o [B,N,H,dv], S [B,N,H,dk,dv])."""
    B, N = q.shape[:2]
    o = np.zeros(v.shape, np.float64)
    S_all = np.zeros((B, N) + S0.shape[1:], np.float64)
    for b in range(B):
        for i in range(N):
            S = S0[b].astype(np.float64)
            for j in np_path(parents[b], i):
                out, S = np_step(S, q[b, j], k[b, j], v[b, j], g[b, j], beta[b, j])
            o[b, i], S_all[b, i] = out, S
    return o, S_all


def np_ancestor_mask(parent):
    n = len(parent)
    A = np.zeros((n, n), bool)
    for i in range(n):
        A[i, np_path(parent, i)] = True
    return A


def rel_err(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-30))


# ------------------------------------------------------------------------------------------------
# Strategies
# ------------------------------------------------------------------------------------------------
@st.composite
def trees(draw, n, path_nodes):
    """parent[i] in {-1, 0..i-1} with every node's depth (nodes on its path) <= path_nodes; or a chain."""
    if draw(st.booleans()):
        return [i - 1 if i % path_nodes else -1 for i in range(n)]   # chains of length path_nodes, restarted
    parent, depth = [], []
    for i in range(n):
        cand = [-1] + [j for j in range(i) if depth[j] < path_nodes]
        p = cand[draw(st.integers(0, len(cand) - 1))]
        parent.append(p)
        depth.append(1 if p < 0 else depth[p] + 1)
    return parent


def depth_of(parent):
    return max(len(np_path(parent, i)) for i in range(len(parent)))


def random_inputs(rng, B, N, hk, r, dk, dv, g_scale=1.0):
    hv = hk * r
    S0 = rng.normal(size=(B, hv, dk, dv))
    q_raw = rng.normal(size=(B, N, hk, dk))
    k_raw = rng.normal(size=(B, N, hk, dk))
    v = rng.normal(size=(B, N, hv, dv))
    g = -g_scale * np.exp(rng.uniform(-4.0, 1.0, size=(B, N, hv)))   # log decays from ~-0.02 to ~-2.7
    beta = rng.uniform(0.0, 1.0, size=(B, N, hv))
    return S0, q_raw, k_raw, v, g, beta


f32 = functools.partial(np.asarray, dtype=np.float32)


@functools.partial(jax.jit, static_argnames=("hv",))
def _prepare(q_raw, k_raw, hv):
    return gdn.prepare_qk(q_raw, k_raw)


METHODS = ("solve", "neumann", "squaring")


@functools.partial(jax.jit, static_argnames=("hv", "depth"))
def _solve_all_methods(S0, q_raw, k_raw, v, g, beta, mask, mixed_nodes, *, hv, depth):
    """One compiled program per example (compiles dominate the run time): for each inverse method the
    outputs, the state of every node from the factors, and node_state for a mixed [B] node vector."""
    q, k = gdn.prepare_qk(q_raw, k_raw)
    every = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32)[:, None], (q.shape[1], q.shape[0]))
    out = {}
    for method in METHODS:
        o, factors = gdn.masked_solve(S0, q, k, v, g, beta, mask, method=method, path_nodes=depth)
        states = jax.vmap(lambda nd: gdn.node_state(S0, factors, mask, nd))(every)   # [N,B,H,dk,dv]
        out[method] = (o, jnp.moveaxis(states, 0, 1), gdn.node_state(S0, factors, mask, mixed_nodes))
    return q, k, out


# The node count comes from buckets so that compiled shapes repeat across examples.
NODE_COUNTS = st.sampled_from([1, 7, 64])


# ------------------------------------------------------------------------------------------------
# masked_solve / node_state vs the serial oracle on chains and trees
# ------------------------------------------------------------------------------------------------
@settings(max_examples=6)
@given(data=st.data(), B=st.integers(1, 3), N=NODE_COUNTS, path_nodes=st.integers(1, 8),
       hk=st.integers(1, 2), r=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_masked_solve_and_node_state_equal_serial_recurrence(data, B, N, path_nodes, hk, r, seed):
    dk, dv = 8, 6
    parents = [data.draw(trees(N, path_nodes), label=f"parent[{b}]") for b in range(B)]
    depth = max(depth_of(p) for p in parents)
    assert depth <= path_nodes
    mask = np.stack([np_ancestor_mask(p) for p in parents])
    rng = np.random.default_rng(seed)
    S0, q_raw, k_raw, v, g, beta = random_inputs(rng, B, N, hk, r, dk, dv)
    q64, k64 = np_prepare_qk(q_raw, k_raw, hk * r)
    o_ref, S_ref = np_tree_oracle(S0, q64, k64, v, g, beta, parents)
    mixed = rng.integers(-1, N, size=B).astype(np.int32)
    mixed[0] = -1

    q, k, out = _solve_all_methods(f32(S0), f32(q_raw), f32(k_raw), f32(v), f32(g), f32(beta),
                                   jnp.asarray(mask), jnp.asarray(mixed), hv=hk * r, depth=depth)
    hv = hk * r                                   # q/k stay at their key heads; the oracle expands them
    assert rel_err(gdn.value_heads(q, hv), q64) < 1e-6 and rel_err(gdn.value_heads(k, hv), k64) < 1e-6
    assert q.shape[2] == k.shape[2] == hk
    for method, (o, states, S_mix) in out.items():
        assert o.shape == v.shape and states.shape == S_ref.shape
        err_o, err_s = rel_err(o, o_ref), rel_err(states, S_ref)
        assert err_o < RTOL, (method, err_o)
        assert err_s < RTOL, (method, err_s)
        S_mix = np.asarray(S_mix)
        np.testing.assert_array_equal(S_mix[0], f32(S0)[0])        # node −1: exactly S0
        for b in range(1, B):
            ref = f32(S0)[b] if mixed[b] < 0 else S_ref[b, mixed[b]]
            assert rel_err(S_mix[b], ref) < RTOL


def test_masked_solve_inverse_methods_need_only_the_tree_depth():
    """Neumann / squaring with path_nodes = the depth are exact; one round fewer is not (the bound is used)."""
    parent = [-1, 0, 1, 2, -1, 4, 0, 6, 7]            # depth 4
    B, N, hk, r, dk, dv = 1, len(parent), 1, 2, 4, 4
    rng = np.random.default_rng(7)
    S0, q_raw, k_raw, v, g, beta = random_inputs(rng, B, N, hk, r, dk, dv)
    beta = np.full_like(beta, 0.9)
    k_raw = np.broadcast_to(k_raw[:, :1], k_raw.shape) + 0.1 * k_raw  # correlated keys: large L
    q64, k64 = np_prepare_qk(q_raw, k_raw, hk * r)
    o_ref, _ = np_tree_oracle(S0, q64, k64, v, g, beta, [parent])
    q, k = _prepare(f32(q_raw), f32(k_raw), hv=hk * r)
    args = (f32(S0), q, k, f32(v), f32(g), f32(beta), jnp.asarray(np_ancestor_mask(parent)[None]))
    for method in ("neumann", "squaring"):
        o, _ = gdn.masked_solve(*args, method=method, path_nodes=4)
        assert rel_err(o, o_ref) < RTOL
    o, _ = gdn.masked_solve(*args, method="neumann", path_nodes=3)
    assert rel_err(o, o_ref) > 1e-3


# ------------------------------------------------------------------------------------------------
# chunked prefill / serial recurrence / step
# ------------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("hv", "chunk_size", "method"))
def _chain(S0, q_raw, k_raw, v, g, beta, *, hv, chunk_size, method):
    q, k = gdn.prepare_qk(q_raw, k_raw)
    return (gdn.chunked_prefill(S0, q, k, v, g, beta, chunk_size=chunk_size, method=method),
            gdn.serial_recurrence(S0, q, k, v, g, beta))


@settings(max_examples=3)
@given(T=st.integers(1, 40), B=st.integers(1, 2), r=st.integers(1, 3), method=st.sampled_from(METHODS),
       seed=st.integers(0, 2**31 - 1))
@example(T=40, B=2, r=3, method="neumann", seed=1)      # five chunks
@example(T=19, B=1, r=2, method="squaring", seed=2)
@example(T=5, B=2, r=1, method="solve", seed=3)         # shorter than one chunk
def test_chunked_prefill_equals_token_by_token(T, B, r, method, seed):
    hk, dk, dv = 2, 4, 8
    rng = np.random.default_rng(seed)
    S0, q_raw, k_raw, v, g, beta = random_inputs(rng, B, T, hk, r, dk, dv, g_scale=0.5)
    q64, k64 = np_prepare_qk(q_raw, k_raw, hk * r)
    o_ref, S_ref = np_tree_oracle(S0, q64, k64, v, g, beta, [list(range(-1, T - 1))] * B)
    (o, S), (o_s, S_s) = _chain(f32(S0), f32(q_raw), f32(k_raw), f32(v), f32(g), f32(beta),
                                hv=hk * r, chunk_size=8, method=method)
    assert o.shape == v.shape and S.shape == S0.shape
    assert rel_err(o_s, o_ref) < RTOL and rel_err(S_s, S_ref[:, -1]) < RTOL
    assert rel_err(o, o_ref) < RTOL, rel_err(o, o_ref)
    assert rel_err(S, S_ref[:, -1]) < RTOL, rel_err(S, S_ref[:, -1])
    assert rel_err(o, o_s) < RTOL and rel_err(S, S_s) < RTOL


@functools.partial(jax.jit, static_argnames=("hv",))
def _prepare_and_step(S0, q_raw, k_raw, v, g, beta, *, hv):
    q, k = gdn.prepare_qk(q_raw, k_raw)
    return gdn.step(S0, q, k, v, g, beta)


@settings(max_examples=4)
@given(B=st.integers(1, 3), hk=st.integers(1, 2), r=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_step_equals_oracle_step(B, hk, r, seed):
    dk, dv = 8, 4
    rng = np.random.default_rng(seed)
    S0, q_raw, k_raw, v, g, beta = random_inputs(rng, B, 1, hk, r, dk, dv)
    q64, k64 = np_prepare_qk(q_raw, k_raw, hk * r)
    o, S = _prepare_and_step(f32(S0), f32(q_raw[:, 0]), f32(k_raw[:, 0]), f32(v[:, 0]), f32(g[:, 0]),
                             f32(beta[:, 0]), hv=hk * r)
    for b in range(B):
        o_ref, S_ref = np_step(S0[b], q64[b, 0], k64[b, 0], v[b, 0], g[b, 0], beta[b, 0])
        assert rel_err(o[b], o_ref) < RTOL and rel_err(S[b], S_ref) < RTOL


def test_invalid_positions_are_identity_steps():
    """invalidate() turns padded positions into steps that leave state and later outputs unchanged."""
    B, T, hk, r, dk, dv = 2, 7, 1, 2, 4, 4
    rng = np.random.default_rng(3)
    S0, q_raw, k_raw, v, g, beta = random_inputs(rng, B, T, hk, r, dk, dv)
    valid = np.array([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0, 0]], bool)
    q, k = gdn.prepare_qk(f32(q_raw), f32(k_raw))
    gi, bi = gdn.invalidate(f32(g), f32(beta), jnp.asarray(valid))
    o, S = gdn.chunked_prefill(f32(S0), q, k, f32(v), gi, bi, chunk_size=4)
    q64, k64 = np_prepare_qk(q_raw, k_raw, hk * r)
    o1, S1 = np_tree_oracle(S0[1:], q64[1:, :3], k64[1:, :3], v[1:, :3], g[1:, :3], beta[1:, :3], [[-1, 0, 1]])
    assert rel_err(S[1], S1[0, -1]) < RTOL
    assert rel_err(o[1, :3], o1[0]) < RTOL


# ------------------------------------------------------------------------------------------------
# Causal conv (§5.2): direct numpy, torch conv1d, gathered taps for chains and trees
# ------------------------------------------------------------------------------------------------
def np_silu(x):
    return x / (1.0 + np.exp(-x))


def np_causal_conv(x, window, w):
    """out[b,t,c] = SiLU(Σ_{m=0}^{K−1} w[c, K−1−m] · x[b, t−m, c]); times < 0 read the previous raw window."""
    B, T, C = x.shape
    K = w.shape[1]
    hist = np.concatenate([window, x], axis=1).astype(np.float64)   # time t lives at row t + K − 1
    out = np.zeros((B, T, C))
    for t in range(T):
        for m in range(K):
            out[:, t] += w[:, K - 1 - m] * hist[:, t - m + K - 1]
    return np_silu(out)


@jax.jit
def _conv_all(x, window, w, num_valid, taps):
    return (gdn.causal_conv(x, window, w), gdn.conv_window_after(x, window, num_valid),
            gdn.gathered_conv(x, window, w, taps))


@settings(max_examples=6)
@given(B=st.integers(1, 3), T=st.integers(1, 9), C=st.integers(1, 12), K=st.integers(2, 5),
       seed=st.integers(0, 2**31 - 1), data=st.data())
def test_causal_conv_and_window(B, T, C, K, seed, data):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, T, C))
    window = rng.normal(size=(B, K - 1, C))            # nonzero previous raw inputs
    w = rng.normal(size=(C, K))
    num_valid = np.array(data.draw(st.lists(st.integers(0, T), min_size=B, max_size=B)))
    # chain taps: node t reads rows t..t+K−1 of [window | x] (tap K−1 = itself)
    taps = np.broadcast_to(np.arange(T)[:, None] + np.arange(K)[None], (B, T, K))
    out, after, gathered = _conv_all(f32(x), f32(window), f32(w), jnp.asarray(num_valid, jnp.int32),
                                     jnp.asarray(taps, jnp.int32))
    ref = np_causal_conv(x, window, w)
    assert out.dtype == jnp.float32 and rel_err(out, ref) < 1e-5
    # an independent oracle: torch's grouped conv1d over [window | x]
    xt = torch.as_tensor(np.concatenate([window, x], 1).transpose(0, 2, 1))
    tref = torch.nn.functional.silu(torch.nn.functional.conv1d(xt, torch.as_tensor(w)[:, None, :], groups=C))
    assert rel_err(out, tref.numpy().transpose(0, 2, 1)) < 1e-5
    # the window after appending the first num_valid tokens
    for b in range(B):
        seq = np.concatenate([window[b], x[b, :num_valid[b]]], 0)
        np.testing.assert_array_equal(np.asarray(after[b]), f32(seq[-(K - 1):]))
    assert rel_err(gathered, out) < 1e-6


@settings(max_examples=6)
@given(N=st.integers(1, 12), K=st.integers(2, 4), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_gathered_conv_on_a_tree_equals_conv_along_each_path(N, K, seed, data):
    parent = data.draw(trees(N, 6))
    C = 5
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(1, N, C))
    window = rng.normal(size=(1, K - 1, C))
    w = rng.normal(size=(C, K))
    taps = np.zeros((1, N, K), np.int32)
    for i in range(N):
        # rows of [window | x]: node j is row K−1+j; past the root continue into the window, newest first
        rows = [K - 1 + j for j in np_path(parent, i)]
        rows = list(range(K - 1)) + rows
        taps[0, i] = rows[-K:]
    out = np.asarray(jax.jit(gdn.gathered_conv)(f32(x), f32(window), f32(w), jnp.asarray(taps)))
    for i in range(N):
        path = np_path(parent, i)
        ref = np_causal_conv(x[:, path], window, w)[:, -1]        # the path as an ordinary sequence
        assert rel_err(out[:, i], ref) < 1e-5


# ------------------------------------------------------------------------------------------------
# Gates
# ------------------------------------------------------------------------------------------------
@settings(max_examples=15)
@given(seed=st.integers(0, 2**31 - 1), shift=st.sampled_from([0.0, 15.0, 19.9, 20.0, 20.1, 30.0, 60.0, -30.0]))
def test_gates_match_torch(seed, shift):
    rng = np.random.default_rng(seed)
    HV = 5
    a = (rng.normal(size=(3, 4, HV)) * 3 + shift).astype(np.float32)
    b = (rng.normal(size=(3, 4, HV)) * 4).astype(np.float32)
    A_log = np.log(rng.uniform(0.01, 16, size=HV)).astype(np.float32)
    dt_bias = rng.normal(size=HV).astype(np.float32)
    g, beta = gdn.gates(a, b, A_log, dt_bias)
    ta, tb = torch.as_tensor(a), torch.as_tensor(b)
    g_ref = -torch.exp(torch.as_tensor(A_log)) * torch.nn.functional.softplus(ta + torch.as_tensor(dt_bias))
    beta_ref = torch.sigmoid(tb)
    assert g.dtype == jnp.float32 and beta.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(g), g_ref.numpy(), rtol=2e-6, atol=1e-30)
    np.testing.assert_allclose(np.asarray(beta), beta_ref.numpy(), rtol=2e-6, atol=1e-7)
    assert np.all(np.asarray(g) <= 0) and np.all(np.isfinite(np.asarray(g)))


def test_gates_bf16_inputs_compute_in_fp32():
    a = jnp.asarray([[25.0, -3.0, 0.5]], jnp.bfloat16)
    g, beta = gdn.gates(a, a, jnp.zeros(3, jnp.bfloat16), jnp.zeros(3, jnp.bfloat16))
    assert g.dtype == jnp.float32 and beta.dtype == jnp.float32
    ref = -torch.nn.functional.softplus(torch.tensor([[25.0, -3.0, 0.5]]))
    np.testing.assert_allclose(np.asarray(g), ref.numpy(), rtol=1e-6)


def correlated_chain_L(n: int, seed: int, spread: float = 0.05, beta: float = 0.97, decay: float = 0.999):
    """L of a chain of n nodes whose unit keys are nearly alike (spread around one direction), β and decays near
    1: the regime where the power series sums terms of size C(d, d/2) into inverse entries of size ~1."""
    rng = np.random.default_rng(seed)
    keys = rng.normal(size=32) + spread * rng.normal(size=(n, 32))
    keys /= np.linalg.norm(keys, axis=1, keepdims=True)
    i = np.arange(n)
    return np.tril(beta * (keys @ keys.T) * decay ** np.abs(i[:, None] - i[None, :]), -1)


@pytest.mark.parametrize("n", [16, 64])
def test_squaring_inverse_stays_accurate_on_deep_correlated_chains(n):
    """The squaring method past SERIES_BLOCK nodes per path (gdn.block_inverse: the factors on diagonal blocks,
    joined by doublings) stays fp32-accurate where the series alone does not (in fp32 it was off by a relative
    ~1e7 on the chain of 64)."""
    L = correlated_chain_L(n, 3)
    T = gdn.unit_lower_inverse(jnp.asarray(f32(L)[None]), "squaring", path_nodes=n)
    ref = np.linalg.inv(np.eye(n) + L)
    assert np.abs(ref).max() < 3                                    # the inverse itself is tame
    assert np.abs(np.asarray(T[0], np.float64) - ref).max() < 1e-4


@pytest.mark.parametrize("method", ["solve", "neumann", "squaring"])
def test_unit_lower_inverse_equals_numpy_inverse(method):
    rng = np.random.default_rng(11)
    parent = [-1, 0, 0, 1, 3, -1, 5, 4, 2]
    A = np_ancestor_mask(parent).astype(np.float64)
    L = (A - np.eye(len(parent))) * rng.normal(size=A.shape) * 0.7
    T = gdn.unit_lower_inverse(jnp.asarray(f32(L)[None]), method, path_nodes=depth_of(parent))
    ref = np.linalg.inv(np.eye(len(parent)) + L)
    assert rel_err(T[0], ref) < 1e-5


@pytest.mark.parametrize("depth_cap", [1, 2, 5])
def test_squaring_factors_with_query_equals_numpy(depth_cap):
    """M = (I+L)⁻¹ and C M from the right-multiplied factors that share their squares (the kernels' "f16_parallel"
    operator chain) equal numpy's inverse and its product with C, on a forest whose paths are at most depth_cap
    edges long (L^{d+1} = 0: the factors are exact)."""
    rng = np.random.default_rng(17 + depth_cap)
    n = 12
    parent = [i - 1 if i % (depth_cap + 1) else -1 for i in range(n)]     # chains of depth_cap edges, restarted
    A = np_ancestor_mask(parent).astype(np.float64)
    d = depth_of(parent) - 1                                                # edges on the longest path
    assert d == depth_cap
    L = (A - np.eye(n)) * rng.normal(size=A.shape) * 0.7
    C = A * rng.normal(size=A.shape)
    dot = lambda a, b: jnp.matmul(a, b, precision="highest")      # noqa: E731
    M, CM = gdn.squaring_factors_with_query(jnp.asarray(f32(L)), jnp.asarray(f32(C)), jnp.eye(n, dtype=jnp.float32),
                                            gdn.num_squarings(d), dot)
    ref = np.linalg.inv(np.eye(n) + L)
    assert rel_err(M, ref) < 1e-5 and rel_err(CM, C @ ref) < 1e-5
