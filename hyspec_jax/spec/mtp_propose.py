"""Drafts from the target's own MTP head (`hyspec_jax.models.mtp`): a chain of k recursive steps (mode `mtp`) or
a top-k tree (mode `mtp-tree`), as the candidates the round's budget selects from (`spec.select.Candidates`).

Step d (d = 0: the anchor, fed the target's hidden of the last committed token) runs the head at position
n − 1 + d over its committed cache plus the draft nodes on the node's own path — a chain's earlier steps, a tree
branch's ancestors — and its output g both scores the node's children (the target's LM head) and is fed to them
(vLLM's "mtp" recursion). Chain drafts are drawn as DSpark's (`propose.draw`); trees are expanded by the same
beam and scores as DSpark trees (`select.expand_candidates`), so the sampling rows stay lossless.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hyspec_jax.models.drafter import TargetHeads
from hyspec_jax.models.mtp import MTPHead, MTPState
from hyspec_jax.sampling import SlotSampling
from hyspec_jax.spec.propose import ChainProposal, draw
from hyspec_jax.spec.select import Candidates, expand_candidates
from hyspec_jax.tree import TreeExpansion

F32 = jnp.float32


class _Nodes:
    """The K/V of the draft nodes computed so far in a round (trace-time accumulation: the levels are unrolled).
    A step at depth d runs layer d mod L and sees its ancestors drafted by the same layer (all of them with the
    one layer of every published head)."""

    def __init__(self, head: MTPHead, mstate: MTPState):
        cfg = head.config
        self.head, self.mstate = head, mstate
        self.keys = jnp.zeros((mstate.batch, 0, cfg.num_key_value_heads, cfg.head_dim), mstate.keys.dtype)
        self.values = self.keys
        self.layer_of: list[int] = []       # the layer of each node (column)

    def step(self, embed: jax.Array, tokens: jax.Array, hidden: jax.Array, depth: int, ancestors: jax.Array):
        """Nodes tokens [B, W] at `depth`, fed hidden [B, W, H], ancestors [B, W, M] over the nodes so far ->
        g [B, W, H]; the nodes join the list."""
        i = depth % self.head.num_layers
        same = jnp.asarray(np.asarray(self.layer_of, np.int32) == i, bool)
        g, k, v = self.head.step(self.mstate, embed, tokens, hidden, depth, self.keys, self.values,
                                 ancestors & same[None, None, :])
        self.keys = jnp.concatenate([self.keys, k.astype(self.keys.dtype)], axis=1)
        self.values = jnp.concatenate([self.values, v.astype(self.values.dtype)], axis=1)
        self.layer_of += [i] * tokens.shape[1]
        return g


def mtp_chain(head: MTPHead, heads: TargetHeads, mstate: MTPState, anchor: jax.Array, steps: int,
              sampling: SlotSampling | None = None, keys: jax.Array | None = None) -> ChainProposal:
    """`steps` recursive MTP drafts after `anchor` [B]; draft k drawn with `propose.draw` (key fold k)."""
    if sampling is not None and keys is None:
        raise ValueError("sampling needs per-slot PRNG keys")
    B = anchor.shape[0]
    nodes = _Nodes(head, mstate)
    tok, hid = anchor.astype(jnp.int32)[:, None], mstate.hidden[:, None]
    toks, probs, logits_all = [], [], []
    for d in range(steps):
        g = nodes.step(heads.embed, tok, hid, d, jnp.ones((B, 1, d), bool))
        logits = heads.logits(g)[:, 0].astype(F32)
        t, logp = draw(logits, sampling, keys, d)
        toks.append(t)
        probs.append(jnp.exp(logp))
        logits_all.append(logits)
        tok, hid = t[:, None], g
    tokens, probs = jnp.stack(toks, axis=1), jnp.stack(probs, axis=1)
    return ChainProposal(tokens=tokens, probs=probs,
                         token_probs=jnp.take_along_axis(probs, tokens[..., None], -1)[..., 0],
                         logits=jnp.stack(logits_all, axis=1), confidence=jnp.ones(tokens.shape, F32))


def mtp_tree(head: MTPHead, heads: TargetHeads, mstate: MTPState, anchor: jax.Array, expansion: TreeExpansion,
             sampling: SlotSampling | None = None, keys: jax.Array | None = None,
             kernel_impl: str = "reference") -> Candidates:
    """The head expanded top-k per level over a beam tree (`select.expand_candidates`): each node's step attends
    to its ancestors only; its children are scored by its own output's logits and fed that output."""
    B = anchor.shape[0]
    V = heads.embed.shape[0]
    nodes = _Nodes(head, mstate)

    def level(d: int, tok: jax.Array, carry):
        hid, anc = carry                           # [B, W, H], [B, W, M]: what each node is fed, its ancestors
        W = tok.shape[1]
        g = nodes.step(heads.embed, tok, hid, d, anc)
        own = jnp.broadcast_to(jnp.eye(W, dtype=bool), (B, W, W))
        return (jnp.zeros((B, 1, V), F32), 0, heads.logits(g).astype(F32),
                (g, jnp.concatenate([anc, own], axis=-1)))

    carry = (mstate.hidden[:, None], jnp.zeros((B, 1, 0), bool))
    return expand_candidates(level, carry, anchor, expansion, V, sampling, keys, kernel_impl)


__all__ = ["mtp_chain", "mtp_tree"]
