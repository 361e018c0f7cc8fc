"""The acceptance surrogate (hyspec_jax.spec.expected) against a token-level Monte Carlo simulation of the
verification algorithms, and its gradients against finite differences in fp64.

The simulator below is an independent implementation of the *algorithms* (draw each sibling's token, run the
accept test on it, update the residual, draw the bonus), not of the closed form. Every Monte Carlo comparison
uses a tolerance of 5 standard errors of the Monte Carlo mean (false-failure probability ≈ 6e-7 per
comparison; the seeds are fixed anyway) and first asserts that the standard error is small enough for the
comparison to be sharp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hyspec_jax import tree as tree_lib
from hyspec_jax.spec import expected as E

SAMPLES = 1 << 17
N_PAD, DEPTH, K_PAD = 12, 4, 4   # one envelope for every tree: one compile per rule
Z = 5.0


# ------------------------------------------------------------------------------------------------
# Token-level simulator (one round over a tree whose root, node 0, is the anchor)
# ------------------------------------------------------------------------------------------------
def children_table(parent: np.ndarray, K: int) -> np.ndarray:
    ch = np.full((len(parent), K), -1, np.int32)
    fill = np.zeros(len(parent), int)
    for v, u in enumerate(parent.tolist()):
        if u >= 0:
            ch[u, fill[u]] = v
            fill[u] += 1
    assert fill.max() <= K
    return ch


def _draw(u, probs):
    """Inverse-CDF draw of one token from probs [V] with a uniform u."""
    return jnp.minimum(jnp.sum(u >= jnp.cumsum(probs)), probs.shape[-1] - 1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("rule", "without_replacement"))
def simulate(u_child, u_level, ch, p, q, *, rule: str, without_replacement: bool = False):
    """One round per sample, vmapped over samples. ch [N, K] children in visiting order (−1 = none);
    p, q [N, V]; uniforms u_child [S, depth, K, 2] (draft token, accept test of each sibling) and
    u_level [S, depth, 2] (target token, bonus token of each level).
    Returns (accepted drafts [S], first committed token [S])."""

    def one(u_child, u_level):
        def level(carry, us):
            node, alive, count, first, lvl = carry
            uc, ul = us
            r = p[node]
            y = jnp.argmax(r).astype(jnp.int32) if rule == "greedy" else _draw(ul[0], r)

            def sibling(c2, xs):
                accepted, nxt, tok, r, qcur = c2
                c, u = xs
                x = _draw(u[0], qcur)
                visit = alive & ~accepted & (c >= 0)
                if rule == "rejection":
                    ok = u[1] * qcur[x] < r[x]
                    res = jnp.maximum(r - qcur, 0.0)
                    res = jnp.where(res.sum() > 0, res / jnp.maximum(res.sum(), 1e-30), r)
                    r = jnp.where(visit & ~ok, res, r)
                else:
                    ok = x == y
                take = visit & ok
                if without_replacement:  # the next sibling cannot repeat x
                    drop = qcur.at[x].set(0.0)
                    qcur = jnp.where(visit & ~ok, drop / drop.sum(), qcur)
                return (accepted | take, jnp.where(take, c, nxt), jnp.where(take, x, tok), r, qcur), None

            init = (jnp.bool_(False), node, jnp.int32(-1), r, q[node])
            (accepted, nxt, tok, r, _), _ = jax.lax.scan(sibling, init, (ch[node], uc))
            bonus = _draw(ul[1], r) if rule == "rejection" else y
            first = jnp.where(lvl == 0, jnp.where(accepted, tok, bonus), first)
            count = count + (alive & accepted)
            return (nxt, alive & accepted, count, first, lvl + 1), None

        init = (jnp.int32(0), jnp.bool_(True), jnp.int32(0), jnp.int32(-1), jnp.int32(0))
        (_, _, count, first, _), _ = jax.lax.scan(level, init, (u_child, u_level))
        return count, first

    return jax.vmap(one)(u_child, u_level)


def monte_carlo(parents, p, q, rule, seed, without_replacement=False):
    """Per tree: Monte Carlo mean and standard error of the accepted drafts, and the first committed tokens.
    parents: list of 1-D parent arrays (anchor = node 0) padded into the N_PAD/DEPTH/K_PAD envelope."""
    rng = np.random.default_rng(seed)   # numpy uniforms: no PRNG program to compile
    means, ses, firsts = [], [], []
    for b, parent in enumerate(parents):
        ch = np.full((N_PAD, K_PAD), -1, np.int32)
        ch[:len(parent)] = children_table(parent, K_PAD)
        u_child = rng.random((SAMPLES, DEPTH, K_PAD, 2), np.float32)
        u_level = rng.random((SAMPLES, DEPTH, 2), np.float32)
        cnt, first = simulate(u_child, u_level, jnp.asarray(ch), jnp.asarray(p[b]), jnp.asarray(q[b]), rule=rule,
                              without_replacement=without_replacement)
        cnt = np.asarray(cnt, np.float64)
        means.append(cnt.mean())
        ses.append(cnt.std(ddof=1) / np.sqrt(SAMPLES))
        firsts.append(np.asarray(first))
    return np.array(means), np.array(ses), firsts


def dists(rng, shape, scale):
    return _softmax(scale * rng.standard_normal(shape))


def related(rng, p, noise):
    """Draft distributions correlated with the target's (so that several levels get accepted)."""
    return _softmax(np.log(p) + noise * rng.standard_normal(p.shape))


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).astype(np.float32)


