"""From one DSpark draft block to the candidate forest the budget selects from (chain or tree).

Candidates of a row, in the `hyspec_jax.tree` convention: node 0 is the anchor, then the drafts level by
level (parents before children), each with its token, parent, depth, a (log) selection score and — for
sampling — `child_q`, the warped draft distribution its own children are drawn from.

Selection scores and losslessness. Greedy rows score a node by ρ(v) = Π p_draft along its path (Bole).
For sampling rows, keeping or dropping a draft must not depend on that draft's own token, or the verified
children would no longer be draws from q and rejection sampling would be biased. Sampling rows therefore
score a node by its *pre-draw* value σ(v) = ρ(parent) · m_i, where m_i = 1 − Σ_{j<i} q(c_j) is the draft
mass left before v was drawn as its parent's i-th child (the probability that a further draw happens at all):
σ depends on v's ancestors and earlier siblings only, σ(c_i) ≥ σ(c_{i+1}) (draw order = rank order), and
σ(child) ≤ ρ(parent) ≤ σ(parent), so σ never increases down a path. With the budget's order (score desc,
depth asc, index asc) every node is ranked below its ancestors, its later siblings and all their
descendants; the beam truncation per level and `budget.select_nodes` keep a node based on the nodes ranked
above it only — so a kept set is always a draw-order prefix of every node's children whose size does not
depend on their tokens (what `spec.accept` requires). This is why trees are expanded here and not by
the ρ-ranked expansion the tests keep as a reference (tests/tree_reference.py), which ranks sampled nodes by ρ
(their own probability): fine for greedy rows, biased for sampling rows. For greedy rows the two expansions agree (top-k children by logits, ρ = products
of softmax probabilities).
"""

from __future__ import annotations

from typing import Callable

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from hyspec_jax.models.drafter import DraftBlock, Drafter
from hyspec_jax.sampling import SlotSampling, warp
from hyspec_jax.spec.propose import ChainProposal
from hyspec_jax.tree import TreeExpansion
from hyspec_jax.kernels import tree_level

F32 = jnp.float32
I32 = jnp.int32


@struct.dataclass
class Candidates:
    token: jax.Array    # [B, M] int32 (node 0 = anchor)
    parent: jax.Array   # [B, M] int32 (−1 for the anchor)
    depth: jax.Array    # [B, M] int32
    valid: jax.Array    # [B, M] bool
    score: jax.Array    # [B, M] fp32 log selection score (0 for the anchor, −inf when invalid)
    child_q: jax.Array | None  # [B, M, V] fp32 draft distribution of the node's children (sampling only)


def chain_candidates(prop: ChainProposal, anchor: jax.Array, length: jax.Array | None = None,
                     sampling: SlotSampling | None = None) -> Candidates:
    """The chain [anchor, x_0 .. x_{γ−1}] (draft slots k ≥ length[b] invalid). Scores: ρ_k = Σ_{i≤k} log q(x_i)
    for greedy rows, the pre-draw σ_k = Σ_{i<k} log q(x_i) for sampling rows."""
    B, G = prop.tokens.shape
    logq = jnp.log(jnp.maximum(prop.token_probs.astype(F32), 0.0))
    rho = jnp.cumsum(logq, axis=1)
    if sampling is not None:
        pre = rho - logq
        rho = jnp.where((sampling.temperature <= 0)[:, None], rho, pre)
    valid = jnp.ones((B, G), bool) if length is None else jnp.arange(G)[None] < length[:, None]
    zero = lambda dt: jnp.zeros((B, 1), dt)  # noqa: E731
    child_q = None
    if sampling is not None:
        child_q = jnp.concatenate([prop.probs.astype(F32), jnp.zeros_like(prop.probs[:, :1], F32)], axis=1)
    idx = jnp.arange(G + 1, dtype=I32)[None]
    return Candidates(
        token=jnp.concatenate([anchor.astype(I32)[:, None], prop.tokens.astype(I32)], axis=1),
        parent=jnp.broadcast_to(idx - 1, (B, G + 1)),
        depth=jnp.broadcast_to(idx, (B, G + 1)),
        valid=jnp.concatenate([jnp.ones((B, 1), bool), valid], axis=1),
        score=jnp.concatenate([zero(F32), jnp.where(valid, rho, -jnp.inf)], axis=1),
        child_q=child_q)


