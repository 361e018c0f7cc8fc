"""A scripted drafter for the speculative-engine tests: a DSpark drafter whose base logits are pushed toward
scripted tokens, so that long acceptances, partial acceptances and rejections all occur with a random model.

`ScriptedDrafter` is an ordinary `Drafter` (the engine takes it as any other): its `draft` adds `BIAS` to the block's
base logits at `script[anchor, position, k]` for draft slot k (−1: nothing), the position being the anchor's
(`DrafterState.lengths`). Drafts stay the drafter's (the pushed logits are the q they are drawn from), so acceptance
is unchanged and decoding still lossless. `oracle_script` scripts the AR continuation of each request."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from hyspec_jax.models.drafter import DraftBlock, Drafter

BIAS = 1.0e3


class ScriptedDrafter(Drafter):
    def draft(self, dstate, anchor, heads, ssm=None, num_slots=None, pending=None):
        block = super().draft(dstate, anchor, heads, ssm, num_slots=num_slots, pending=pending)
        G, V = block.logits.shape[1:]
        h = self.script[...][anchor, dstate.lengths][:, :G]                        # [B, G]
        push = jnp.where((jnp.arange(V) == h[..., None]) & (h[..., None] >= 0), BIAS, 0.0)
        return DraftBlock(hidden=block.hidden, logits=block.logits + push)


def oracle_script(prompts, ref, gamma: int, vocab: int, max_len: int, wrong: bool = True) -> np.ndarray:
    """script [vocab, max_len, gamma]: after request i generated g tokens (anchor ref[i][g − 1] at position
    len(prompts[i]) + g − 1), its next γ AR tokens — with `wrong`, one of them wrong at a position that cycles
    with progress (g mod γ + 1; none when it is γ). Requests that meet at one (anchor, position) keep the last one's
    script there (the other's drafts there are then just wrong)."""
    script = np.full((vocab, max_len, gamma), -1, np.int32)
    for prompt, out in zip(prompts, ref):
        for g in range(1, len(out)):
            h = list(out[g:g + gamma])
            k = g % (gamma + 1)
            if wrong and k < len(h):
                h[k] = (h[k] + 1) % vocab
            script[out[g - 1], len(prompt) + g - 1, :len(h)] = h
    return script


def scripted(drafter: Drafter, script: np.ndarray) -> ScriptedDrafter:
    """A copy of `drafter` (same weights) that drafts as `ScriptedDrafter` with `script`."""
    clone = nnx.merge(*nnx.split(drafter))
    clone.__class__ = ScriptedDrafter
    clone.script = nnx.Variable(jnp.asarray(script))
    return clone