def forest(parents) -> tree_lib.Tree:
    return tree_lib.pack_forest(parents, tree_lib.TreeShape(N_PAD, DEPTH))


expected_jit = jax.jit(E.tree_expected_accepted, static_argnames=("rule", "max_children"))
reach_jit = jax.jit(E.tree_acceptance, static_argnames=("rule", "max_children"))   # default max_children N − 1
chain_alpha_jit = jax.jit(E.chain_acceptance, static_argnames=("rule",))


def _trees():
    """A chain (anchor + 4 drafts), a wide-and-deep tree (fan-out 3 at the anchor), two random trees."""
    rng = np.random.default_rng(7)
    return [np.arange(5, dtype=np.int32) - 1,
            np.array([-1, 0, 0, 0, 1, 1, 2, 4, 4, 7], np.int32),
            tree_lib.random_parents(rng, 9, 3, min_depth=3),
            tree_lib.random_parents(rng, 12, DEPTH, min_depth=DEPTH)]


# ------------------------------------------------------------------------------------------------
# Closed form vs Monte Carlo
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rule", E.RULES)
def test_closed_form_matches_monte_carlo(rule):
    """Chain and trees, one rule: E[accepted drafts] within 5 standard errors of 2^17 simulated rounds."""
    rng = np.random.default_rng(11)
    V = 5
    parents = _trees()
    p = dists(rng, (len(parents), N_PAD, V), 1.5)
    q = related(rng, p, 1.0)
    tree = forest(parents)
    exact = np.asarray(expected_jit(tree, jnp.asarray(p), jnp.asarray(q), rule=rule, max_children=K_PAD),
                       np.float64)
    mean, se, firsts = monte_carlo(parents, p, q, rule, seed=100)
    assert np.all(se < 0.01)
    assert np.all(np.abs(mean - exact) < Z * se), (rule, mean, exact, se)
    assert np.all(exact > 0.1) and exact.max() > 0.5   # non-degenerate: every tree accepts something
    # the per-node reach probabilities sum to the same number, and the anchor is always reached
    reach = np.asarray(reach_jit(tree, jnp.asarray(p), jnp.asarray(q), rule=rule))
    assert np.all(reach[:, 0] == 1.0)
    np.testing.assert_allclose(reach[:, 1:].sum(-1), exact, rtol=1e-5)
    # the chain formula written out: Σ_k Π_{i≤k} α_i with the rule's α, equal to the one-child tree
    pc, qc = p[0, :4], q[0, :4]
    alpha = {"rejection": np.minimum(pc, qc).sum(-1), "match": (pc * qc).sum(-1),
             "greedy": qc[np.arange(4), pc.argmax(-1)]}[rule]
    np.testing.assert_allclose(np.asarray(chain_alpha_jit(jnp.asarray(pc), jnp.asarray(qc), rule=rule)), alpha,
                               rtol=1e-5)
    np.testing.assert_allclose(exact[0], np.cumprod(alpha).sum(), rtol=1e-5)
    np.testing.assert_allclose(float(E.tau_chain(jnp.asarray(pc), jnp.asarray(qc), rule)), 1 + exact[0], rtol=1e-5)
    # the simulated rule is lossless at the first position (a check on the simulator itself)
    for b, first in enumerate(firsts):
        hist = np.bincount(first, minlength=V) / SAMPLES
        want = np.eye(V)[p[b, 0].argmax()] if rule == "greedy" else p[b, 0]
        assert np.all(np.abs(hist - want) < Z * np.sqrt(want * (1 - want) / SAMPLES) + 1e-9), (rule, hist, want)


def test_chain_formula_on_ragged_chains():
    """tree_expected_accepted on chains of lengths 7, 4, 1 (invalid padding) = the chain formula on each prefix."""
    rng = np.random.default_rng(3)
    B, n, V = 3, 7, 11
    p = dists(rng, (B, n, V), 1.5)
    q = related(rng, p, 1.0)
    lengths = [7, 4, 1]
    tree = tree_lib.chain(B, n, jnp.asarray(lengths))
    for rule in E.RULES:
        t = np.asarray(jax.jit(E.tree_expected_accepted, static_argnames="rule")(tree, jnp.asarray(p),
                                                                               jnp.asarray(q), rule=rule))
        alpha = np.asarray(chain_alpha_jit(jnp.asarray(p), jnp.asarray(q), rule=rule))
        want = [np.cumprod(alpha[b, :m - 1]).sum() for b, m in enumerate(lengths)]
        np.testing.assert_allclose(t, want, rtol=1e-5, atol=1e-7)
        assert t[2] == 0.0


