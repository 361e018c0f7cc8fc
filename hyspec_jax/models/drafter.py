"""DSpark block drafter (DeepSpec / SpecForge layout), optionally with a ReaDy state reader.

See `docs/reference/drafters.md` §1 (backbone, taps, KV injection), §3 (DSpark block, Markov and confidence heads),
§4 (inference contract). The module tree mirrors the DeepSpec checkpoint keys (`fc`, `hidden_norm`,
`layers.{i}.self_attn.q_proj`, …, `markov_head.markov_w1`, `confidence_head.proj`), so checkpoint I/O is a
prefix-free name match (`hyspec_jax.io.drafter_io`).

Block layout. The block is `[anchor, MASK × (block_size − 1)]` at positions `start .. start + block_size − 1`
where `start` is the anchor's position (= number of committed tokens whose target features are in the
context cache). With `logits_start = s`, draft k (k = 0 .. γ−1, γ = block_size − s) is read from slot k + s and
predicts the token at `start + k + 1`: s = 0 is DeepSpec's anchor-first convention (γ = block_size), s = 1 the
DFlash / speculators convention (slot 0 discarded). Reading one with the other silently collapses
acceptance, hence the explicit flag.

Draft layers are Qwen3 decoder layers (plain RMSNorm x/rms·w, i.e. `RMSNorm(zero_centred=False)`; ungated
GQA attention with q/k norms, full RoPE, SwiGLU), as in every public DFlash / DSpark checkpoint — not the
target's gated Qwen3.5 attention.
The embedding and LM head are the target's, passed in (`TargetHeads`) and frozen with `stop_gradient`.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from flax import nnx, struct

from hyspec_jax.config import ConfigError, DrafterConfig
from hyspec_jax.gdn import DeferredUpdates
from hyspec_jax.models.layers import MLP, Linear, RMSNorm, apply_rope, attend, dense, rope_cos_sin
from hyspec_jax.models.reader import Reader, ReaderConfig, select_states
from hyspec_jax.models.target import Embedding, TargetModel
from hyspec_jax.state import DrafterState

F32 = jnp.float32


# ------------------------------------------------------------------------------------------------
# Shared heads
# ------------------------------------------------------------------------------------------------
@struct.dataclass
class TargetHeads:
    """The target's token embedding and LM head, shared by the drafter and frozen (never owned by it)."""
    embed: jax.Array    # [V, H]
    lm_head: jax.Array  # [V, H]

    def embed_tokens(self, ids: jax.Array) -> jax.Array:
        return jnp.take(jax.lax.stop_gradient(self.embed), ids, axis=0)

    def logits(self, h: jax.Array) -> jax.Array:
        w = jax.lax.stop_gradient(self.lm_head)
        return dense(h.astype(w.dtype), w)


def target_heads(target: TargetModel) -> TargetHeads:
    embed = target.model.embed_tokens.weight[...]
    return TargetHeads(embed=embed, lm_head=embed if target.lm_head is None else target.lm_head.weight[...])


@struct.dataclass
class DraftBlock:
    """One parallel draft forward: the γ draft slots (slot k predicts the token at start + k + 1)."""
    hidden: jax.Array  # [B, γ, H] after the drafter's final norm
    logits: jax.Array  # [B, γ, V] fp32 base logits U (no Markov bias)


# ------------------------------------------------------------------------------------------------
# Modules
# ------------------------------------------------------------------------------------------------
class DraftAttention(nnx.Module):
    """Qwen3 GQA attention: q/k RMSNorm per head, full RoPE, no output gate."""

    def __init__(self, cfg: DrafterConfig, *, dtype=F32, rngs: nnx.Rngs):
        H, nh, kvh, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim, self.rope_theta = nh, kvh, hd, cfg.rope_theta
        b = cfg.attention_bias
        self.q_proj = Linear(H, nh * hd, bias=b, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(H, kvh * hd, bias=b, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(H, kvh * hd, bias=b, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(nh * hd, H, bias=b, dtype=dtype, rngs=rngs)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, zero_centred=False, dtype=dtype)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, zero_centred=False, dtype=dtype)

    def _rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        return rope_cos_sin(positions, self.head_dim, self.rope_theta)

    def kv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [B,T,H] at positions [B,T] -> (k roped [B,T,KVH,hd], v [B,T,KVH,hd])."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, T, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).reshape(B, T, self.num_kv_heads, self.head_dim)
        return apply_rope(k, *self._rope(positions)), v

    def q(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, T, self.num_heads, self.head_dim))
        return apply_rope(q, *self._rope(positions))