def tree_candidates(model: Drafter, block: DraftBlock, anchor: jax.Array, expansion: TreeExpansion,
                    sampling: SlotSampling | None = None, keys: jax.Array | None = None,
                    kernel_impl: str = "reference") -> Candidates:
    """Beam expansion of the DSpark draft tree from one block (`expand_candidates`): the children of a node at
    depth d are scored under U_d + B(token(node)), the block's base logits plus the Markov bias."""
    B, G, V = block.logits.shape
    if expansion.depth > G:
        raise ValueError(f"tree depth {expansion.depth} exceeds the {G} draft slots of the block")
    r = model.config.markov_rank if model.markov_head is not None else 0

    def level(d: int, tok: jax.Array, s: jax.Array):
        h = jnp.broadcast_to(block.hidden[:, d, None], tok.shape + (block.hidden.shape[-1],))
        # the bias in the head's own dtype: the level converts it on its way in (the kernel reads it so)
        bias, _, s_next = model.markov_step(tok, h, s, native=True)
        return block.logits, d, None if jnp.ndim(bias) == 0 else bias, s_next

    return expand_candidates(level, jnp.zeros((B, 1, r), block.hidden.dtype), anchor, expansion, V, sampling, keys,
                             kernel_impl)


def expand_candidates(level: Callable, carry, anchor: jax.Array, expansion: TreeExpansion, vocab: int,
                      sampling: SlotSampling | None = None, keys: jax.Array | None = None,
                      kernel_impl: str = "reference") -> Candidates:
    """Beam expansion of a draft tree whose logits come from `level` (see the module docstring for the scores).

    `level(d, tokens [B, W], carry) -> (logits [B, L, V], row, bias [B, W, V] or None, carry')` gives the logits
    logits[:, row] + bias of the children of the W beam nodes at depth d (d = 0: the anchor; the base logits are a
    row of a stack so the kernel reads them in place) and a per-node carry
    (a pytree of [B, W, ...] arrays: the drafter's own state of each node, e.g. a Markov RNN state or an MTP
    hidden); each kept child receives its parent's carry'. The first carry is the anchor's ([B, 1, ...]).
    Level d expands every kept node of depth d into its top_k children — greedy rows by logits, sampling rows
    by top_k draws without replacement from the warped q (Gumbel-top-k, children in draw order) — and keeps the
    best `beam` by score (stable: ties keep parent-major, draw order). sampling None: all rows greedy. keys [B]
    per-slot PRNG keys (sampling). kernel_impl: the all-greedy levels (`hyspec_jax.kernels.tree_level`: "auto"
    takes the kernel on a GPU).
    """
    B, V = anchor.shape[0], vocab
    D, k = expansion.depth, expansion.top_k
    chex.assert_shape(anchor, (B,))
    if k > V:
        raise ValueError(f"top_k {k} exceeds the vocabulary ({V})")
    stochastic = sampling is not None
    if stochastic and keys is None:
        raise ValueError("sampling needs per-slot PRNG keys")
    widths = expansion.widths()
    offsets = np.cumsum([1] + list(widths))            # first candidate index of each level
    rows = jnp.arange(B)[:, None]
    greedy = None if not stochastic else (sampling.temperature <= 0)[:, None, None]

    beam_rows = np.cumsum([0, 1] + list(widths[:-1]))  # level d expands the beam rows [beam_rows[d], [d+1])
    if stochastic:   # one Gumbel draw for every level (one PRNG program)
        noise = jax.vmap(lambda kk: jax.random.gumbel(kk, (int(beam_rows[-1]), V), F32))(keys)
    tok = anchor.astype(I32)[:, None]                  # beam of level 0: the anchor
    logscore = jnp.zeros((B, 1), F32)
    logrho = jnp.zeros((B, 1), F32)
    bvalid = jnp.ones((B, 1), bool)
    out = dict(token=[tok], parent=[jnp.full((B, 1), -1, I32)], depth=[jnp.zeros((B, 1), I32)],
               valid=[bvalid], score=[logscore], q=[])
    for d in range(D):
        W = tok.shape[1]
        stack, row, bias, carry_next = level(d, tok, carry)
        if stochastic:
            logits = stack[:, row, None, :].astype(F32) + (0.0 if bias is None else bias.astype(F32))  # [B, W|1, V]
            logq = jax.nn.log_softmax(logits, axis=-1)
            wl = warp(logits, sampling.temperature[:, None], sampling.top_p[:, None], sampling.top_k[:, None])
            logq = jnp.where(greedy, logq, wl)
            gumbel = noise[:, int(beam_rows[d]):int(beam_rows[d + 1])]
            draw = jnp.where(greedy, logits, wl + gumbel)
            out["q"].append(jnp.where(bvalid[..., None], jnp.exp(logq), 0.0))
            top, child = jax.lax.top_k(draw, k)                                       # [B, W, k] draw order
            clogq = jnp.take_along_axis(logq, child, axis=-1)
            cvalid = bvalid[..., None] & (top > -jnp.inf) & (clogq > -jnp.inf)
            crho = logrho[..., None] + clogq
            cq = jnp.where(cvalid, jnp.exp(clogq), 0.0)
            mass = 1.0 - (jnp.cumsum(cq, axis=-1) - cq)                               # left before draw i
            sigma = logrho[..., None] + jnp.log(jnp.clip(mass, 0.0, 1.0))
            score = jnp.minimum(jnp.where(greedy, crho, sigma), logscore[..., None])  # monotone by construction
            score = jnp.where(cvalid, score, -jnp.inf).reshape(B, W * k)
            order = jax.lax.top_k(score, widths[d])[1]      # stable: ties keep parent-major, draw order
            par = (order // k).astype(I32)
            take = lambda x: jnp.take_along_axis(x.reshape(B, W * k), order, axis=1)  # noqa: E731
            tok, logscore, logrho = take(child).astype(I32), take(score), take(crho)
            bvalid = take(cvalid)
        else:
            # greedy: top k by logits, ρ scores, the best widths[d] kept — one kernel pair a level on a GPU (a
            # launch-bound round), where XLA runs nine
            tok, par, logscore, logrho = tree_level(stack, row, bias, logrho, logscore, k=k, width=widths[d],
                                                    impl=kernel_impl)
            bvalid = logscore > -jnp.inf     # a greedy node is valid where its score is finite
        carry = jax.tree.map(lambda x: x[rows, par], carry_next)
        out["token"].append(tok)
        out["parent"].append(jnp.where(bvalid, par + int(offsets[d] - W), -1))
        out["depth"].append(jnp.where(bvalid, d + 1, 0).astype(I32))
        out["valid"].append(bvalid)
        out["score"].append(jnp.where(bvalid, logscore, -jnp.inf))
    cat = lambda key: jnp.concatenate(out[key], axis=1)  # noqa: E731
    child_q = None
    if stochastic:
        child_q = jnp.concatenate(out["q"] + [jnp.zeros((B, widths[-1], V), F32)], axis=1)
    return Candidates(token=cat("token"), parent=cat("parent"), depth=cat("depth"), valid=cat("valid"),
                      score=cat("score"), child_q=child_q)


__all__ = ["Candidates", "chain_candidates", "tree_candidates", "expand_candidates"]
