"""spec.accept: greedy walk on a hand-made tree, and lossless rejection sampling checked empirically.

The sampling tests draw drafts exactly as the engine does (Gumbel-top-k = sequential draws without
replacement from q), run `accept` on many independent rows at once, and compare the emitted tokens with the
target distribution by a chi-square goodness-of-fit test. Threshold: p-value ≥ 1e-4 with a fixed seed, so a
correct rule fails with probability 1e-4 per run; the seeds are fixed, so the result is deterministic. The
i.i.d.-siblings rule (q not depleted after a rejected sibling; `_iid_one_level`, numpy) applied to drafts drawn
without replacement is the negative control: on the same kind of data it must fail the same test by a wide margin
(p < 1e-12), which shows the test has power against a wrong residual update.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from hyspec_jax import tree as tree_lib
from hyspec_jax.sampling import SlotSampling, warp
from hyspec_jax.spec.accept import accept

V = 8
NS = 100_000
accept_jit = jax.jit(accept, static_argnames=("max_children",))


def _dist(rng, sharp=2.0) -> np.ndarray:
    x = np.exp(sharp * rng.standard_normal(V))
    return x / x.sum()


def _draw_without_replacement(rng, q: np.ndarray, k: int) -> np.ndarray:
    """[rows, k] sequential draws without replacement (Gumbel-top-k), q [rows, V] or [V]."""
    q = np.broadcast_to(q, (NS, V))
    with np.errstate(divide="ignore"):
        score = np.log(q) + rng.gumbel(size=(NS, V))
    return np.argsort(-score, axis=1)[:, :k]


def _sampling(n, temperature=1.0, top_p=1.0, top_k=0) -> SlotSampling:
    return SlotSampling(temperature=jnp.full((n,), temperature, jnp.float32), top_p=jnp.full((n,), top_p, jnp.float32),
                        top_k=jnp.full((n,), top_k, jnp.int32), seed=jnp.arange(n, dtype=jnp.uint32))


def _tree(parent, valid, max_depth: int) -> tree_lib.Tree:
    """The tree of parent pointers [B, N] and validity, its envelope `max_depth` deep (accept's bound on the
    accepted drafts). Depths are those of the whole tree: a node deeper than the envelope stays (where
    `tree.from_parents(max_depth=)` would drop it), so the tests also see accept stop at the bound."""
    parent = jnp.asarray(parent)
    full = tree_lib.from_parents(parent, jnp.asarray(valid))
    return full.replace(envelope=tree_lib.TreeShape(parent.shape[1], max_depth))


def _keys(n, seed=0):
    return jax.random.split(jax.random.key(seed), n)


def _chisq(samples: np.ndarray, probs: np.ndarray) -> float:
    """p-value of a chi-square goodness-of-fit test (cells with expected count < 5 pooled)."""
    probs = np.asarray(probs, np.float64).reshape(-1)
    probs = probs / probs.sum()
    counts = np.bincount(samples.reshape(-1), minlength=probs.size).astype(float)
    n = counts.sum()
    assert counts[probs == 0].sum() == 0, "emitted a token outside the target's support"
    exp = probs * n
    small = exp < 5
    obs = np.concatenate([counts[~small], [counts[small].sum()]]) if small.any() else counts[~small]
    e = np.concatenate([exp[~small], [exp[small].sum()]]) if small.any() else exp[~small]
    keep = e > 0
    obs, e = obs[keep], e[keep]
    chi2 = float(np.sum((obs - e) ** 2 / e))
    return float(stats.chi2.sf(chi2, len(e) - 1))


def _one_level(rng, p_logits, q, k, sampling):
    """Anchor with k ≤ 3 children drawn without replacement from q; returns the emitted first token [NS].
    Always 4 nodes (unused ones invalid), so every one-level test shares one compiled program."""
    kids = _draw_without_replacement(rng, q, k)
    N = 4
    tokens = np.zeros((NS, N), np.int32)
    tokens[:, 1:k + 1] = kids
    parent = np.broadcast_to(np.array([-1, 0, 0, 0], np.int32), (NS, N))
    valid = np.broadcast_to(np.arange(N) <= k, (NS, N))
    logits = np.zeros((NS, N, V), np.float32)
    logits[:, 0] = p_logits
    child_q = np.zeros((NS, N, V), np.float32)
    child_q[:, 0] = q
    acc = accept_jit(jnp.asarray(logits), jnp.asarray(tokens), _tree(parent, valid, 1), jnp.asarray(child_q),
                     sampling, _keys(NS, int(rng.integers(1 << 30))), max_children=3)
    node, bonus = np.asarray(acc.node), np.asarray(acc.bonus)
    first = np.where(node > 0, tokens[np.arange(NS), node], bonus)
    assert np.array_equal(np.asarray(acc.num_accepted), (node > 0).astype(np.int32))
    return first, node


def test_chain_rejection_sampling_emits_the_target_distribution():
    rng = np.random.default_rng(0)
    p, q = _dist(rng), _dist(rng)
    first, node = _one_level(rng, np.log(p), q, 1, _sampling(NS))
    assert _chisq(first, p) > 1e-4
    # acceptance rate of one draft is Σ min(p, q)
    assert abs((node > 0).mean() - np.minimum(p, q).sum()) < 4 * np.sqrt(0.25 / NS)


@pytest.mark.parametrize("warped", [False, True])
def test_tree_siblings_without_replacement_emit_the_target_distribution(warped):
    rng = np.random.default_rng(1)
    logits = 2.0 * rng.standard_normal(V)
    if warped:   # target warped by temperature / top-k / top-p; the draft is any distribution on its own support
        samp = _sampling(NS, temperature=0.7, top_p=0.9, top_k=5)
        p = np.exp(np.asarray(warp(jnp.asarray(logits), jnp.float32(0.7), jnp.float32(0.9), jnp.int32(5))))
        q = _dist(rng) * (rng.random(V) < 0.8)
        q /= q.sum()
    else:
        samp = _sampling(NS)
        p = np.exp(logits - logits.max())
        p /= p.sum()
        q = _dist(rng)
    k = min(3, int((q > 0).sum()))
    first, node = _one_level(rng, logits, q, k, samp)
    assert _chisq(first, p) > 1e-4
    assert (node > 1).any() and (node == 0).any()   # later siblings and the residual were both exercised


def _iid_one_level(rng, p: np.ndarray, q: np.ndarray, k: int) -> np.ndarray:
    """The i.i.d.-drafts rule (SpecInfer's for siblings drawn with replacement: after a rejection the residual
    p ← norm(max(p − q, 0)) but q stays q) on k siblings drawn without replacement from q, one level: the emitted
    first token [NS]."""
    kids = _draw_without_replacement(rng, q, k)
    p_res = np.broadcast_to(p, (NS, V)).astype(np.float64)
    out = np.full(NS, -1)
    for i in range(k):
        x = kids[:, i]
        live = out < 0
        ok = live & (rng.random(NS) * q[x] < p_res[np.arange(NS), x])
        out[ok] = x[ok]
        rej = live & ~ok
        new = np.maximum(p_res - q, 0.0)
        s = new.sum(1, keepdims=True)
        new = np.where(s > 0, new / np.where(s > 0, s, 1.0), p_res)
        p_res = np.where(rej[:, None], new, p_res)
    miss = out < 0
    u = rng.random(miss.sum())
    out[miss] = np.minimum((np.cumsum(p_res[miss], axis=1) < u[:, None]).sum(1), V - 1)
    return out


def test_iid_sibling_rule_is_biased_for_draws_without_replacement():
    """Negative control: the same test rejects the i.i.d. rule (q not depleted) decisively."""
    rng = np.random.default_rng(2)
    p = np.array([0.02, 0.02, 0.3, 0.3, 0.2, 0.1, 0.03, 0.03])
    q = np.array([0.45, 0.35, 0.05, 0.05, 0.04, 0.02, 0.02, 0.02])
    good, _ = _one_level(rng, np.log(p), q, 3, _sampling(NS))
    bad = _iid_one_level(rng, p, q, 3)
    assert _chisq(good, p) > 1e-4
    assert _chisq(bad, p) < 1e-12


def test_two_level_tree_emits_the_target_joint():
    """Anchor → 2 children (without replacement from q1) → 2 children each (from q2[child]): the first two
    emitted tokens are distributed as p1(t1)·p2(t2 | t1). When nothing is accepted the second token is drawn
    from the true p2(·|t1) (what the next round would produce, losslessly)."""
    rng = np.random.default_rng(3)
    p1, q1 = _dist(rng), _dist(rng)
    p2 = np.stack([_dist(rng) for _ in range(V)])
    q2 = np.stack([_dist(rng) for _ in range(V)])
    c = _draw_without_replacement(rng, q1, 2)                                        # [NS, 2]
    # grandchildren: per row and child, 2 draws without replacement from q2[child]
    gc = np.zeros((NS, 2, 2), np.int64)
    for j in range(2):
        with np.errstate(divide="ignore"):
            score = np.log(q2[c[:, j]]) + rng.gumbel(size=(NS, V))
        gc[:, j] = np.argsort(-score, axis=1)[:, :2]
    N = 7
    tokens = np.zeros((NS, N), np.int32)
    tokens[:, 1:3] = c
    tokens[:, 3:5] = gc[:, 0]
    tokens[:, 5:7] = gc[:, 1]
    parent = np.broadcast_to(np.array([-1, 0, 0, 1, 1, 2, 2], np.int32), (NS, N))
    logits = np.zeros((NS, N, V), np.float32)
    logits[:, 0] = np.log(p1)
    logits[:, 1] = np.log(p2[c[:, 0]])
    logits[:, 2] = np.log(p2[c[:, 1]])
    for n in range(3, 7):
        logits[:, n] = rng.standard_normal(V)       # a third level the test does not look at
    child_q = np.zeros((NS, N, V), np.float32)
    child_q[:, 0] = q1
    child_q[:, 1] = q2[c[:, 0]]
    child_q[:, 2] = q2[c[:, 1]]
    acc = accept_jit(jnp.asarray(logits), jnp.asarray(tokens), _tree(parent, np.ones((NS, N), bool), 2),
                     jnp.asarray(child_q), _sampling(NS), _keys(NS, 7), max_children=2)
    node, m, bonus = np.asarray(acc.node), np.asarray(acc.num_accepted), np.asarray(acc.bonus)
    rows = np.arange(NS)
    par = parent[0]
    t1 = np.where(m >= 1, tokens[rows, np.where(m == 2, par[node], node)], bonus)
    t2 = np.where(m == 2, tokens[rows, node], np.where(m == 1, bonus, -1))
    miss = t2 < 0
    u = rng.random(miss.sum())
    t2[miss] = (np.cumsum(p2[t1[miss]], axis=1) < u[:, None]).sum(1)
    assert (m == 0).any() and (m == 1).any() and (m == 2).any()
    joint = p1[:, None] * p2
    assert _chisq(t1 * V + t2, joint) > 1e-4


def test_greedy_walk_on_a_hand_made_tree():
    """Rows without sampling follow the target's argmax: the deepest matching path, then the argmax bonus."""
    # node: 0 anchor, 1 (tok 3), 2 (tok 5) children of 0; 3 (tok 1) child of 2; 4 (tok 6), 5 (tok 2) children of 3
    tokens = np.array([[0, 3, 5, 1, 6, 2]] * 3, np.int32)
    parent = np.array([[-1, 0, 0, 2, 3, 3]] * 3, np.int32)
    valid = np.ones((3, 6), bool)
    valid[2, 5] = False                                   # row 2: node 5 is padding
    argmax = np.array([[5, 0, 1, 2, 0, 7],                # row 0: 0→2→3→5, bonus 7
                       [3, 4, 0, 0, 0, 0],                # row 1: 0→1, bonus 4
                       [5, 0, 1, 2, 0, 7]])               # row 2: node 5 invalid → stop at 3, bonus 2
    logits = np.full((3, 6, V), -1.0, np.float32)
    np.put_along_axis(logits, argmax[..., None], 1.0, axis=2)
    acc = accept_jit(jnp.asarray(logits), jnp.asarray(tokens), _tree(parent, valid, 3), None, None, None,
                     max_children=2)
    assert np.asarray(acc.node).tolist() == [5, 1, 3]
    assert np.asarray(acc.num_accepted).tolist() == [3, 1, 2]
    assert np.asarray(acc.bonus).tolist() == [7, 4, 2]