class DraftLayer(nnx.Module):
    def __init__(self, cfg: DrafterConfig, *, dtype=F32, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centred=False, dtype=dtype)
        self.self_attn = DraftAttention(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centred=False,
                                                dtype=dtype)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs)


class MarkovHead(nnx.Module):
    """Additive bias B_k on the base logits from the previous token (docs/reference/drafters.md §3.3).

    vanilla: B = W2 e;  gated: B = W2 (σ(W_g [h; e] + b) ⊙ e);
    rnn: [g|c|o] = W_j [s; e; h] + b, s' = σ(g)⊙s + (1−σ(g))⊙tanh(c), B = W2 tanh(o);  e = W1[prev].
    """

    def __init__(self, cfg: DrafterConfig, *, dtype=F32, rngs: nnx.Rngs):
        r, V, d = cfg.markov_rank, cfg.vocab_size, cfg.hidden_size
        self.kind, self.rank = cfg.markov_head_type, r
        self.markov_w1 = Embedding(V, r, dtype=dtype, rngs=rngs)
        self.markov_w2 = Linear(r, V, dtype=dtype, rngs=rngs)
        self.gate_proj = Linear(d + r, r, bias=True, dtype=dtype, rngs=rngs) if self.kind == "gated" else None
        self.joint_proj = Linear(2 * r + d, 3 * r, bias=True, dtype=dtype, rngs=rngs) if self.kind == "rnn" else None

    def __call__(self, prev: jax.Array, h: jax.Array, s: jax.Array, native: bool = False
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """prev [...] ids, h [..., d], s [..., r] (rnn state) -> (bias [..., V] fp32 (native: in the head's own
        dtype, for a consumer that converts it itself), e [..., r], s')."""
        e = self.markov_w1(prev)
        if self.kind == "vanilla":
            z = e
        elif self.kind == "gated":
            g = jax.nn.sigmoid(self.gate_proj(jnp.concatenate([h.astype(e.dtype), e], axis=-1)))
            z = g * e
        else:  # rnn
            pre = self.joint_proj(jnp.concatenate([s.astype(e.dtype), e, h.astype(e.dtype)], axis=-1))
            g, c, o = jnp.split(pre, 3, axis=-1)
            sg = jax.nn.sigmoid(g.astype(F32))
            s = (sg * s.astype(F32) + (1.0 - sg) * jnp.tanh(c.astype(F32))).astype(s.dtype)
            z = jnp.tanh(o)
        bias = self.markov_w2(z)
        return (bias if native else bias.astype(F32)), e, s


class ConfidenceHead(nnx.Module):
    """c_k = σ(w·[h_k; W1[x_{k−1}]] + b): conditional acceptance of slot k given slots < k accepted."""

    def __init__(self, cfg: DrafterConfig, *, dtype=F32, rngs: nnx.Rngs):
        self.proj = Linear(cfg.confidence_dim, 1, bias=True, dtype=dtype, rngs=rngs)
        self.with_markov = cfg.has_markov and cfg.confidence_head_with_markov

    def __call__(self, h: jax.Array, e: jax.Array) -> jax.Array:
        x = jnp.concatenate([h, e.astype(h.dtype)], axis=-1) if self.with_markov else h
        return self.proj(x)[..., 0].astype(F32)


class Drafter(nnx.Module):
    """DSpark drafter: tap fusion, KV-injected block backbone, Markov + confidence heads, optional ReaDy reader."""

    def __init__(self, cfg: DrafterConfig, reader_cfg: ReaderConfig | None = None, *, dtype=F32,
                 rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.config = cfg
        self.reader_config = reader_cfg
        self.fc = Linear(cfg.num_taps * d, d, dtype=dtype, rngs=rngs)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps, zero_centred=False, dtype=dtype)
        self.layers = nnx.List([DraftLayer(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(d, cfg.rms_norm_eps, zero_centred=False, dtype=dtype)
        self.markov_head = MarkovHead(cfg, dtype=dtype, rngs=rngs) if cfg.has_markov else None
        self.confidence_head = ConfidenceHead(cfg, dtype=dtype, rngs=rngs) if cfg.enable_confidence_head else None
        if reader_cfg is not None:
            if reader_cfg.hidden_size != d:
                raise ConfigError(f"reader hidden_size {reader_cfg.hidden_size} != drafter hidden_size {d}")
            self.inject_at = reader_cfg.injection_index(cfg.num_hidden_layers)
            self.reader = Reader(reader_cfg, dtype=dtype, rngs=rngs)
        else:
            self.inject_at, self.reader = -1, None

    # --- context ----------------------------------------------------------------------------------
    def fuse(self, taps: jax.Array) -> jax.Array:
        """taps [L,B,T,H] (target decoder-layer outputs, in target_layer_ids order) -> C [B,T,d]."""
        L, B, T, H = taps.shape
        chex.assert_equal(L, self.config.num_taps)
        feats = jnp.moveaxis(taps, 0, 2).reshape(B, T, L * H)  # per token: [tap_0 | tap_1 | …]
        return self.hidden_norm(self.fc(feats))

    def context_kv(self, taps: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Context K/V of every draft layer from the fused features only -> ([n,B,T,KVH,hd], same)."""
        c = self.fuse(taps)
        kvs = [layer.self_attn.kv(c, positions) for layer in self.layers]
        return jnp.stack([k for k, _ in kvs]), jnp.stack([v for _, v in kvs])

    def append_context(self, dstate: DrafterState, taps: jax.Array, num_new: jax.Array) -> DrafterState:
        """Append the first num_new[b] of T new committed tokens' features (taps [L,B,T,H]) to each slot."""
        B, T = taps.shape[1], taps.shape[2]
        chex.assert_shape(num_new, (B,))
        chex.assert_equal(dstate.batch, B)
        positions = dstate.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
        k, v = self.context_kv(taps, positions)
        valid = jnp.arange(T)[None] < num_new[:, None]
        write = jnp.where(valid, positions, dstate.max_len)  # invalid rows (and overflow) are dropped
        rows = jnp.arange(B)[:, None]
        keys = dstate.keys.at[:, rows, write].set(k.astype(dstate.keys.dtype), mode="drop")
        values = dstate.values.at[:, rows, write].set(v.astype(dstate.values.dtype), mode="drop")
        return DrafterState(keys=keys, values=values, lengths=dstate.lengths + num_new.astype(jnp.int32))

    # --- block backbone ---------------------------------------------------------------------------
    def block_hidden(self, x: jax.Array, start: jax.Array, ctx_keys: jax.Array, ctx_values: jax.Array,
                     ctx_len: jax.Array, reader_states: jax.Array | None = None) -> jax.Array:
        """A blocks per row, each attending to its own slots (bidirectionally) and to context keys at
        positions < its anchor (and < ctx_len).

        x [B,A,G,d] block input embeddings; start [B,A] anchor positions; ctx_* [n,B,S,KVH,hd]; ctx_len [B];
        reader_states [B,A,M,dk,dv] (the committed GDN states each block reads; required with a reader).
        Returns the final-normed hidden [B,A,G,d].
        """
        B, A, G, d = x.shape
        n, S = len(self.layers), ctx_keys.shape[2]
        chex.assert_shape(start, (B, A))
        chex.assert_shape(ctx_len, (B,))
        chex.assert_equal_shape([ctx_keys, ctx_values])
        chex.assert_equal(ctx_keys.shape[:2], (n, B))
        if self.reader is not None and reader_states is None:
            raise ValueError("this drafter has a ReaDy reader: pass the committed GDN states it reads")
        Q = A * G
        pos = (start[:, :, None] + jnp.arange(G, dtype=jnp.int32)).reshape(B, Q)
        blk = jnp.repeat(jnp.arange(A), G)                                   # block id of each query
        ctx_pos = jnp.arange(S)[None, None, :]
        seen = (ctx_pos < start[:, :, None]) & (ctx_pos < ctx_len[:, None, None])   # [B,A,S] strictly before
        mask = jnp.concatenate([seen[:, blk], jnp.broadcast_to(blk[:, None] == blk[None, :], (B, Q, Q))], -1)
        h = x.reshape(B, Q, d)
        read = lambda h: h + self.reader(h.reshape(B, A, G, d), reader_states).reshape(B, Q, d)  # noqa: E731
        before = self.reader is not None and self.reader_config.position == "before_attention"
        for i, layer in enumerate(self.layers):
            if i == self.inject_at and before:
                h = read(h)
            a = layer.input_layernorm(h)
            att = layer.self_attn
            q = att.q(a, pos)
            k, v = att.kv(a, pos)
            keys = jnp.concatenate([ctx_keys[i].astype(k.dtype), k], axis=1)
            values = jnp.concatenate([ctx_values[i].astype(v.dtype), v], axis=1)
            h = h + att.o_proj(attend(q, keys, values, mask).reshape(B, Q, -1))
            if i == self.inject_at and not before:
                h = read(h)  # ReaDy: after attention, before the MLP
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h).reshape(B, A, G, d)

    def block_tokens(self, anchor: jax.Array) -> jax.Array:
        """[..., block_size]: anchor then MASK."""
        bs = self.config.block_size
        mask = jnp.full(anchor.shape + (bs - 1,), self.config.mask_token_id, anchor.dtype)
        return jnp.concatenate([anchor[..., None], mask], axis=-1)

    def draft(self, dstate: DrafterState, anchor: jax.Array, heads: TargetHeads,
              ssm: jax.Array | None = None, num_slots: int | None = None,
              pending: DeferredUpdates | None = None) -> DraftBlock:
        """The parallel stage for one block per slot, anchored at position dstate.lengths.

        ssm: the target's committed GDN states TargetState.ssm [Lg,B,HV,dk,dv] (read by the reader only);
        pending: TargetState.pending when the target defers its commit (`reader.select_states` folds it).
        num_slots: return only the first draft slots (default all γ): the whole block still runs (its slots
        attend to each other), but the vocabulary projection of slots nobody reads is skipped.
        """
        B = dstate.batch
        chex.assert_shape(anchor, (B,))
        if self.reader is not None and ssm is None:
            raise ValueError("this drafter has a ReaDy reader: pass the target's committed ssm state")
        states = None if self.reader is None else select_states(self.reader_config, ssm, pending)[:, None]  # [B,1,M,dk,dv]
        x = heads.embed_tokens(self.block_tokens(anchor))[:, None]          # [B,1,bs,d]
        h = self.block_hidden(x, dstate.lengths[:, None], dstate.keys, dstate.values, dstate.lengths, states)
        h = h[:, 0, self.config.logits_start:]
        if num_slots is not None:
            h = h[:, :num_slots]
        return DraftBlock(hidden=h, logits=heads.logits(h))

    # --- sequential heads -------------------------------------------------------------------------
    def markov_step(self, prev: jax.Array, h: jax.Array, s: jax.Array | None = None, native: bool = False
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """One Markov step -> (bias [..., V] fp32 (native: the head's dtype; scalar 0 without a head), e [..., r],
        rnn state [..., r])."""
        r = self.config.markov_rank if self.markov_head is not None else 0
        if s is None:
            s = jnp.zeros(prev.shape + (r,), h.dtype)
        if self.markov_head is None:
            return jnp.zeros((), F32), jnp.zeros(prev.shape + (0,), h.dtype), s
        return self.markov_head(prev, h, s, native)

    def markov_teacher(self, prev: jax.Array, h: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Teacher-forced bias for all slots: prev [..., G], h [..., G, d] -> (bias [..., G, V], e [..., G, r])."""
        if self.markov_head is None or self.markov_head.kind != "rnn":
            bias, e, _ = self.markov_step(prev, h)
            return bias, e

        def body(s, xs):  # the RNN is unrolled left to right over the block
            p, hk = xs
            bias, e, s = self.markov_step(p, hk, s)
            return s, (bias, e)

        s0 = jnp.zeros(prev.shape[:-1] + (self.config.markov_rank,), h.dtype)
        _, (bias, e) = jax.lax.scan(body, s0, (jnp.moveaxis(prev, -1, 0), jnp.moveaxis(h, -2, 0)))
        return jnp.moveaxis(bias, 0, -2), jnp.moveaxis(e, 0, -2)

    def confidence_logit(self, h: jax.Array, e: jax.Array) -> jax.Array | None:
        return None if self.confidence_head is None else self.confidence_head(h, e)


# ------------------------------------------------------------------------------------------------
# Functional entry points
# ------------------------------------------------------------------------------------------------
def create_drafter(cfg: DrafterConfig, reader_cfg: ReaderConfig | None = None, *, seed: int = 0,
                   dtype=F32) -> Drafter:
    return Drafter(cfg, reader_cfg, dtype=dtype, rngs=nnx.Rngs(seed))


def abstract_drafter(cfg: DrafterConfig, reader_cfg: ReaderConfig | None = None, dtype=F32) -> Drafter:
    """Shapes only, no allocation (loading fills it)."""
    return nnx.eval_shape(lambda: Drafter(cfg, reader_cfg, dtype=dtype, rngs=nnx.Rngs(0)))


def context_kv(graphdef: nnx.GraphDef, params: nnx.State, taps: jax.Array, positions: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
    return nnx.merge(graphdef, params).context_kv(taps, positions)


def append_context(graphdef: nnx.GraphDef, params: nnx.State, dstate: DrafterState, target_taps: jax.Array,
                   num_new: jax.Array) -> DrafterState:
    """Commit: context K/V of the newly committed tokens (target_taps [L,B,T,H] from
    `TargetModel.extend(..., tap_layers=cfg.target_layer_ids)`, first num_new[b] rows valid) appended."""
    return nnx.merge(graphdef, params).append_context(dstate, target_taps, num_new)


def draft_block(graphdef: nnx.GraphDef, params: nnx.State, dstate: DrafterState, anchor: jax.Array,
                heads: TargetHeads, ssm: jax.Array | None = None) -> DraftBlock:
    return nnx.merge(graphdef, params).draft(dstate, anchor, heads, ssm)


# One compiled program per bucket shape; the drafter state buffer is donated on commit.
append_context_jit = jax.jit(append_context, static_argnames=("graphdef",), donate_argnames=("dstate",))
draft_block_jit = jax.jit(draft_block, static_argnames=("graphdef",))


@struct.dataclass
class TrainOutputs:
    logits: jax.Array             # [B,A,γ,V] fp32 Markov-corrected (teacher-forced previous tokens)
    base_logits: jax.Array        # [B,A,γ,V] fp32
    confidence_logits: jax.Array | None  # [B,A,γ] fp32
    labels: jax.Array             # [B,A,γ] token at anchor + k + 1
    label_valid: jax.Array        # [B,A,γ] bool: label inside the sequence (< seq_len)


def forward_train(graphdef: nnx.GraphDef, params: nnx.State, heads: TargetHeads, taps: jax.Array,
                  tokens: jax.Array, anchors: jax.Array, seq_len: jax.Array | None = None,
                  reader_states: jax.Array | None = None) -> TrainOutputs:
    """Many blocks per sequence in one forward (DeepSpec training layout).

    taps [L,B,T,H] target features of every token; tokens [B,T]; anchors [B,A] anchor positions;
    seq_len [B] valid tokens (default T); reader_states [B,A,M,dk,dv] committed GDN state before each anchor
    (`reader.select_states` of the target's state after token anchor−1). Block a sees context < anchors[a].
    """
    model = nnx.merge(graphdef, params)
    cfg = model.config
    L, B, T, _ = taps.shape
    chex.assert_shape(tokens, (B, T))
    A = anchors.shape[1]
    chex.assert_shape(anchors, (B, A))
    seq_len = jnp.full((B,), T, jnp.int32) if seq_len is None else seq_len
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    ck, cv = model.context_kv(taps, positions)
    take = lambda idx: jnp.take_along_axis(tokens[:, None, :], jnp.clip(idx, 0, T - 1), axis=2)  # noqa: E731
    x = heads.embed_tokens(model.block_tokens(take(anchors[:, :, None])[..., 0]))      # [B,A,bs,d]
    h = model.block_hidden(x, anchors, ck, cv, seq_len, reader_states)[:, :, cfg.logits_start:]
    base = heads.logits(h)
    k = jnp.arange(cfg.num_draft_tokens)
    prev = take(anchors[:, :, None] + k)                                       # anchor, then x*_{a+k}
    label_pos = anchors[:, :, None] + k + 1
    bias, e = model.markov_teacher(prev, h)
    return TrainOutputs(logits=base + bias, base_logits=base, confidence_logits=model.confidence_logit(h, e),
                        labels=take(label_pos), label_valid=label_pos < seq_len[:, None, None])


__all__ = ["TargetHeads", "DraftBlock", "TrainOutputs", "Drafter", "target_heads", "create_drafter",
           "abstract_drafter", "context_kv", "append_context", "append_context_jit", "draft_block", "draft_block_jit",
           "forward_train"]
