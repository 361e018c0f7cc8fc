"""Differentiable acceptance surrogate: the expected number of tokens one speculative round commits.

Convention (docs/design.md §2): a round verifies drafts hanging below the anchor and commits the accepted drafts plus
one bonus token (the target's choice at the last accepted node), so

    τ = 1 + E[number of accepted drafts]          (tokens committed per round, ≥ 1).

The functions here return E[accepted drafts]; `tau_*` adds the bonus.

Probability model (what "exact" refers to)
-------------------------------------------
Distributions are given per position (chain) or per node (tree) and do **not** depend on the tokens drawn
along the way: node u carries the target distribution p_u (over the token that follows u; row u of the verify
logits) and the draft distribution q_u that u's children are drawn from. This is exactly the situation of a
teacher-forced training batch (and the usual Σ_k Π α_k analysis of speculative decoding). Under this model the
closed forms below are exact expectations, which `tests/test_expected.py` checks against a token-level Monte
Carlo simulation of the verification algorithms.

Tree drafting and the sampling rule assumed
-------------------------------------------
The c children of node u carry tokens drawn **i.i.d. (with replacement) from q_u**, and they are visited in
node-index order — an order fixed before the tokens are drawn (equivalently: each sibling's token is drawn when
it is visited). Siblings sorted by their own tokens' probabilities, or drawn without replacement (Gumbel-top-k,
as `spec.select.tree_candidates` does for sampling rows), are *not* this model; the expectation differs (the
tests show the difference is far outside Monte Carlo error for sampling without replacement).

Verification rules (`rule`):

- ``"rejection"`` — lossless rejection sampling; on a tree, SpecInfer's multi-step speculative sampling
  (Miao et al. 2023, "VerifyStochastic"): residual r ← p_u; for each child j in order, accept its token x with
  probability min(1, r(x)/q_u(x)); on rejection r ← norm(max(r − q_u, 0)); if every child is rejected the bonus
  is drawn from r. With i.i.d. siblings the committed token is distributed exactly as p_u. For a chain this is
  Leviathan / Chen speculative sampling: α_k = Σ_x min(p_k(x), q_k(x)).
- ``"greedy"`` — greedy verification (temperature-0 target) of stochastic drafts: the target's token at u is
  y_u = argmax p_u; the first child whose token equals y_u is accepted. α_k = q_k(argmax p_k). No gradient
  flows into p (the argmax is piecewise constant).
- ``"match"`` — the target samples its own token y_u ~ p_u and the first child with token y_u is accepted
  (DFlash v1's reference rule, also lossless). α_k = Σ_x p_k(x) q_k(x).

Closed form over siblings. With unnormalised residuals R_0 = p̃_u (p_u, or one-hot(argmax p_u) for greedy) and
M_j = Σ R_j (probability that the first j children were all rejected):

    rejection:     P(child j accepted) = Σ_x min(R_j(x), M_j q_u(x)),   R_{j+1} = max(R_j − M_j q_u, 0)
    greedy/match:  P(child j accepted) = Σ_x R_j(x) q_u(x),              R_{j+1} = R_j ⊙ (1 − q_u)

(for rejection, R_j / M_j is SpecInfer's normalised residual; for match, R_j(y) = p(y)(1 − q(y))^j). The
probability that node v is on the accepted path is the product of these edge probabilities along its path, and
E[accepted drafts] = Σ_{v ≠ root} P(v accepted). Everything is a smooth (a.e.) function of p and q; no
division appears, so zero-mass residuals need no special case.
"""

from __future__ import annotations

from typing import Literal

import chex
import jax
import jax.numpy as jnp

from hyspec_jax.tree import Tree

Rule = Literal["rejection", "greedy", "match"]
RULES = ("rejection", "greedy", "match")


def _check_rule(rule: str) -> None:
    if rule not in RULES:
        raise ValueError(f"unknown verification rule {rule!r}; expected one of {RULES}")


def target_choice(p: jax.Array, rule: Rule) -> jax.Array:
    """The distribution of the target's token the drafts are compared with (R_0): one-hot argmax for greedy."""
    _check_rule(rule)
    if rule == "greedy":
        return jax.nn.one_hot(jnp.argmax(p, axis=-1), p.shape[-1], dtype=p.dtype)
    return p