def test_siblings_drawn_without_replacement_are_a_different_model():
    """Negative control: the same trees with siblings drawn without replacement accept measurably more, far
    outside the Monte Carlo tolerance — the comparisons above can tell the two sampling rules apart."""
    rng = np.random.default_rng(5)
    parents = _trees()[1:2]
    V = 4
    p = dists(rng, (1, N_PAD, V), 1.0)
    q = dists(rng, (1, N_PAD, V), 2.0)
    exact = np.asarray(expected_jit(forest(parents), jnp.asarray(p), jnp.asarray(q), rule="match"))
    wor, se_wor, _ = monte_carlo(parents, p, q, "match", seed=9, without_replacement=True)
    assert wor[0] - exact[0] > 20 * se_wor[0], (wor, exact, se_wor)


def test_sibling_closed_forms():
    """Single-node identities: P(some child accepted) = 1 − Σ p(1 − q)^c for match; for rejection the step-by-step
    normalised residual of SpecInfer; p = q accepts the first child."""
    rng = np.random.default_rng(2)
    V, c = 7, 4
    p = dists(rng, (V,), 1.0)
    q = dists(rng, (V,), 1.0)
    acc = np.asarray(E.sibling_acceptance(jnp.asarray(p), jnp.asarray(q), c, "match"))
    np.testing.assert_allclose(acc.sum(), 1 - (p * (1 - q) ** c).sum(), rtol=1e-5)
    np.testing.assert_allclose(acc, [(p * q * (1 - q) ** j).sum() for j in range(c)], rtol=1e-5)
    acc_r = np.asarray(E.sibling_acceptance(jnp.asarray(p), jnp.asarray(q), c, "rejection"))
    r, reach, ref = p.astype(np.float64), 1.0, []
    for _ in range(c):
        beta = np.minimum(r, q).sum()
        ref.append(reach * beta)
        reach *= 1 - beta
        r = np.maximum(r - q, 0) / max(np.maximum(r - q, 0).sum(), 1e-30)
    np.testing.assert_allclose(acc_r, ref, rtol=1e-5, atol=1e-7)
    same = np.asarray(E.sibling_acceptance(jnp.asarray(p), jnp.asarray(p), c, "rejection"))
    np.testing.assert_allclose(same, [1, 0, 0, 0], atol=1e-6)
    with pytest.raises(ValueError, match="rule"):
        E.chain_acceptance(jnp.asarray(p), jnp.asarray(q), "typical")


# ------------------------------------------------------------------------------------------------
# Gradients
# ------------------------------------------------------------------------------------------------
def test_tree_surrogate_gradient_matches_finite_differences():
    """d τ / d (target logits, draft logits) in fp64 against central differences in random directions."""
    rng = np.random.default_rng(4)
    parents = _trees()[1:]
    V = 6
    tree = forest(parents)
    B = len(parents)
    with jax.enable_x64(True):
        lp = jnp.asarray(1.5 * rng.standard_normal((B, N_PAD, V)))
        lq = lp + jnp.asarray(rng.standard_normal((B, N_PAD, V)))

        @jax.jit
        def f(lp, lq):   # [rules]: Σ over the trees of τ
            P, Q = jax.nn.softmax(lp), jax.nn.softmax(lq)
            return jnp.stack([E.tau_tree(tree, P, Q, rule, max_children=K_PAD).sum() for rule in E.RULES])

        gp, gq = jax.jacrev(f, argnums=(0, 1))(lp, lq)            # [rules, B, N, V]
        assert gp.dtype == jnp.float64 and f(lp, lq).dtype == jnp.float64
        assert bool(jnp.all(jnp.abs(gq).max((1, 2, 3)) > 1e-3))
        greedy = E.RULES.index("greedy")
        assert float(jnp.abs(gp[greedy]).max()) == 0.0              # the argmax carries no gradient
        assert all(float(jnp.abs(gp[i]).max()) > 1e-3 for i in range(len(E.RULES)) if i != greedy)
        eps = 1e-6
        for _ in range(3):
            dp = jnp.asarray(rng.standard_normal(lp.shape))
            dq = jnp.asarray(rng.standard_normal(lq.shape))
            fd = (f(lp + eps * dp, lq + eps * dq) - f(lp - eps * dp, lq - eps * dq)) / (2 * eps)
            an = jnp.einsum("rbnv,bnv->r", gp, dp) + jnp.einsum("rbnv,bnv->r", gq, dq)
            np.testing.assert_allclose(np.asarray(an), np.asarray(fd), rtol=1e-6, atol=1e-9)
