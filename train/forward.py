"""The training forward of the target: whole sequences from the empty state, no KV cache.

It is `TargetModel.extend` specialised to training (the same `_stack`, the same projection / conv / gate /
attention modules and the same `gdn.chunked_prefill` closed form), with two differences that matter for
speed and for the drafter data:
- attention attends over the T keys of the window itself (no max_len cache scatter);
- the chunk inverse uses repeated squaring (exact for a chunk: L^C = 0), which on CPU is ~20x faster than
  the triangular solve `extend` uses, and is matmul-only on GPU;
- optionally it returns the committed GDN states at every chunk boundary (the ReaDy reader's inputs).
`tests/test_train_target.py` checks it against `forward_full` and against `transformers`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hyspec_jax import gdn
from hyspec_jax.models.layers import attend
from hyspec_jax.models.target import TargetModel

F32 = jnp.float32


def _chunked_states(S0, q, k, v, g, beta, chunk: int, method: gdn.InverseMethod):
    """`gdn.chunked_prefill` that also returns the state after every chunk: (o [B,T,HV,dv], S [n,B,HV,dk,dv])."""
    B, T = q.shape[:2]
    if T % chunk:
        raise ValueError(f"sequence length {T} is not a multiple of the chunk {chunk}")
    n = T // chunk
    to_chunks = lambda x: jnp.moveaxis(x.reshape(B, n, chunk, *x.shape[2:]), 1, 0)  # noqa: E731
    mask = gdn.chain_mask(B, chunk)
    last = jnp.full((B,), chunk - 1, jnp.int32)

    def body(S, xs):
        o, fac = gdn.masked_solve(S, *xs, mask, method=method, path_nodes=chunk)
        S = gdn.node_state(S, fac, mask, last)
        return S, (o, S)

    _, (o, states) = jax.lax.scan(body, S0.astype(F32), tuple(map(to_chunks, (q, k, v, g, beta))))
    return jnp.moveaxis(o, 0, 1).reshape(B, T, *o.shape[3:]), states


def window_mixer_inputs(mix, h: jax.Array, valid: jax.Array, cfg) -> tuple[tuple[jax.Array, ...], jax.Array]:
    """A GDN mixer's (q, k, v, g, β) and its output gate z over a whole window h [B, T, H] (already input-normed),
    its causal conv starting from the empty window; valid False makes a position an identity step."""
    qkv, z, b, a = mix.project(h)
    window = jnp.zeros((h.shape[0], cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), qkv.dtype)
    return mix.mixer_inputs(gdn.causal_conv(qkv, window, mix.conv_weight), b, a, valid), z


def train_forward(model: TargetModel, tokens: jax.Array, *, tap_layers: tuple[int, ...] = (), chunk: int = 64,
                  method: gdn.InverseMethod = "squaring", state_slots: tuple[int, ...] | None = None):
    """tokens [B,T] -> (logits [B,T,V] fp32, final-norm hidden [B,T,H], taps [L,B,T,H] or None,
    chunk states or None).

    With state_slots (rows of TargetState.ssm, e.g. a reader's source_slots), chunk states is
    [len(state_slots), n_chunks, B, HV, dk, dv]: entry c is the committed state after tokens 0 .. (c+1)·chunk − 1.
    """
    cfg = model.config
    B, T = tokens.shape
    C = min(chunk, T)
    x = model.model.embed_tokens(tokens)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    valid = jnp.ones((B, T), bool)
    want = () if state_slots is None else tuple(state_slots)

    def gdn_mixer(mix, h, j, carry):
        (q, k, v, g, beta), z = window_mixer_inputs(mix, h, valid, cfg)
        S0 = jnp.zeros((B, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim), F32)
        if j in want:
            o, states = _chunked_states(S0, q, k, v, g, beta, C, method)
        else:
            o, _ = gdn.chunked_prefill(S0, q, k, v, g, beta, chunk_size=C, method=method)
            states = None
        return mix.output(o, z, x.dtype), carry, states

    def attn_mixer(att, h, j, carry):
        q, gate, k, v = att.qkv(h, positions)
        return att.out(attend(q, k, v, causal), gate), carry, None

    if want and model.is_scanned:
        raise ValueError("train_forward with state_slots needs an unscanned model (models.target.unscan_layers)")
    hidden, tap_stack, _, gdn_aux, _ = model._stack(x, gdn_mixer, attn_mixer, tuple(tap_layers))
    logits = model.logits(hidden)
    states = None
    if want:
        by_slot = dict(enumerate(gdn_aux))          # a per-slot list: only the wanted slots return states
        states = jnp.stack([by_slot[s] for s in want])
    return logits, hidden, tap_stack, states


__all__ = ["train_forward", "window_mixer_inputs"]
