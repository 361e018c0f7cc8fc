"""The multi-token-prediction (MTP) head Qwen3.5 / Qwen3-Next checkpoints ship as `mtp.*`, used as a drafter.

The head, as the public implementations read it (vLLM `vllm/model_executor/models/qwen3_next_mtp.py` and
`qwen3_5_mtp.py`, SGLang `python/sglang/srt/models/qwen3_next_mtp.py`; the proposer loop: vLLM
`vllm/v1/spec_decode/eagle.py`, method "mtp"):

    e = pre_fc_norm_embedding(embed(token))         the target's embedding of the token at position p + 1
    h = pre_fc_norm_hidden(hidden)                  the target's hidden state at position p, AFTER its final norm
    x = fc([e ; h])                                 [2H] -> [H], no bias; the embedding half first
    x = layers.{i}(x) at position p                 a full-attention decoder layer of the target's kind (gated
                                                    attention, then MLP or sparse MoE), its own K/V cache
    g = norm(x)                                     -> the target's LM head (tied or not): logits of token p + 2

All three norms are the target's zero-centred `(1 + w)` RMSNorm (vLLM `Qwen3NextRMSNorm` / SGLang `GemmaRMSNorm`).
The position id is p, the hidden state's position (vLLM passes `target_positions` and shifts only the tokens).
Recursive drafting feeds g back as the hidden of the next step (vLLM: "mtp" recycles the head's output), with the
drafted token, at position p + 1; step i uses layer i mod num_layers (one layer in every published checkpoint).

Cache (`MTPState`): after the target has committed n tokens t_0 .. t_{n−1} of a slot (the anchor t_n chosen, not
processed), the head's K/V holds the pairs (t_{j+1}, h_j) at positions j = 0 .. n−2, and `hidden` holds h_{n−1},
the final-norm hidden of the last committed token, whose pair needs the anchor. A draft step 1 processes
(anchor, h_{n−1}) at position n − 1. Appending the target's next k processed tokens (a prefill chunk, or a round's
accepted path: anchor + accepted drafts) with their hiddens writes the k pairs shifted by one: (x_0, h_{n−1}),
(x_1, h'_0), …, and keeps h'_{k−1} — the K/V a draft computed from its own g is always recomputed from the target's
hidden, as vLLM's proposer does at the start of each round.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from flax import nnx, struct

from hyspec_jax.config import TargetConfig
from hyspec_jax.models.layers import MLP, Attention, Linear, RMSNorm, SparseMoe, attend

F32 = jnp.float32


@struct.dataclass
class MTPState:
    """Per slot: the head's K/V over the pairs it has seen, and the pending target hidden (module docstring)."""
    keys: jax.Array     # [L, B, S, KVH, hd] post-norm, post-RoPE
    values: jax.Array   # [L, B, S, KVH, hd]
    hidden: jax.Array   # [B, H] target final-norm hidden of the last committed token (h_{n−1})
    lengths: jax.Array  # [B] int32: n, the target tokens committed (the cache holds positions < n − 1)

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        return self.keys.shape[2]