def sibling_acceptance(p: jax.Array, q: jax.Array, num_children: int, rule: Rule) -> jax.Array:
    """P(the j-th of `num_children` i.i.d. q-drafted siblings is the accepted child | their parent reached).

    p, q [..., V] (probabilities) -> [..., num_children]. The sum over j is the probability that some child is
    accepted; one minus it is the probability that the bonus token is drawn at the parent.
    """
    chex.assert_equal_shape([p, q])
    R = target_choice(p, rule)

    def body(R, _):
        M = jnp.sum(R, axis=-1, keepdims=True)
        if rule == "rejection":
            acc = jnp.sum(jnp.minimum(R, M * q), axis=-1)
            R = jnp.maximum(R - M * q, 0.0)
        else:
            acc = jnp.sum(R * q, axis=-1)
            R = R * (1.0 - q)
        return R, acc

    _, acc = jax.lax.scan(body, R, None, length=num_children)
    return jnp.moveaxis(acc, 0, -1)


# ------------------------------------------------------------------------------------------------
# Chain
# ------------------------------------------------------------------------------------------------
def chain_acceptance(p: jax.Array, q: jax.Array, rule: Rule = "rejection") -> jax.Array:
    """Per-position conditional acceptance α_k [..., γ] of a chain.

    p [..., γ, V]: target distribution for draft position k (row k of the verify output, computed at the node
    before draft k: the anchor for k = 0); q [..., γ, V]: the draft distribution draft k was drawn from.
    rejection: Σ min(p, q); greedy: q(argmax p); match: Σ p q.
    """
    return sibling_acceptance(p, q, 1, rule)[..., 0]


def chain_expected_accepted(p: jax.Array, q: jax.Array, rule: Rule = "rejection") -> jax.Array:
    """E[accepted drafts] = Σ_k Π_{i≤k} α_i  ([...]); see `chain_acceptance` for the inputs."""
    return jnp.sum(jnp.cumprod(chain_acceptance(p, q, rule), axis=-1), axis=-1)


def tau_chain(p: jax.Array, q: jax.Array, rule: Rule = "rejection") -> jax.Array:
    """Expected tokens committed per round (accepted drafts + 1 bonus)."""
    return 1.0 + chain_expected_accepted(p, q, rule)


# ------------------------------------------------------------------------------------------------
# Tree
# ------------------------------------------------------------------------------------------------
def sibling_rank(tree: Tree) -> jax.Array:
    """int32 [B, N]: index of each node among its parent's valid children in node order (0 = visited first)."""
    par, valid = tree.parent, tree.valid
    N = par.shape[1]
    same = (par[:, :, None] == par[:, None, :]) & valid[:, None, :]
    earlier = jnp.tril(jnp.ones((N, N), bool), -1)[None]
    return jnp.sum(same & earlier, axis=-1, dtype=jnp.int32)


def tree_acceptance(tree: Tree, p: jax.Array, q: jax.Array, rule: Rule = "rejection",
                    max_children: int | None = None) -> jax.Array:
    """P(node v is on the accepted path) [B, N]: 1 for roots (parent −1, the anchor), 0 for invalid nodes.

    p [B, N, V]: target distribution at each node (over the token after it); q [B, N, V]: the distribution
    each node's children were drawn from (siblings share it; rows of leaves are unused). `max_children`
    (static) must bound the number of children of any node; default N − 1 (always enough).
    """
    B, N = tree.parent.shape
    chex.assert_shape([p, q], (B, N, None))
    K = max(1, N - 1 if max_children is None else int(max_children))
    acc = sibling_acceptance(p, q, K, rule)                                      # [B, N(parent), K]
    par = jnp.maximum(tree.parent, 0)
    rank = jnp.minimum(sibling_rank(tree), K - 1)
    edge = acc[jnp.arange(B)[:, None], par, rank]                                # [B, N]
    is_root = tree.parent < 0
    edge = jnp.where(is_root, 1.0, edge) * tree.valid
    reach = edge
    for _ in range(tree.max_depth):        # after t rounds every node of depth ≤ t holds its path product
        reach = edge * jnp.where(is_root, 1.0, jnp.take_along_axis(reach, par, axis=1))
    return reach


def tree_expected_accepted(tree: Tree, p: jax.Array, q: jax.Array, rule: Rule = "rejection",
                           max_children: int | None = None) -> jax.Array:
    """E[accepted drafts] [B] of one round over the tree (anchor = the root, not counted)."""
    reach = tree_acceptance(tree, p, q, rule, max_children)
    return jnp.sum(jnp.where(tree.parent >= 0, reach, 0.0), axis=-1)


def tau_tree(tree: Tree, p: jax.Array, q: jax.Array, rule: Rule = "rejection",
             max_children: int | None = None) -> jax.Array:
    """Expected tokens committed per round over the tree (accepted drafts + 1 bonus) [B]."""
    return 1.0 + tree_expected_accepted(tree, p, q, rule, max_children)


__all__ = ["Rule", "RULES", "target_choice", "sibling_acceptance", "chain_acceptance", "chain_expected_accepted",
           "tau_chain", "sibling_rank", "tree_acceptance", "tree_expected_accepted", "tau_tree"]
