"""The hybrid target (Qwen3.5 / Qwen3-Next) in Flax NNX, and its pure prefill / decode entry points.

The module tree mirrors the Hugging Face causal-LM (`model.embed_tokens`, `model.layers.{i}.…`,
`model.norm`, `lm_head`). Entry points are functions of `(graphdef, params, state, …)` that return new
state: no mutation hides inside modules, so one function serves serving, training and notebooks.
"""

from __future__ import annotations


import chex
import jax
import jax.numpy as jnp
from flax import nnx

from hyspec_jax import gdn, kernels
from hyspec_jax.config import LINEAR, TargetConfig
from hyspec_jax.models.layers import (MLP, Attention, GatedDeltaNet, Linear, RMSNorm, SparseMoe, _normal,
                                      attend, dense)
from hyspec_jax import tree as tree_lib
from hyspec_jax.state import TargetState, TreeCache
from hyspec_jax.tree import Tree

F32 = jnp.float32


class Embedding(nnx.Module):
    def __init__(self, vocab: int, hidden: int, *, dtype=F32, rngs: nnx.Rngs):
        self.weight = _normal(rngs, (vocab, hidden), dtype)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: TargetConfig, index: int, *, dtype=F32, rngs: nnx.Rngs):
        self.is_linear = cfg.layer_types[index] == LINEAR
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, dtype=dtype, rngs=rngs)
        else:
            self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = (SparseMoe(cfg, dtype=dtype, rngs=rngs) if cfg.is_sparse_layer(index)
                    else MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs))


class Backbone(nnx.Module):
    def __init__(self, cfg: TargetConfig, *, dtype=F32, rngs: nnx.Rngs):
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype=dtype, rngs=rngs)
                                for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)


