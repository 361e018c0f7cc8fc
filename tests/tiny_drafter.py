"""A tiny DSpark drafter and one draft block of it, for the tree-candidate tests (test_budget, test_topk_kernel)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from hyspec_jax.config import DrafterConfig, TargetConfig
from hyspec_jax.models import drafter as D
from hyspec_jax.state import init_drafter_state


def tiny_draft_block(tcfg: TargetConfig, *, seed: int, heads_seed: int = 1, taps_seed: int = 0):
    """(model, graphdef, params, block, anchor) of a 1-layer drafter of `tcfg` whose Markov term is scaled up so
    it decides some ranks, after a context of 6 and 4 tapped positions for two requests."""
    cfg = DrafterConfig.from_target(tcfg, num_layers=1, target_layer_ids=(0, 1), markov_rank=8, block_size=4)
    model = D.create_drafter(cfg, seed=seed)
    w2 = model.markov_head.markov_w2.weight
    w2.set_value(w2[...] * 20.0)
    V, H = tcfg.vocab_size, tcfg.hidden_size
    r = np.random.default_rng(heads_seed)
    heads = D.TargetHeads(embed=jnp.asarray(r.standard_normal((V, H)), jnp.float32),
                          lm_head=jnp.asarray(r.standard_normal((V, H)) * 0.3, jnp.float32))
    graphdef, params = nnx.split(model)
    taps = jnp.asarray(np.random.default_rng(taps_seed).standard_normal((2, 2, 6, H)), jnp.float32)
    dstate = D.append_context_jit(graphdef, params, init_drafter_state(cfg, 2, 16), taps, jnp.array([6, 4]))
    anchor = jnp.array([3, 40], jnp.int32)
    return model, graphdef, params, D.draft_block_jit(graphdef, params, dstate, anchor, heads), anchor