def init_mtp_state(cfg: TargetConfig, batch: int, max_len: int, dtype=F32) -> MTPState:
    shape = (cfg.mtp_num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    return MTPState(keys=jnp.zeros(shape, dtype), values=jnp.zeros(shape, dtype),
                    hidden=jnp.zeros((batch, cfg.hidden_size), dtype), lengths=jnp.zeros((batch,), jnp.int32))


class MTPLayer(nnx.Module):
    """`mtp.layers.{i}`: a full-attention decoder layer of the target's kind (HF parameter names)."""

    def __init__(self, cfg: TargetConfig, *, dtype=F32, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        # vLLM / SGLang build it as the MoE target's decoder layer 0 (sparse in every published MoE config)
        self.mlp = (SparseMoe(cfg, dtype=dtype, rngs=rngs) if cfg.is_moe
                    else MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs))


class MTPHead(nnx.Module):
    """The `mtp.*` module tree: parameter paths are the checkpoint keys less `mtp.` (`hyspec_jax.io.mtp_io`)."""

    def __init__(self, cfg: TargetConfig, *, dtype=F32, rngs: nnx.Rngs):
        if cfg.mtp_num_hidden_layers < 1:
            raise ValueError("config has no MTP layers (mtp_num_hidden_layers / num_nextn_predict_layers)")
        H = cfg.hidden_size
        self.config = cfg
        self.fc = Linear(2 * H, H, dtype=dtype, rngs=rngs)
        self.pre_fc_norm_embedding = RMSNorm(H, cfg.rms_norm_eps, dtype=dtype)
        self.pre_fc_norm_hidden = RMSNorm(H, cfg.rms_norm_eps, dtype=dtype)
        self.layers = nnx.List([MTPLayer(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.mtp_num_hidden_layers)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps, dtype=dtype)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def fuse(self, embeds: jax.Array, hidden: jax.Array) -> jax.Array:
        """x = fc([norm_e(embeds); norm_h(hidden)]) ([..., H] each -> [..., H])."""
        e = self.pre_fc_norm_embedding(embeds)
        h = self.pre_fc_norm_hidden(hidden.astype(e.dtype))
        return self.fc(jnp.concatenate([e, h], axis=-1))

    def layer(self, i: int, x: jax.Array, positions: jax.Array, keys: jax.Array, values: jax.Array,
              mask: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Layer i over queries x [B,T,H] at positions [B,T]; keys/values [B,S',KVH,hd] the cache part the
        queries may see, mask [B,T,S'+T] over [cache part | the queries' own keys]. Returns (g = norm(layer(x)),
        the queries' k, v)."""
        layer = self.layers[i]
        att = layer.self_attn
        q, gate, k, v = att.qkv(layer.input_layernorm(x), positions)
        kk = jnp.concatenate([keys, k.astype(keys.dtype)], axis=1)
        vv = jnp.concatenate([values, v.astype(values.dtype)], axis=1)
        x = x + att.out(attend(q, kk, vv, mask), gate)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x), k, v

    def append(self, state: MTPState, embed: jax.Array, tokens: jax.Array, hidden: jax.Array,
               num_new: jax.Array) -> MTPState:
        """The target processed tokens [B,T] (the first num_new[b] valid) at positions lengths .. with final-norm
        hiddens [B,T,H]: write the pairs (tokens[j], [state.hidden, hidden][j]) at positions lengths − 1 + j into
        the cache and keep the last valid hidden. Only K/V are computed: a pair's output is read by nobody (the
        next draft starts from the pending pair). Every layer's cache gets the committed pairs — exact for the one
        layer of every published head; with more, step i reads layer i mod L over the same committed context.
        embed: the target's embedding table [V, H]."""
        B, T = tokens.shape
        chex.assert_shape(num_new, (B,))
        prev = jnp.concatenate([state.hidden[:, None].astype(hidden.dtype), hidden[:, :-1]], axis=1)
        x = self.fuse(jnp.take(embed, tokens, axis=0), prev)
        positions = state.lengths[:, None] - 1 + jnp.arange(T, dtype=jnp.int32)[None]
        valid = (jnp.arange(T)[None] < num_new[:, None]) & (positions >= 0)   # a fresh slot's t_0 has no pair
        write = jnp.where(valid, positions, state.max_len)
        rows = jnp.arange(B)[:, None]
        keys, values = [], []
        for i in range(self.num_layers):
            att = self.layers[i].self_attn
            _, _, k, v = att.qkv(self.layers[i].input_layernorm(x), positions)
            kc = state.keys[i].at[rows, write].set(k.astype(state.keys.dtype), mode="drop")
            vc = state.values[i].at[rows, write].set(v.astype(state.values.dtype), mode="drop")
            keys.append(kc)
            values.append(vc)
        last = jnp.take_along_axis(hidden, jnp.maximum(num_new - 1, 0)[:, None, None], axis=1)[:, 0]
        return MTPState(keys=jnp.stack(keys), values=jnp.stack(values),
                        hidden=jnp.where((num_new > 0)[:, None], last.astype(state.hidden.dtype), state.hidden),
                        lengths=state.lengths + num_new.astype(jnp.int32))

    def step(self, state: MTPState, embed: jax.Array, tokens: jax.Array, hidden: jax.Array, depth: int,
             local_keys: jax.Array, local_values: jax.Array, local_mask: jax.Array
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """One draft step for W nodes per slot at the same depth (0: the anchor, fed state.hidden).

        tokens [B,W] the nodes' tokens, hidden [B,W,H] what each is fed (the target's h_{n−1} at depth 0, else its
        parent's g); local_keys / local_values [B,M,KVH,hd] the K/V of the draft nodes computed so far (layer
        depth mod L), local_mask [B,W,M] which of them are each node's ancestors. Position n − 1 + depth.
        Returns (g [B,W,H] post-norm, k, v [B,W,KVH,hd]) of the nodes (their K/V for their descendants)."""
        B, W = tokens.shape
        i = depth % self.num_layers
        x = self.fuse(jnp.take(embed, tokens, axis=0), hidden)
        positions = jnp.broadcast_to(state.lengths[:, None] - 1 + depth, (B, W)).astype(jnp.int32)
        prefix = jnp.arange(state.max_len)[None, :] < (state.lengths - 1)[:, None]                 # [B,S]
        mask = jnp.concatenate([jnp.broadcast_to(prefix[:, None], (B, W, state.max_len)), local_mask,
                                jnp.broadcast_to(jnp.eye(W, dtype=bool), (B, W, W))], axis=-1)
        keys = jnp.concatenate([state.keys[i], local_keys.astype(state.keys.dtype)], axis=1)
        values = jnp.concatenate([state.values[i], local_values.astype(state.values.dtype)], axis=1)
        return self.layer(i, x, positions, keys, values, mask)

    def teacher_forced(self, embed: jax.Array, tokens: jax.Array, hidden: jax.Array, steps: int = 1) -> jax.Array:
        """Training: the head's first `steps` draft steps at every position of whole windows, no cache, as
        recursive drafting runs them. tokens [B,T], the target's final-norm hidden [B,T,H] -> g [steps,B,T−1,H]:
        step d at pair p reads (t_{p+1+d}, h_p) at d = 0, (t_{p+1+d}, g^{d−1}_p) after, at position p + d, and its
        logits predict t_{p+d+2} (entries whose token runs past the window read the last token; the loss masks
        them). Step d sees step 0's keys at pairs ≤ p (the cache and the anchor) and steps 1 .. d−1's keys at
        pair p (its ancestors), as `step` does; step d uses layer d mod num_layers."""
        B, T = tokens.shape
        cfg = self.config
        P = T - 1
        tril = jnp.tril(jnp.ones((P, P), bool))
        eye = jnp.eye(P, dtype=bool)
        keys = jnp.zeros((B, 0, cfg.num_key_value_heads, cfg.head_dim), hidden.dtype)
        values = keys
        fed, out = hidden[:, :-1], []
        for d in range(steps):
            t = jnp.take(tokens, jnp.minimum(jnp.arange(1 + d, T + d), T - 1), axis=1)
            x = self.fuse(jnp.take(embed, t, axis=0), fed)
            positions = jnp.broadcast_to(jnp.arange(d, P + d, dtype=jnp.int32), (B, P))
            mask = jnp.concatenate([tril] + [eye] * d, axis=-1)       # [P, (d+1)P]: step 0, steps 1..d−1, own
            g, k, v = self.layer(d % self.num_layers, x, positions, keys.astype(x.dtype), values.astype(x.dtype),
                                 jnp.broadcast_to(mask, (B, P, (d + 1) * P)))
            keys = jnp.concatenate([keys, k.astype(keys.dtype)], axis=1)
            values = jnp.concatenate([values, v.astype(values.dtype)], axis=1)
            fed = g
            out.append(g)
        return jnp.stack(out)


def create_mtp(cfg: TargetConfig, *, seed: int = 0, dtype=F32) -> MTPHead:
    """A randomly initialised head (tests; training from scratch)."""
    return nnx.jit(lambda: MTPHead(cfg, dtype=dtype, rngs=nnx.Rngs(seed)))()


def abstract_mtp(cfg: TargetConfig, dtype=F32) -> MTPHead:
    """Shapes only, no allocation (loading fills it)."""
    return nnx.eval_shape(lambda: MTPHead(cfg, dtype=dtype, rngs=nnx.Rngs(0)))


__all__ = ["MTPState", "MTPLayer", "MTPHead", "init_mtp_state", "create_mtp", "abstract_mtp"]
