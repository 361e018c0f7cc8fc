"""Acceptance of a verified draft tree: greedy matching and lossless (recursive) rejection sampling.

Inputs are one verified forest in the `hyspec_jax.tree` convention (node 0 = the anchor, parent < own index):
the target's logits at every node (the distribution of the token *after* that node), the node tokens, and
for sampling the draft distribution `child_q[u]` that node u's children were drawn from.

Greedy rows (temperature 0): walk down from the anchor; at node u accept the child whose token equals the
target's argmax at u (siblings hold distinct tokens, so at most one matches); the bonus token is the argmax at
the last accepted node. This is exactly plain greedy decoding, token for token. When every row of a bucket is
greedy the walk is computed in closed form (`_accept_greedy`: per-node matches, then the deepest fully matching
path by pointer jumping), which is the same path because at most one child of a node can match.

Sampling rows — recursive rejection sampling with siblings drawn WITHOUT replacement (SpecInfer's multi-draft
rule with Sequoia's / Recursive-Speculative-Decoding's update). At node u let p₁ = warp(target logits at u)
and q₁ = child_q[u]; the children c₁, c₂, … were drawn from q₁ one after another without replacement
(Gumbel-top-k: c_i ~ q_i = q₁ with c₁..c_{i−1} removed and renormalised) and are visited in draw order:

    accept c_i  with probability min(1, p_i(c_i) / q_i(c_i))          (u · q_i(c_i) < p_i(c_i), u ~ U[0,1))
    on reject:  p_{i+1} = norm(max(p_i − q_i, 0))                       (the usual residual)
                q_{i+1} = norm(q_i with c_i set to 0)                   (the next draw's law: c_i is gone)
    no child accepted: the bonus token is drawn from the last residual p_{j+1}.

Why it is exact: each visit is one single-draft rejection step with the draft distributed as q_i, so by the
Leviathan/Chen lemma its output is ~ p_i provided "what happens after a rejection" outputs ~ p_{i+1}. That
holds by induction, because p_{i+1} = norm(max(p_i − q_i, 0)) depends only on c₁..c_{i−1}, not on the
rejected c_i (which is only removed from the draft law, where p_{i+1}(c_i) = 0 already since a rejection of
c_i implies p_i(c_i) < q_i(c_i)). Using q_{i+1} = q_i instead (the i.i.d. rule) is biased for drafts drawn
without replacement — `tests/test_accept.py` shows it. An accepted child starts the same process one level
down with its own p and q. For the first step to be valid the set of children visited at u must be a prefix
of the draw order whose length does not depend on the children's own tokens (see `spec.select`).
A chain is the special case of one child per node (Leviathan / Chen chain rejection sampling).

Temperature / top-k / top-p are applied to target and draft alike through `sampling.warp`. Penalties are the
caller's: the round passes the target's logits already penalized per node (`sampling.penalize_tree`), so greedy
matching and p are the penalized target's.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from flax import struct

from hyspec_jax import tree as tree_lib
from hyspec_jax.sampling import SlotSampling, warp

F32 = jnp.float32
I32 = jnp.int32


@struct.dataclass
class Acceptance:
    node: jax.Array          # [B] int32 deepest accepted node (0 = only the anchor)
    num_accepted: jax.Array  # [B] int32 accepted drafts (= depth of `node`)
    bonus: jax.Array         # [B] int32 the target's token after `node` (the next anchor)


def _rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, N, ...] at per-row node idx [B] -> [B, ...]."""
    return jnp.take_along_axis(x, idx.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]


def _normalise(x: jax.Array, fallback: jax.Array) -> jax.Array:
    s = jnp.sum(x, axis=-1, keepdims=True)
    return jnp.where(s > 0, x / jnp.where(s > 0, s, 1.0), fallback)


