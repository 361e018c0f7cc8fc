"""The ρ-ranked top-k tree proposal from one DSpark draft block: a reference for `spec.select.tree_candidates`.

Greedy rows of `tree_candidates` keep the same nodes (tokens on the same paths, same ρ) as this expansion when
its beam holds every node of the full k-ary tree (tests/test_budget.py); tests/test_propose.py checks it against
numpy. Sampling rows here rank siblings by ρ (their own probability), which `spec.select` explains is biased for
rejection sampling: the library never drafts with it.

Tree output (anchor separate, it is the last token the target chose): nodes in topological order,
parent −1 = child of the anchor, depth = edges from the anchor (1 for its children; 0 for invalid padding),
ρ(v) = Π p_draft along the path from the anchor. `with_anchor` turns it into the engine's `hyspec_jax.tree`
convention (anchor = node 0).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from hyspec_jax.models.drafter import DraftBlock, Drafter, TargetHeads
from hyspec_jax.sampling import SlotSampling, warp
from hyspec_jax.spec.propose import _confidence
from hyspec_jax.state import DrafterState
from hyspec_jax.tree import TreeExpansion

F32 = jnp.float32
I32 = jnp.int32


@struct.dataclass
class TreeProposal:
    parent: jax.Array       # [B, N] int32: −1 = child of the anchor, else an earlier node
    token: jax.Array        # [B, N] int32
    depth: jax.Array        # [B, N] int32: edges from the anchor (1 for its children); 0 when invalid
    valid: jax.Array        # [B, N] bool
    rho: jax.Array          # [B, N] fp32 Π p_draft along the path (0 when invalid)
    confidence: jax.Array   # [B, N] confidence head at the node's slot given its parent's token
    draft_probs: jax.Array | None  # [B, N, V] the distribution the node was drawn from (siblings share it):
    #                                the warped q for sampling rows, softmax(logits) for greedy rows


def tree_from_block(model: Drafter, block: DraftBlock, anchor: jax.Array, expansion: TreeExpansion,
                    sampling: SlotSampling | None = None, keys: jax.Array | None = None,
                    return_probs: bool = False) -> TreeProposal:
    """Top-k expansion per depth, the best N = expansion.beam nodes by ρ kept (anchor not counted).

    At depth d every kept node v expands its top-k children under U_{d−1} + B(token(v)) (greedy rows:
    by logits; sampling rows: k draws without replacement from the warped q, by Gumbel-top-k). Each level
    keeps its best min(N, k^d) candidates by ρ, and the output is the global top-N by ρ over all levels.
    Since ρ never grows along a path, this equals the top-N nodes of the full k-ary tree and every kept
    node's parent is kept (ties go to the shallower node, which comes first). p_draft is the warped draft
    distribution for sampling rows and softmax(logits) for greedy rows.
    """
    B, G, V = block.logits.shape
    N, D, k = expansion.beam, expansion.depth, expansion.top_k
    chex.assert_shape(anchor, (B,))
    if D > G:
        raise ValueError(f"tree depth {D} exceeds the {G} draft slots of the block")
    if k > V:
        raise ValueError(f"top_k {k} exceeds the vocabulary ({V})")
    if sampling is not None and keys is None:
        raise ValueError("sampling needs per-slot PRNG keys")
    r = model.config.markov_rank if model.markov_head is not None else 0
    widths = expansion.widths()
    rows = jnp.arange(B)[:, None]

    parent_rows = np.cumsum([0, 1] + list(widths[:-1]))  # level d expands the beam of level d−1
    if sampling is not None:  # one Gumbel draw for all levels (one PRNG program, not one per level)
        noise = jax.vmap(lambda key: jax.random.gumbel(key, (int(parent_rows[-1]), V), F32))(keys)
    tok = anchor.astype(I32)[:, None]                   # the current beam (level 0: the anchor)
    logrho = jnp.zeros((B, 1), F32)
    s = jnp.zeros((B, 1, r), block.hidden.dtype)
    levels = []
    for d in range(D):
        W = tok.shape[1]
        h = jnp.broadcast_to(block.hidden[:, d, None], (B, W, block.hidden.shape[-1]))
        bias, e, s_next = model.markov_step(tok, h, s)
        logits = block.logits[:, d, None, :] + bias                                   # [B, W, V]
        conf = _confidence(model, h, e)                                               # [B, W]
        logp = jax.nn.log_softmax(logits, axis=-1)
        if sampling is None:
            scores = logits
        else:
            wl = warp(logits, sampling.temperature[:, None], sampling.top_p[:, None], sampling.top_k[:, None])
            greedy = (sampling.temperature <= 0)[:, None, None]
            gumbel = noise[:, int(parent_rows[d]):int(parent_rows[d + 1])]
            logp = jnp.where(greedy, logp, wl)
            scores = jnp.where(greedy, logits, wl + gumbel)
        top_scores, child = jax.lax.top_k(scores, k)                                  # [B, W, k]
        cand = logrho[..., None] + jnp.take_along_axis(logp, child, axis=-1)
        cand = jnp.where(top_scores > -jnp.inf, cand, -jnp.inf).reshape(B, W * k)     # outside top-p/top-k
        best, idx = jax.lax.top_k(cand, widths[d])
        par = idx // k
        lv = dict(token=jnp.take_along_axis(child.reshape(B, W * k), idx, axis=1), logrho=best, par=par,
                  conf=jnp.take_along_axis(conf, par, axis=1))
        if return_probs:
            lv["q"] = jnp.exp(logp)[rows, par]                                        # [B, Wd, V]
        levels.append(lv)
        tok, logrho, s = lv["token"], best, s_next[rows, par]

    # global top-N over all levels (level-major layout: parents precede children, also on ties)
    offsets = np.cumsum([0] + list(widths))
    M = int(offsets[-1])
    n = min(N, M)
    cat = lambda key: jnp.concatenate([lv[key] for lv in levels], axis=1)  # noqa: E731
    all_lr = cat("logrho")
    parent_global = jnp.concatenate([jnp.full((B, widths[0]), -1, I32)]
                                    + [levels[d]["par"] + int(offsets[d - 1]) for d in range(1, D)], axis=1)
    level_depth = jnp.asarray(np.repeat(np.arange(1, D + 1), widths), I32)
    _, sel = jax.lax.top_k(all_lr, n)
    sel = jnp.sort(sel, axis=1)                                                       # topological order
    inv = jnp.full((B, M), -1, I32).at[rows, sel].set(jnp.arange(n, dtype=I32)[None])
    pg = jnp.take_along_axis(parent_global, sel, axis=1)
    parent = jnp.where(pg >= 0, jnp.take_along_axis(inv, jnp.maximum(pg, 0), axis=1), -1)
    lr = jnp.take_along_axis(all_lr, sel, axis=1)
    valid = (lr > -jnp.inf) & ~((pg >= 0) & (parent < 0))
    for _ in range(D - 1):  # a node is valid only under a valid parent (guards -inf and ties)
        valid = valid & jnp.where(parent >= 0, jnp.take_along_axis(valid, jnp.maximum(parent, 0), axis=1), True)
    pad = lambda x, fill: jnp.pad(x, [(0, 0), (0, N - n)] + [(0, 0)] * (x.ndim - 2),  # noqa: E731
                                  constant_values=fill)
    gather = lambda x: jnp.take_along_axis(x, sel.reshape(sel.shape + (1,) * (x.ndim - 2)), axis=1)  # noqa: E731
    return TreeProposal(
        parent=pad(jnp.where(valid, parent, -1), -1),
        token=pad(gather(cat("token")), 0),
        depth=pad(jnp.where(valid, level_depth[sel], 0), 0),
        valid=pad(valid, False),
        rho=pad(jnp.where(valid, jnp.exp(lr), 0.0), 0.0),
        confidence=pad(gather(cat("conf")), 0.0),
        draft_probs=pad(gather(cat("q")), 0.0) if return_probs else None)


def propose_tree(graphdef: nnx.GraphDef, params: nnx.State, dstate: DrafterState, anchor: jax.Array,
                 heads: TargetHeads, expansion: TreeExpansion, ssm: jax.Array | None = None, *,
                 sampling: SlotSampling | None = None, keys: jax.Array | None = None,
                 return_probs: bool = False) -> TreeProposal:
    model = nnx.merge(graphdef, params)
    return tree_from_block(model, model.draft(dstate, anchor, heads, ssm), anchor, expansion, sampling, keys,
                           return_probs)


def with_anchor(prop: TreeProposal, anchor: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(parent, valid, depth, token) [B, N+1] in the `hyspec_jax.tree` convention: the anchor is node 0
    (parent −1, depth 0) and the drafts hang below it."""
    B = prop.parent.shape[0]
    chex.assert_shape(anchor, (B,))
    parent = jnp.where(prop.valid, jnp.where(prop.parent >= 0, prop.parent + 1, 0), -1)
    one = lambda v, dt: jnp.full((B, 1), v, dt)  # noqa: E731
    return (jnp.concatenate([one(-1, I32), parent], 1), jnp.concatenate([one(True, bool), prop.valid], 1),
            jnp.concatenate([one(0, I32), prop.depth], 1), jnp.concatenate([anchor.astype(I32)[:, None],
                                                                              prop.token], 1))