@pytest.mark.parametrize("max_depth", [1, 4, 6])
def test_greedy_closed_form_equals_the_walk(max_depth):
    """The all-greedy path (sampling None: pointer jumping over the tree) equals the sequential walk (the sampling
    path with every row at temperature 0) on random trees with distinct sibling tokens, deeper than max_depth,
    with padding nodes, and targets that agree with the drafts often."""
    rng = np.random.default_rng(max_depth)
    B, N, Vb, fan = 64, 16, 12, 3

    def random_tree():                                    # ≤ `fan` children a node, depth ≤ 7 edges
        par, depth, kids = [-1], [0], [0]
        for _ in range(1, N):
            open_ = [u for u in range(len(par)) if kids[u] < fan and depth[u] < 7]
            u = int(rng.choice(open_))
            par.append(u), depth.append(depth[u] + 1), kids.append(0)
            kids[u] += 1
        return par
    parent = np.array([random_tree() for _ in range(B)], np.int32)
    tokens = np.zeros((B, N), np.int32)
    for b in range(B):                                    # distinct tokens among siblings
        for p in range(-1, N):
            kids = np.nonzero(parent[b] == p)[0]
            tokens[b, kids] = rng.permutation(Vb)[:len(kids)]
    valid = rng.random((B, N)) > 0.1
    valid[:, 0] = True
    parent = np.where(valid, parent, -1)
    for _ in range(N):                                    # a node is valid only under a valid parent
        valid &= np.where(parent >= 0, np.take_along_axis(valid, np.maximum(parent, 0), 1), True)
    parent = np.where(valid, parent, -1)
    # target argmax: the token of a random child (a match) nearly always
    argmax = rng.integers(0, Vb, (B, N))
    for b in range(B):
        for u in range(N):
            kids = np.nonzero((parent[b] == u) & valid[b])[0]
            if len(kids) and rng.random() < 0.95:
                argmax[b, u] = tokens[b, rng.choice(kids)]
    logits = np.full((B, N, Vb), -1.0, np.float32)
    np.put_along_axis(logits, argmax[..., None], 1.0, axis=2)
    kids_max = fan
    args = (jnp.asarray(logits), jnp.asarray(tokens), _tree(parent, valid, max_depth))
    fast = accept_jit(*args, None, None, None, max_children=kids_max)
    walk = accept_jit(*args, jnp.zeros((B, N, Vb), jnp.float32), _sampling(B, temperature=0.0), _keys(B),
                      max_children=kids_max)
    for name in ("node", "num_accepted", "bonus"):
        np.testing.assert_array_equal(np.asarray(getattr(fast, name)), np.asarray(getattr(walk, name)), err_msg=name)
    assert 0 < float(np.mean(np.asarray(fast.num_accepted))) and int(np.max(np.asarray(fast.num_accepted))) == max_depth
