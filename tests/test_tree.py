"""Tree topology: derived tables vs naive Python walks, and the tree solve / tree conv vs the serial oracle
run on every node's root-to-node path (docs/design.md §9)."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from hyspec_jax import gdn, tree as T

B, N = 3, 64          # fixed envelope of the property tests
HV, DK, DV = 6, 16, 8
C, K = 12, 4          # conv channels, kernel


# ------------------------------------------------------------------------------------------------
# Naive oracles (pure Python walks over parent pointers)
# ------------------------------------------------------------------------------------------------
def naive_paths(parent: np.ndarray, valid: np.ndarray) -> list[list[list[int]]]:
    """paths[b][i] = root-to-node list of node indices for valid nodes, [i] for invalid ones."""
    out = []
    for p, v in zip(parent, valid):
        rows = []
        for i in range(len(p)):
            if not v[i]:
                rows.append([i])
                continue
            path, j = [], i
            while j >= 0:
                path.append(j)
                j = int(p[j])
            rows.append(path[::-1])
        out.append(rows)
    return out


def padded_paths(paths, length: int, left: bool) -> np.ndarray:
    """[B, N, length] node indices of each path, padded with −1 on the left (or right)."""
    idx = np.full((len(paths), len(paths[0]), length), -1, np.int32)
    for b, rows in enumerate(paths):
        for i, pth in enumerate(rows):
            if left:
                idx[b, i, length - len(pth):] = pth
            else:
                idx[b, i, :len(pth)] = pth
    return idx


def random_forest(seed: int, depth: int, n_rows: int = B, n_max: int = N, holes: bool = True):
    """Per-row random trees of depth ≤ `depth` (row 0 reaches it when it has enough nodes) padded to
    n_max, optionally with invalid nodes in the middle (invalidity propagated to descendants).
    Returns (parent, valid) numpy [n_rows, n_max]."""
    rng = np.random.default_rng(seed)
    P = np.full((n_rows, n_max), -1, np.int32)
    V = np.zeros((n_rows, n_max), bool)
    for b in range(n_rows):
        n = int(rng.integers(depth + 1 if b == 0 else 1, n_max + 1))
        roots = 1 if b == 0 or rng.random() < 0.7 else int(rng.integers(1, min(n, 4) + 1))
        lo = min(depth, n - roots)
        p = T.random_parents(rng, n, depth, min_depth=lo if b == 0 else int(rng.integers(0, lo + 1)),
                             roots=roots)
        v = np.ones(n, bool)
        if holes and b > 0 and n > 1 and rng.random() < 0.6:
            v[rng.choice(n, size=int(rng.integers(1, max(2, n // 4))), replace=False)] = False
            for i in range(n):                      # descendants of invalid nodes are invalid
                if p[i] >= 0 and not v[p[i]]:
                    v[i] = False
        P[b, :n], V[b, :n] = np.where(v, p, -1), v
    return P, V


# ------------------------------------------------------------------------------------------------
# Topology tables
# ------------------------------------------------------------------------------------------------
DMAX = 8   # envelope depth of the property tests (trees inside reach depths 1..8): one compile each


@jax.jit
def _tables(parent, valid, prefix, node):
    tr = T.from_parents(parent, valid, max_depth=DMAX)
    return (tr, T.ancestor_mask(tr), T.kth_ancestor(tr, DMAX + 2), T.conv_taps(tr, K),
            T.positions(tr, prefix), T.path_to(tr, node), T.window_taps_after(tr, node, K))


@given(seed=st.integers(0, 2**31 - 1), depth=st.integers(1, DMAX))
def test_tables_match_naive_walk(seed, depth):
    P, V = random_forest(seed, depth)
    rng = np.random.default_rng(seed + 1)
    prefix = rng.integers(0, 1000, size=B).astype(np.int32)
    node = np.array([int(rng.choice(np.flatnonzero(v))) if v.any() else -1 for v in V], np.int32)
    node[0] = -1 if rng.random() < 0.3 else node[0]
    tr, mask, kth, taps, pos, (path, plen), wtaps = jax.tree.map(np.asarray, _tables(P, V, prefix, node))
    paths = naive_paths(P, V)

    want_depth = np.zeros((B, N), np.int32)
    want_mask = np.zeros((B, N, N), bool)
    want_kth = np.zeros((B, N, DMAX + 3), np.int32)
    want_taps = np.zeros((B, N, K), np.int32)
    for b in range(B):
        for i in range(N):
            pth = paths[b][i]
            want_depth[b, i] = len(pth) - 1
            want_mask[b, i, pth] = True
            up = pth[::-1]                                      # self, parent, …
            want_kth[b, i] = [up[j] if j < len(up) else -(j - len(up) + 1) for j in range(DMAX + 3)]
            # conv: the last K entries of (window rows 0..K−2, then the path's inputs at K−1+node)
            want_taps[b, i] = (list(range(K - 1)) + [K - 1 + j for j in pth])[-K:]
    assert want_depth[0].max() == depth
    np.testing.assert_array_equal(tr.valid, V)
    np.testing.assert_array_equal(tr.parent, P)
    np.testing.assert_array_equal(tr.depth, want_depth)
    np.testing.assert_array_equal(pos, prefix[:, None] + want_depth)
    np.testing.assert_array_equal(mask, want_mask)
    np.testing.assert_array_equal(kth, want_kth)
    np.testing.assert_array_equal(taps, want_taps)
    # invalid nodes are isolated: only the diagonal in their row and column
    diag = np.eye(N, dtype=bool)[None]
    assert not (mask & ~diag & (~V[:, :, None] | ~V[:, None, :])).any()
    for b in range(B):
        a = node[b]
        want_path = [] if a < 0 else paths[b][a]
        assert plen[b] == len(want_path)
        np.testing.assert_array_equal(path[b], want_path + [-1] * (DMAX + 1 - len(want_path)))
        stream = list(range(K - 1)) + [K - 1 + j for j in want_path]
        np.testing.assert_array_equal(wtaps[b], stream[-(K - 1):])


_from_parents = jax.jit(T.from_parents, static_argnames="max_depth")   # one compile, not op-by-op


def test_from_parents_sanitises():
    # row 0: node 3 is deeper than max_depth=2, node 4 hangs below it; node 5 names a later parent.
    # row 1: node 1 invalid, so its child 2 and grandchild 3 are dropped; node 4 parent out of range.
    parent = np.array([[-1, 0, 1, 2, 3, 6, 0, -1],
                       [-1, 0, 1, 2, -5, 0, 5, 0]], np.int32)
    valid = np.ones_like(parent, bool)
    valid[1, 1] = False
    tr = jax.tree.map(np.asarray, _from_parents(parent, valid, max_depth=2))
    np.testing.assert_array_equal(tr.valid, [[1, 1, 1, 0, 0, 0, 1, 1], [1, 0, 0, 0, 0, 1, 1, 1]])
    np.testing.assert_array_equal(tr.depth, [[0, 1, 2, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 1, 2, 1]])
    np.testing.assert_array_equal(tr.parent, [[-1, 0, 1, -1, -1, -1, 0, -1], [-1, -1, -1, -1, -1, 0, 5, 0]])
    # default max_depth (N − 1) keeps every well-formed node
    tr = _from_parents(np.array([[-1, 0, 1, 2, 3, 4]]))
    assert tr.envelope == T.TreeShape(6, 5) and np.asarray(tr.valid).all()
    np.testing.assert_array_equal(tr.depth, [np.arange(6)])


@jax.jit
def _chain_tables(lengths, prefix):
    tr, full = T.chain(2, 7, lengths=lengths), T.chain(2, 7)
    return tr, T.ancestor_mask(tr), T.positions(tr, prefix), T.ancestor_mask(full), T.conv_taps(full, K)


def test_chain_is_the_lower_triangle():
    tr, mask, pos, full_mask, full_taps = _chain_tables(jnp.array([7, 4]), jnp.array([10, 20]))
    assert tr.envelope == T.TreeShape(7, 6) and tr.envelope.path_nodes == 7
    np.testing.assert_array_equal(mask[0], np.tril(np.ones((7, 7), bool)))
    want = np.tril(np.ones((7, 7), bool))
    want[4:], want[:, 4:] = False, False
    want[np.arange(4, 7), np.arange(4, 7)] = True
    np.testing.assert_array_equal(mask[1], want)
    np.testing.assert_array_equal(pos, [10 + np.arange(7), [20, 21, 22, 23, 20, 20, 20]])
    np.testing.assert_array_equal(full_mask, gdn.chain_mask(2, 7))
    # chain taps are gdn.causal_conv's sliding window over concat(window, x)
    np.testing.assert_array_equal(full_taps[0], np.arange(7)[:, None] + np.arange(K)[None])


def test_pack_forest_and_unpack():
    env = T.TreeShape(max_nodes=6, max_depth=3)
    trees = [np.array([-1, 0, 0, 1, 2]), np.array([-1]), np.array([-1, 0, 1, 2, 0, 4])]
    tr = T.pack_forest(trees, env, batch=4)
    assert tr.envelope == env and tr.parent.shape == (4, 6)
    np.testing.assert_array_equal(tr.valid.sum(1), [5, 1, 6, 0])
    np.testing.assert_array_equal(tr.depth[0], [0, 1, 1, 2, 2, 0])
    # device derivation agrees with the host packing
    dev = _from_parents(tr.parent, tr.valid, max_depth=3)
    for a, b in zip(jax.tree.leaves(dev), jax.tree.leaves(tr)):
        np.testing.assert_array_equal(a, b)
    back = T.unpack(tr)
    for got, want in zip(back, trees + [np.array([], np.int32)]):
        np.testing.assert_array_equal(got, want)
    # unpack renumbers around holes
    holes = _from_parents(np.array([[-1, 0, -1, 1, 0]]), np.array([[1, 1, 0, 1, 1]]))
    np.testing.assert_array_equal(T.unpack(holes)[0], [-1, 0, 1, 0])

    with pytest.raises(ValueError, match="max_nodes=6"):
        T.pack_forest([np.array([-1, 0, 0, 0, 0, 0, 0])], env)
    with pytest.raises(ValueError, match="max_depth=3"):
        T.pack_forest([np.array([-1, 0, 1, 2, 3])], env)
    with pytest.raises(ValueError, match="tree 1: node 2 has parent 2"):
        T.pack_forest([np.array([-1]), np.array([-1, 0, 2])], env)
    with pytest.raises(ValueError, match="batch of 1"):
        T.pack_forest(trees, env, batch=1)
    with pytest.raises(ValueError):
        T.TreeShape(0, 1)


def test_tree_expansion_widths():
    """Beam widths per depth: top_k^d until the beam caps them; candidates count the anchor."""
    e = T.TreeExpansion(depth=4, top_k=2, beam=4)
    assert e.widths() == (2, 4, 4, 4) and e.num_candidates == 15
    assert T.TreeExpansion(depth=3, top_k=3, beam=100).widths() == (3, 9, 27)
    assert T.TreeExpansion(depth=2, top_k=1, beam=1).num_candidates == 3
    for bad in ((0, 1, 1), (1, 0, 1), (1, 1, 0)):
        with pytest.raises(ValueError):
            T.TreeExpansion(*bad)


def test_random_parents_respects_bounds():
    rng = np.random.default_rng(0)
    seen_orders = set()
    for _ in range(50):
        n, d = int(rng.integers(1, 40)), int(rng.integers(1, 9))
        lo = int(rng.integers(0, min(d, n - 1) + 1))
        p = T.random_parents(rng, n, d, min_depth=lo)
        depth = T.parent_depths(p)
        assert len(p) == n and (p == -1).sum() == 1 and lo <= depth.max() <= d
        seen_orders.add(tuple(p[:4]))
    assert len(seen_orders) > 5   # relabelling really varies the order
    with pytest.raises(ValueError, match="max_depth=0"):
        T.random_parents(rng, 3, 0)
    np.testing.assert_array_equal(T.random_parents(rng, 3, 0, roots=3), [-1, -1, -1])


# ------------------------------------------------------------------------------------------------
# The key property: tree solve / tree conv == serial oracle along every node's path
# ------------------------------------------------------------------------------------------------
def _inputs(seed: int, hk: int, b: int = B, n: int = N, hv: int = HV):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    q, k = gdn.prepare_qk(jnp.asarray(f(b, n, hk, DK)), jnp.asarray(f(b, n, hk, DK)))
    v = jnp.asarray(f(b, n, hv, DV))
    g, beta = gdn.gates(jnp.asarray(f(b, n, hv)), jnp.asarray(f(b, n, hv)),
                        jnp.asarray(f(hv) * 0.5), jnp.asarray(f(hv)))
    S0 = jnp.asarray(f(b, hv, DK, DV))
    return S0, q, k, v, g, beta


def _all_node_states(S0, fac, mask):
    n, b = mask.shape[1], mask.shape[0]
    nodes = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[:, None], (n, b))
    return jax.vmap(lambda nd: gdn.node_state(S0, fac, mask, nd), out_axes=1)(nodes)   # [B, N, HV, dk, dv]


@jax.jit
def _tree_solve(parent, valid, S0, q, k, v, g, beta):
    tr = T.from_parents(parent, valid, max_depth=DMAX)
    mask = T.ancestor_mask(tr)
    g, beta = gdn.invalidate(g, beta, tr.valid)
    outs = {}
    for method in ("solve", "neumann", "squaring"):
        o, fac = gdn.masked_solve(S0, q, k, v, g, beta, mask, method=method, path_nodes=tr.envelope.path_nodes)
        outs[method] = (o, _all_node_states(S0, fac, mask))
    return outs


@jax.jit
def _path_oracle(idx, S0, q, k, v, g, beta):
    """idx [B, N, L] left-padded with −1 (identity steps): serial recurrence over each path, batched."""
    b, n, L = idx.shape
    on = (idx >= 0)[..., None]
    gather = lambda x: jax.vmap(lambda xb, ib: xb[jnp.maximum(ib, 0)])(x, idx)     # [B, N, L, ...]
    qp, kp, vp = (gather(x).reshape(b * n, L, *x.shape[2:]) for x in (q, k, v))
    gp = jnp.where(on, gather(g), 0.0).reshape(b * n, L, -1)
    bp = jnp.where(on, gather(beta), 0.0).reshape(b * n, L, -1)
    o, S = gdn.serial_recurrence(jnp.repeat(S0, n, axis=0), qp, kp, vp, gp, bp)
    return o[:, -1].reshape(b, n, *o.shape[2:]), S.reshape(b, n, *S.shape[1:])


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


@given(seed=st.integers(0, 2**31 - 1), depth=st.integers(1, DMAX), gva=st.sampled_from([1, 2, 3]))
def test_tree_solve_equals_serial_recurrence_on_every_path(seed, depth, gva):
    P, V = random_forest(seed, depth)
    S0, q, k, v, g, beta = _inputs(seed, HV // gva)
    # garbage in invalid nodes must not leak into valid ones
    bad = ~jnp.asarray(V)[..., None, None]
    q, k = jnp.where(bad, 1e3, q), jnp.where(bad, -1e3, k)
    v = jnp.where(bad, 7e2, v)
    outs = _tree_solve(P, V, S0, q, k, v, g, beta)
    gi, bi = gdn.invalidate(g, beta, jnp.asarray(V))
    o_ref, S_ref = _path_oracle(jnp.asarray(padded_paths(naive_paths(P, V), DMAX + 1, left=True)),
                                S0, q, k, v, gi, bi)
    ok = V[..., None, None]
    for method, (o, S) in outs.items():
        assert _rel(np.where(ok, o, 0), np.where(ok, o_ref, 0)) < 1e-5, method
        assert _rel(np.where(ok[..., None], S, 0), np.where(ok[..., None], S_ref, 0)) < 1e-5, method
        # invalid nodes are identity steps from S0: their "state" is S0 and every value is finite
        assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(S)).all()
        S0_all = np.broadcast_to(np.asarray(S0)[:, None], S.shape)
        np.testing.assert_allclose(np.asarray(S)[~V], S0_all[~V], rtol=1e-6)


@partial(jax.jit, static_argnames="envelope")
def _series(parent, S0, q, k, v, g, beta, envelope):
    tr = T.from_parents(parent, max_depth=envelope.max_depth)
    mask = T.ancestor_mask(tr)
    out = {}
    for method in ("neumann", "squaring"):
        for rounds in (envelope.path_nodes, envelope.path_nodes - 1):
            o, fac = gdn.masked_solve(S0, q, k, v, g, beta, mask, method=method, path_nodes=rounds)
            out[method, rounds] = (o, _all_node_states(S0, fac, mask))
    return tr, out


@pytest.mark.parametrize("depth", [2, 8])
def test_envelope_depth_is_what_the_series_needs(depth):
    """TreeShape.path_nodes is exactly enough Neumann / squaring rounds; one node fewer is wrong.

    Identical keys, β ≈ 0.9 and no decay make every power of L large, so a missing term shows."""
    n = 24
    rng = np.random.default_rng(depth)
    P = np.full((B, N), -1, np.int32)   # N-node rows (the oracle's compiled shape), n real nodes each
    P[:, :n] = np.stack([T.random_parents(rng, n, depth, min_depth=depth) for _ in range(B)])
    S0, q, _, v, _, _ = _inputs(depth, HV)
    k = jnp.broadcast_to(gdn.l2norm(jnp.ones(DK)), (B, N, HV, DK))
    g, beta = jnp.zeros((B, N, HV)), jnp.full((B, N, HV), 0.9)
    env = T.TreeShape(N, depth)
    tr, out = _series(P, S0, q, k, v, g, beta, env)
    assert tr.envelope == env and int(tr.depth.max()) == depth
    o_ref, S_ref = _path_oracle(jnp.asarray(padded_paths(naive_paths(P, np.ones_like(P, bool)), DMAX + 1,
                                                         left=True)), S0, q, k, v, g, beta)
    for method in ("neumann", "squaring"):
        o, S = out[method, env.path_nodes]
        assert _rel(o, o_ref) < 1e-5 and _rel(S, S_ref) < 1e-5, method
        o, S = out[method, env.path_nodes - 1]
        assert _rel(o, o_ref) > 1e-2, method


@jax.jit
def _tree_conv(parent, valid, x, window, weight, node):
    tr = T.from_parents(parent, valid, max_depth=DMAX)
    y = gdn.gathered_conv(x, window, weight, T.conv_taps(tr, K))
    rows = T.window_taps_after(tr, node, K)
    xs = jnp.concatenate([window, x], axis=1)
    return y, jnp.take_along_axis(xs, rows[..., None], axis=1)


@jax.jit
def _conv_oracle(left_idx, length, x, window, weight, node_path, node_len):
    """gdn.causal_conv over every node's path (left_idx [B,N,L] left-padded, L = DMAX+1), one call per
    path length; and gdn.conv_window_after along node_path [B, L] (right-padded, node_len valid)."""
    b, n, L = left_idx.shape
    xp = jax.vmap(lambda xb, ib: xb[jnp.maximum(ib, 0)])(x, left_idx).reshape(b * n, L, -1)
    win = jnp.repeat(window, n, axis=0)
    y = jnp.zeros((b * n, x.shape[-1]))
    for ell in range(1, L + 1):          # the last ell entries are the whole path of nodes of depth ell−1
        y_ell = gdn.causal_conv(xp[:, L - ell:], win, weight)[:, -1]
        y = jnp.where((length.reshape(-1) == ell)[:, None], y_ell, y)
    xn = jax.vmap(lambda xb, ib: xb[jnp.maximum(ib, 0)])(x, node_path)
    return y.reshape(b, n, -1), gdn.conv_window_after(xn, window, node_len)


@given(seed=st.integers(0, 2**31 - 1), depth=st.integers(1, DMAX))
def test_tree_conv_equals_causal_conv_on_every_path(seed, depth):
    P, V = random_forest(seed, depth)
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((B, N, C)).astype(np.float32))
    window = jnp.asarray(rng.standard_normal((B, K - 1, C)).astype(np.float32))
    weight = jnp.asarray(rng.standard_normal((C, K)).astype(np.float32))
    node = np.array([int(rng.choice(np.flatnonzero(v))) if v.any() else -1 for v in V], np.int32)
    node[-1] = -1
    y, win_after = _tree_conv(P, V, x, window, weight, node)
    paths = naive_paths(P, V)
    length = np.array([[len(p) for p in rows] for rows in paths], np.int32)
    node_paths = [paths[b][a] if a >= 0 else [] for b, a in enumerate(node)]
    node_path = np.full((B, DMAX + 1), -1, np.int32)
    for b, pth in enumerate(node_paths):
        node_path[b, :len(pth)] = pth
    y_ref, win_ref = _conv_oracle(jnp.asarray(padded_paths(paths, DMAX + 1, left=True)), jnp.asarray(length),
                                  x, window, weight, jnp.asarray(node_path),
                                  jnp.asarray([len(p) for p in node_paths], jnp.int32))
    ok = V[..., None]
    assert _rel(np.where(ok, y, 0), np.where(ok, y_ref, 0)) < 1e-5
    np.testing.assert_array_equal(win_after, win_ref)