class TargetModel(nnx.Module):
    """`Qwen3_5ForCausalLM` / `Qwen3NextForCausalLM` equivalent."""

    def __init__(self, cfg: TargetConfig, *, dtype=F32, rngs: nnx.Rngs):
        self.config = cfg
        self.model = Backbone(cfg, dtype=dtype, rngs=rngs)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size,
                                                                     dtype=dtype, rngs=rngs)

    def logits(self, h: jax.Array) -> jax.Array:
        if self.lm_head is None:
            w = self.model.embed_tokens.weight[...]
            return dense(h.astype(w.dtype), w)
        return self.lm_head(h).astype(F32)

    def _stack(self, x: jax.Array, gdn_mixer, attn_mixer, tap_layers: tuple[int, ...]):
        """The decoder stack with pluggable mixers: `gdn_mixer(slot, module, h)` / `attn_mixer(slot, module, h)`
        return (y, aux). Returns (final-norm hidden, taps dict, gdn aux list, attn aux list)."""
        cfg = self.config
        gdn_aux, attn_aux, taps = [], [], {}
        for i, layer in enumerate(self.model.layers):
            h = layer.input_layernorm(x)
            if layer.is_linear:
                y, aux = gdn_mixer(cfg.layer_slot(i), layer.linear_attn, h)
                gdn_aux.append(aux)
            else:
                y, aux = attn_mixer(cfg.layer_slot(i), layer.self_attn, h)
                attn_aux.append(aux)
            x = x + y
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i in tap_layers:
                taps[i] = x
        return self.model.norm(x), taps, gdn_aux, attn_aux

    def extend(self, state: TargetState, tokens: jax.Array, valid: jax.Array, *, last_only: bool = False,
               tap_layers: tuple[int, ...] = ()) -> tuple[jax.Array, jax.Array, TargetState]:
        """Append tokens [B,T] (valid [B,T] a per-row prefix mask) to every slot's committed sequence.

        Returns (logits [B,T|1,V] fp32, hidden, new state). With last_only, logits of each slot's last valid
        token only. hidden is the final-norm hidden [B,T|1,H], or with tap_layers the outputs of those decoder
        layers stacked [len(tap_layers), B, T, H] (drafter taps, all T positions).
        T == 1 uses the one-token GDN step, T > 1 the chunked closed form.
        """
        B, T = tokens.shape
        chex.assert_shape(valid, (B, T))
        x = self.model.embed_tokens(tokens)
        positions = state.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
        num_valid = jnp.sum(valid, axis=1, dtype=jnp.int32)
        key_pos = jnp.arange(state.max_len, dtype=jnp.int32)
        attn_mask = key_pos[None, None, :] <= positions[:, :, None]              # [B,T,S] causal + prefix
        write_pos = jnp.where(valid, positions, state.max_len)                    # invalid → dropped
        rows = jnp.arange(B)[:, None]

        def gdn_mixer(j, mix, h):
            qkv, z, b, a = mix.project(h)
            qkv = jnp.where(valid[..., None], qkv, 0)       # HF zeroes padding before the conv
            conv_out = gdn.causal_conv(qkv, state.conv[j], mix.conv_weight)
            q, k, v, g, beta = mix.mixer_inputs(conv_out, b, a, valid)
            if T == 1:
                o, S = gdn.step(state.ssm[j], q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
                o = o[:, None]
            else:
                o, S = gdn.chunked_prefill(state.ssm[j], q, k, v, g, beta)
            return mix.output(o, z, x.dtype), (S, gdn.conv_window_after(qkv, state.conv[j], num_valid))

        def attn_mixer(j, att, h):
            q, gate, k, v = att.qkv(h, positions)
            kc = state.keys[j].at[rows, write_pos].set(k.astype(state.keys.dtype), mode="drop")
            vc = state.values[j].at[rows, write_pos].set(v.astype(state.values.dtype), mode="drop")
            return att.out(attend(q, kc, vc, attn_mask), gate), (kc, vc)

        x, taps, gdn_aux, attn_aux = self._stack(x, gdn_mixer, attn_mixer, tap_layers)
        if last_only:
            x = jnp.take_along_axis(x, jnp.maximum(num_valid - 1, 0)[:, None, None], axis=1)
        new_state = TargetState(
            ssm=jnp.stack([a[0] for a in gdn_aux]) if gdn_aux else state.ssm,
            conv=jnp.stack([a[1] for a in gdn_aux]) if gdn_aux else state.conv,
            keys=jnp.stack([a[0] for a in attn_aux]) if attn_aux else state.keys,
            values=jnp.stack([a[1] for a in attn_aux]) if attn_aux else state.values,
            lengths=state.lengths + num_valid)
        hidden = jnp.stack([taps[i] for i in tap_layers]) if tap_layers else x
        return self.logits(x), hidden, new_state

    def verify(self, state: TargetState, tree: Tree, tokens: jax.Array, *, method: gdn.InverseMethod = "squaring",
               tap_layers: tuple[int, ...] = (), kernel_impl: str = "reference"
               ) -> tuple[jax.Array, jax.Array, TreeCache]:
        """One forward over a forest of draft trees (tokens [B,N]) from the committed state, never writing it.

        GDN layers: conv windows follow each node's ancestors into the committed raw columns; the closed-form
        masked solve from the committed S (kernel_impl "reference": `gdn.masked_solve`; "auto" / "pallas" /
        "interpret": the fail-closed `hyspec_jax.kernels.tree_solve`; attention likewise through
        `kernels.tree_attention`). Attention: the committed prefix plus the node's ancestors, at
        positions prefix_len + depth. Returns (logits [B,N,V] fp32, hidden (final-norm [B,N,H] or stacked
        taps), TreeCache with the commit factors — never per-node states).
        """
        B, N = tokens.shape
        chex.assert_shape([tree.parent, tree.valid], (B, N))
        mask = tree_lib.ancestor_mask(tree)                                     # [B,N,N]
        taps_idx = tree_lib.conv_taps(tree, self.config.linear_conv_kernel_dim)
        positions = tree_lib.positions(tree, state.lengths)
        prefix_mask = jnp.arange(state.max_len, dtype=jnp.int32)[None, :] < state.lengths[:, None]   # [B,S]
        attn_mask = jnp.concatenate([jnp.broadcast_to(prefix_mask[:, None], (B, N, state.max_len)), mask], -1)
        valid = tree.valid
        x = self.model.embed_tokens(tokens)

        def gdn_mixer(j, mix, h):
            qkv, z, b, a = mix.project(h)
            qkv = jnp.where(valid[..., None], qkv, 0)
            conv_out = gdn.gathered_conv(qkv, state.conv[j], mix.conv_weight, taps_idx)
            q, k, v, g, beta = mix.mixer_inputs(conv_out, b, a, valid)
            if kernel_impl == "reference":
                o, fac = gdn.masked_solve(state.ssm[j], q, k, v, g, beta, mask, method=method,
                                          path_nodes=tree.envelope.path_nodes)
            else:
                o, fac = kernels.tree_solve(state.ssm[j], q, k, v, g, beta, mask, tree.envelope.path_nodes,
                                            impl=kernel_impl, method="neumann" if method == "neumann" else "auto",
                                            reference_method=method)
            return mix.output(o, z, x.dtype), (fac, qkv)

        def attn_mixer(j, att, h):
            q, gate, k, v = att.qkv(h, positions)
            if kernel_impl == "reference":
                keys = jnp.concatenate([state.keys[j], k.astype(state.keys.dtype)], axis=1)
                values = jnp.concatenate([state.values[j], v.astype(state.values.dtype)], axis=1)
                return att.out(attend(q, keys, values, attn_mask), gate), (k, v)
            # the cache is read in place, never concatenated
            o = kernels.tree_attention(q, state.keys[j], state.values[j], prefix_mask, k.astype(state.keys.dtype),
                                       v.astype(state.values.dtype), mask, impl=kernel_impl)
            return att.out(o, gate), (k, v)

        x, taps, gdn_aux, attn_aux = self._stack(x, gdn_mixer, attn_mixer, tap_layers)
        stack = lambda xs: jnp.stack(xs) if xs else None
        cache = TreeCache(
            factors=gdn.SolveFactors(*(stack([a[0][f] for a in gdn_aux]) for f in range(3))),
            conv_inputs=stack([a[1] for a in gdn_aux]),
            keys=stack([a[0].astype(state.keys.dtype) for a in attn_aux]),
            values=stack([a[1].astype(state.values.dtype) for a in attn_aux]),
            mask=mask)
        hidden = jnp.stack([taps[i] for i in tap_layers]) if tap_layers else x
        return self.logits(x), hidden, cache


# ------------------------------------------------------------------------------------------------
# Functional entry points
# ------------------------------------------------------------------------------------------------
def create_model(cfg: TargetConfig, *, seed: int = 0, dtype=F32) -> TargetModel:
    """A randomly initialised model (tests, the labelled random demo, training from scratch)."""
    # One compiled init instead of one eager dispatch (and compile) per parameter shape.
    return nnx.jit(lambda: TargetModel(cfg, dtype=dtype, rngs=nnx.Rngs(seed)))()


def abstract_model(cfg: TargetConfig, dtype=F32) -> TargetModel:
    """Shapes only, no allocation (loading fills it)."""
    return nnx.eval_shape(lambda: TargetModel(cfg, dtype=dtype, rngs=nnx.Rngs(0)))


def extend(graphdef: nnx.GraphDef, params: nnx.State, state: TargetState, tokens: jax.Array,
           valid: jax.Array, last_only: bool = False) -> tuple[jax.Array, TargetState]:
    model = nnx.merge(graphdef, params)
    logits, _, new_state = model.extend(state, tokens, valid, last_only=last_only)
    return logits, new_state


def verify(graphdef: nnx.GraphDef, params: nnx.State, state: TargetState, tree: Tree, tokens: jax.Array,
           method: gdn.InverseMethod = "squaring") -> tuple[jax.Array, TreeCache]:
    model = nnx.merge(graphdef, params)
    logits, _, cache = model.verify(state, tree, tokens, method=method)
    return logits, cache


# One compiled program per (bucket shape, last_only); the state buffer is donated.
extend_jit = jax.jit(extend, static_argnames=("graphdef", "last_only"), donate_argnames=("state",))


def forward_full(graphdef: nnx.GraphDef, params: nnx.State, tokens: jax.Array, valid: jax.Array | None = None,
                 max_len: int | None = None) -> jax.Array:
    """No-cache forward of whole sequences [B,T] -> logits [B,T,V] (training, tests)."""
    from hyspec_jax.state import init_state
    model = nnx.merge(graphdef, params)
    B, T = tokens.shape
    valid = jnp.ones((B, T), bool) if valid is None else valid
    dtype = model.model.embed_tokens.weight[...].dtype
    state = init_state(model.config, B, max_len or T, dtype)
    logits, _, _ = model.extend(state, tokens, valid)
    return logits