def accept(logits: jax.Array, tokens: jax.Array, tree: tree_lib.Tree, child_q: jax.Array | None,
           sampling: SlotSampling | None, keys: jax.Array | None, *, max_children: int) -> Acceptance:
    """Accept a path of every row's verified tree.

    logits [B,N,V] target logits (fp32, unwarped) at each node; tokens [B,N] and the tree over them; child_q
    [B,N,V] the (warped) draft distribution node u's children were drawn from, required when `sampling` is given;
    sampling None = all rows greedy (no randomness); keys [B] per-slot PRNG keys (with sampling).
    The tree's envelope depth bounds the accepted drafts, max_children the children visited per node (static).
    """
    B, N, V = logits.shape
    parent, valid, max_depth = tree.parent, tree.valid, tree.max_depth
    chex.assert_shape([tokens, parent, valid], (B, N))
    argmax = jnp.argmax(logits, axis=-1).astype(I32)                            # [B,N]
    if sampling is None:
        return _accept_greedy(argmax, tokens, parent, valid, max_depth)
    if child_q is None or keys is None:
        raise ValueError("sampling acceptance needs child_q and per-slot keys")
    chex.assert_shape(child_q, (B, N, V))
    greedy = sampling.temperature <= 0                                          # [B]
    p_all = jnp.exp(warp(logits, sampling.temperature[:, None], sampling.top_p[:, None],
                         sampling.top_k[:, None]))                              # [B,N,V]
    # one PRNG draw per row: a uniform per (depth, sibling) visit, then V for the bonus
    n_u = max_depth * max_children
    noise = jax.vmap(lambda k: jax.random.uniform(k, (n_u + V,), F32, minval=jnp.finfo(F32).tiny))(keys)

    def uniform(d, i):
        return noise[:, d * max_children + i]

    cur = jnp.zeros((B,), I32)
    done = jnp.zeros((B,), bool)
    p_fin = jnp.zeros((B, V), F32)
    for d in range(max_depth):
        is_child = valid & (parent == cur[:, None])                             # [B,N]
        rank = jnp.cumsum(is_child, axis=1) - 1
        t_cur = _rows(argmax, cur)
        p_res, q_res = _rows(p_all, cur), _rows(child_q, cur).astype(F32)
        found = jnp.zeros((B,), bool)
        child = cur
        for i in range(max_children):
            hit = is_child & (rank == i)
            exists = jnp.any(hit, axis=1)
            c = jnp.argmax(hit, axis=1).astype(I32)
            x = _rows(tokens, c)
            live = ~done & exists & ~found
            px = jnp.take_along_axis(p_res, x[:, None], axis=1)[:, 0]
            qx = jnp.take_along_axis(q_res, x[:, None], axis=1)[:, 0]
            ok = jnp.where(greedy, x == t_cur, uniform(d, i) * qx < px)
            acc = live & ok
            rej = live & ~ok & ~greedy
            found = found | acc
            child = jnp.where(acc, c, child)
            p_new = _normalise(jnp.maximum(p_res - q_res, 0.0), p_res)
            p_res = jnp.where(rej[:, None], p_new, p_res)
            q_drop = jnp.where(jnp.arange(V)[None] == x[:, None], 0.0, q_res)
            q_drop = _normalise(q_drop, jnp.zeros_like(q_res))
            q_res = jnp.where(rej[:, None], q_drop, q_res)
        stop = ~done & ~found
        p_fin = jnp.where(stop[:, None], p_res, p_fin)
        done = done | stop
        cur = jnp.where(found & ~stop, child, cur)
    # rows still walking reached max_depth: the bonus comes from the target at their node
    p_fin = jnp.where(done[:, None], p_fin, _rows(p_all, cur))
    gumbel = -jnp.log(-jnp.log(noise[:, n_u:]))                                 # Gumbel-max = categorical
    sampled = jnp.argmax(jnp.log(jnp.maximum(p_fin, 0.0)) + gumbel, axis=-1).astype(I32)
    bonus = jnp.where(greedy, _rows(argmax, cur), sampled)
    return Acceptance(node=cur, num_accepted=_rows(tree.depth, cur), bonus=bonus)


def _accept_greedy(argmax: jax.Array, tokens: jax.Array, parent: jax.Array, valid: jax.Array,
                   max_depth: int) -> Acceptance:
    """Every row greedy, without the walk: a node matches when its token is the target's argmax at its parent,
    and the accepted node is the deepest node (≤ max_depth) whose whole path matches. Siblings hold distinct
    tokens, so at most one child of a node matches and that path is the walk's, token for token. Paths and
    depths by pointer jumping: ⌊log₂ max_depth⌋ + 1 rounds of [B, N] gathers instead of max_depth × max_children
    sequential steps (a round of small kernels each on a GPU)."""
    take = lambda x, i: jnp.take_along_axis(x, jnp.maximum(i, 0), axis=1)  # noqa: E731
    has_parent = valid & (parent >= 0)
    ok = jnp.where(has_parent, tokens == take(argmax, parent), valid)            # the anchor (no parent): itself
    depth = has_parent.astype(I32)
    anc = jnp.where(has_parent, parent, -1)
    for _ in range(max_depth.bit_length()):                                      # 2^k > max_depth hops
        up = anc >= 0
        ok = ok & jnp.where(up, take(ok, anc), True)
        depth = depth + jnp.where(up, take(depth, anc), 0)
        anc = jnp.where(up, take(anc, anc), -1)
    # a node with an ancestor left after the rounds is deeper than 2^k − 1 ≥ max_depth: never accepted
    score = jnp.where(ok & (depth <= max_depth) & (anc < 0), depth, -1)
    node = jnp.argmax(score, axis=1).astype(I32)
    return Acceptance(node=node, num_accepted=take(depth, node[:, None])[:, 0], bonus=take(argmax, node[:, None])[:, 0])


__all__ = ["Acceptance", "accept"]
