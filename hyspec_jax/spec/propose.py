"""Proposals from one DSpark draft block: a chain of γ tokens (docs/design.md §2; trees: `spec.select`).

It starts from the parallel stage (`Drafter.draft`: base logits U_k and hidden h_k of the γ draft slots) and
runs the sequential stage: the distribution of a draft at depth k (k = 1 for a child of the anchor) is
softmax(U_{k−1} + B(previous token)), the previous token being the anchor or the draft above it.

Sampling uses `hyspec_jax.sampling.warp` — the same temperature / top-k / top-p warping the target's
acceptance applies — so the returned draft distributions are exactly the q of lossless rejection sampling.
Greedy rows (temperature 0, or `sampling=None`) draw the argmax; their q is one-hot in a chain.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from flax import nnx, struct

from hyspec_jax.models.drafter import DraftBlock, Drafter, TargetHeads
from hyspec_jax.sampling import SlotSampling, warp
from hyspec_jax.state import DrafterState

F32 = jnp.float32
I32 = jnp.int32


def _greedy_logp(logits: jax.Array) -> jax.Array:
    V = logits.shape[-1]
    return jnp.where(jnp.arange(V) == jnp.argmax(logits, axis=-1)[..., None], 0.0, -jnp.inf)


def _confidence(model: Drafter, h: jax.Array, e: jax.Array) -> jax.Array:
    logit = model.confidence_logit(h, e)
    return jnp.ones(h.shape[:-1], F32) if logit is None else jax.nn.sigmoid(logit)


def draw(logits: jax.Array, sampling: SlotSampling | None, keys: jax.Array | None, k) -> tuple[jax.Array, jax.Array]:
    """Draft k of a chain from logits [B, V]: (token [B], log q [B, V]). sampling None: the argmax, q one-hot;
    else a draw from the warped q with fold_in(keys[b], k) (the q lossless rejection sampling needs)."""
    if sampling is None:
        return jnp.argmax(logits, axis=-1).astype(I32), _greedy_logp(logits)
    logp = warp(logits, sampling.temperature, sampling.top_p, sampling.top_k)
    sub = jax.vmap(lambda key: jax.random.fold_in(key, k))(keys)
    return jax.vmap(jax.random.categorical)(sub, logp).astype(I32), logp


# ------------------------------------------------------------------------------------------------
# Chain
# ------------------------------------------------------------------------------------------------
@struct.dataclass
class ChainProposal:
    tokens: jax.Array       # [B, γ] int32; token k is the draft for position start + k + 1
    probs: jax.Array        # [B, γ, V] fp32 draft distribution token k was drawn from (one-hot if greedy)
    token_probs: jax.Array  # [B, γ] q_k(tokens_k)
    logits: jax.Array       # [B, γ, V] fp32 Markov-corrected logits U_k + B_k (before warping)
    confidence: jax.Array   # [B, γ] conditional acceptance estimate c_k (1 without a confidence head)


def chain_from_block(model: Drafter, block: DraftBlock, anchor: jax.Array, sampling: SlotSampling | None = None,
                     keys: jax.Array | None = None) -> ChainProposal:
    """The sequential stage left to right (lax.scan over the γ slots, unrolled: γ is small, and on a GPU each
    loop iteration would be its own round of tiny kernels). keys [B]: per-slot PRNG keys
    (e.g. `sampling.slot_keys(seed, step)`), required with `sampling`; draft k uses fold_in(key, k)."""
    B, G, V = block.logits.shape
    chex.assert_shape(anchor, (B,))
    if sampling is not None and keys is None:
        raise ValueError("sampling needs per-slot PRNG keys")
    r = model.config.markov_rank if model.markov_head is not None else 0

    def body(carry, xs):
        prev, s = carry
        U, h, k = xs
        bias, e, s = model.markov_step(prev, h, s)
        logits = U + bias
        tok, logp = draw(logits, sampling, keys, k)
        return (tok, s), (tok, jnp.exp(logp), logits, _confidence(model, h, e))

    s0 = jnp.zeros((B, r), block.hidden.dtype)
    xs = (jnp.moveaxis(block.logits, 1, 0), jnp.moveaxis(block.hidden, 1, 0), jnp.arange(G))
    _, (tok, probs, logits, conf) = jax.lax.scan(body, (anchor.astype(I32), s0), xs, unroll=True)
    tok, probs = jnp.moveaxis(tok, 0, 1), jnp.moveaxis(probs, 0, 1)
    return ChainProposal(tokens=tok, probs=probs, token_probs=jnp.take_along_axis(probs, tok[..., None], -1)[..., 0],
                         logits=jnp.moveaxis(logits, 0, 1), confidence=jnp.moveaxis(conf, 0, 1))


def propose_chain(graphdef: nnx.GraphDef, params: nnx.State, dstate: DrafterState, anchor: jax.Array,
                  heads: TargetHeads, ssm: jax.Array | None = None, *, sampling: SlotSampling | None = None,
                  keys: jax.Array | None = None) -> ChainProposal:
    """Draft γ tokens after `anchor` [B] (at position dstate.lengths). ssm: TargetState.ssm (reader only)."""
    model = nnx.merge(graphdef, params)
    return chain_from_block(model, model.draft(dstate, anchor, heads, ssm), anchor, sampling, keys)


__all__ = ["ChainProposal", "draw", "chain_from_block", "propose_chain"]
