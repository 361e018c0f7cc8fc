"""Deferred commit (gdn.DeferredUpdates): accepted paths appended as factor rows, merged by the next verify.

Oracle: the serial one-token recurrence run along every accepted path, round after round.
Kernels run in Pallas interpret mode against the pure-JAX functions.
"""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from hyspec_jax import gdn
from hyspec_jax.pallas_kernels import trees
from hyspec_jax.pallas_kernels.gdn_commit import (deferred_append_pallas, deferred_append_reference, deferred_to_reference,
                                       path_commit_reference)
from hyspec_jax.pallas_kernels.gdn_tree_solve import SolveConfig, tree_solve_pallas


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.isfinite(a).all()
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _unit(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _softplus(x):
    return np.log1p(np.exp(x))


def _tree_inputs(rng, B, N, HK, HV, dk, dv):
    """Inputs drawn with numpy (an XLA compile per random shape would dominate these tests on a CPU)."""
    n = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    q = _unit(n(B, N, HK, dk)) * dk ** -0.5
    k = _unit(n(B, N, HK, dk))
    g = -_softplus(n(B, N, HV) + 1.0)
    beta = 1.0 / (1.0 + np.exp(-n(B, N, HV)))
    return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, n(B, N, HV, dv), g, beta))


mask_from_parents = jax.jit(trees.mask_from_parents)


def random_round(seed, B, N, HK, HV, dk, dv, depth):
    """A random tree of `depth` nodes on its longest path (the kernels' path_nodes) and its inputs."""
    par = trees.random_parents(seed, B, N, depth - 1)
    return par, mask_from_parents(jnp.asarray(par)), _tree_inputs(np.random.default_rng(seed), B, N, HK, HV, dk, dv)


def expand(x, HV):
    return jnp.repeat(x, HV // x.shape[2], axis=2)


solve, fold, append, node_state = map(jax.jit, (gdn.masked_solve, gdn.deferred_fold, gdn.deferred_append,
                                               gdn.node_state))
serial = jax.jit(gdn.serial_recurrence)


def test_deferred_rounds_equal_serial_recurrence():
    """Four rounds (one request accepting nothing in one of them, a merge after the second): the folded
    state equals the serial recurrence over all accepted tokens, and each verify's outputs equal the tree
    solve from the eagerly committed state."""
    B, N, HK, HV, dk, dv, depth, P = 2, 16, 2, 4, 16, 16, 5, 16
    S_base = jnp.asarray(np.random.default_rng(0).standard_normal((B, HV, dk, dv)) * 0.5, jnp.float32)
    S_serial, S_eager = S_base, S_base
    pend = gdn.deferred_empty(B, HV, P, dk, dv)
    rng = np.random.default_rng(0)
    for rnd in range(4):
        par, mask, (q, k, v, g, beta) = random_round(10 + rnd, B, N, HK, HV, dk, dv, depth)
        qe, ke = expand(q, HV), expand(k, HV)
        o, fac = solve(fold(S_base, pend), qe, ke, v, g, beta, mask)
        o_eager, fac_eager = solve(S_eager, qe, ke, v, g, beta, mask)
        assert rel(o, o_eager) < 1e-5
        node = rng.integers(0, N, size=B)
        if rnd == 1:
            node[0] = -1
        path, length = trees.paths_to(par, node, depth - 1)
        pend = append(pend, fac, jnp.asarray(path), jnp.asarray(length))
        S_eager = node_state(S_eager, fac_eager, mask, jnp.asarray(node, jnp.int32))
        for b in range(B):
            sel = [int(j) for j in path[b] if j >= 0]
            if not sel:
                continue
            pick = lambda x: x[b:b + 1, jnp.asarray(sel)]  # noqa: E731
            _, Sb = serial(S_serial[b:b + 1], pick(qe), pick(ke), pick(v), pick(g), pick(beta))
            S_serial = S_serial.at[b].set(Sb[0])
        assert rel(fold(S_base, pend), S_serial) < 1e-5
        assert rel(S_eager, S_serial) < 1e-5
        if rnd == 1:                                   # merge: the folded state becomes the base
            S_base, pend = fold(S_base, pend), gdn.deferred_empty(B, HV, P, dk, dv)
            assert int(pend.count.max()) == 0


def kernel_layout_deferred(seed, Lg, B, HK, HV, P, dk, dv, count):
    """Random deferred updates in the kernel layout; decays consistent (c_i ≥ c, rows past count junk)."""
    rng = np.random.default_rng(seed)
    c = -rng.uniform(size=(Lg, B, HV)).astype(np.float32) * 2.0
    rc = c[..., None] + rng.uniform(size=(Lg, B, HV, P)).astype(np.float32)        # e^{c − c_i} ≤ 1
    pk = _unit(rng.standard_normal((Lg, B, P, HK, dk)).astype(np.float32))
    pv = rng.standard_normal((Lg, B, HV, P, dv)).astype(np.float32)
    return (*map(jnp.asarray, (c, rc, pk, pv)), jnp.asarray(count, jnp.int32))


@pytest.mark.parametrize("HK", [1, 2])
def test_tree_solve_deferred_interpret(HK):
    B, N, HV, dk, dv, depth, P = 3, 16, 2, 16, 32, 5, 16
    par, mask, (q, k, v, g, beta) = random_round(40 + HK, B, N, HK, HV, dk, dv, depth)
    S_base = jnp.asarray(np.random.default_rng(3).standard_normal((B, HV, dk, dv)) * 0.5, jnp.float32)
    c, rc, pk, pv, count = kernel_layout_deferred(HK, 1, B, HK, HV, P, dk, dv, [0, 7, P])
    deferred = (c[0], rc[0], pk[0], pv[0], count)
    layer0 = jax.tree.map(lambda x: x[0], deferred_to_reference((c, rc, pk, pv, count), HV))
    S_eff = fold(S_base, layer0)
    o_ref, fac_ref = solve(S_eff, expand(q, HV), expand(k, HV), v, g, beta, mask)
    o, gamma, vc, S_new = tree_solve_pallas(S_base, q, k, v, g, beta, mask, deferred, path_nodes=depth,
                                            config=SolveConfig(method="squaring", block_v=16), write_state=True,
                                            interpret=True)
    assert rel(o, o_ref) < 1e-5 and rel(vc, fac_ref.corrected) < 1e-5
    assert rel(S_new, S_eff) < 1e-5
    o2, _, _ = tree_solve_pallas(S_base, q, k, v, g, beta, mask, deferred, path_nodes=depth,
                                 config=SolveConfig(method="neumann", block_v=32), interpret=True)
    assert rel(o2, o_ref) < 1e-5
    with pytest.raises(ValueError):
        tree_solve_pallas(S_base, q, k, v, g, beta, mask, path_nodes=depth, write_state=True, interpret=True)


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("HK", [1, 2])
def test_deferred_append_interpret(HK, layers):
    """The one-launch append over layers equals gdn.deferred_append per layer, and once folded equals the
    eager factorized commit (path_commit_reference) of the same accepted nodes — one layer a program, or two."""
    Lg, B, N, HV, dk, dv, depth, P = 2, 3, 16, 2, 16, 16, 5, 32
    par = trees.random_parents(55, B, N, depth - 1)
    mask = trees.mask_from_parents(jnp.asarray(par))
    rng = np.random.default_rng(HK)
    gam = jnp.asarray(np.einsum("lbhj,bij->lbhi", -rng.uniform(size=(Lg, B, HV, N)) * 0.3, np.asarray(mask, float)),
                      jnp.float32)
    keys = jnp.asarray(_unit(rng.standard_normal((Lg, B, N, HK, dk)).astype(np.float32)))
    vc = jnp.asarray(rng.standard_normal((Lg, B, HV, N, dv)), jnp.float32)
    node = [9, -1, N - 1]
    path, length = map(jnp.asarray, trees.paths_to(par, node, depth - 1))
    deferred = kernel_layout_deferred(7, Lg, B, HK, HV, P, dk, dv, [3, 0, P - depth])
    want = jax.jit(deferred_append_reference)(deferred, gam, keys, vc, path, length)
    got = deferred_append_pallas(deferred, gam, keys, vc, path, length, layers_per_program=layers, interpret=True)
    for name, a, b in zip(("c", "c_i", "keys", "values", "count"), got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6, err_msg=name)
    assert np.asarray(got[4]).tolist() == [3 + length[0], 0, P - depth + length[2]]
    # folded: the eager commit of the folded state
    S_base = jnp.asarray(rng.standard_normal((Lg, B, HV, dk, dv)), jnp.float32)
    fold = jax.jit(lambda d: jax.vmap(gdn.deferred_fold)(S_base, deferred_to_reference(d, HV)))  # noqa: E731
    eager = jax.jit(path_commit_reference)(fold(deferred), gam, keys, vc, mask, jnp.asarray(node, jnp.int32))
    assert rel(fold(got), eager) < 1e-5
    with pytest.raises(ValueError, match="layers_per_program"):
        deferred_append_pallas(deferred, gam, keys, vc, path, length, layers_per_program=3, interpret=True)
