"""The hybrid target (Qwen3.5 / Qwen3-Next) in Flax NNX, and its pure prefill / decode entry points.

The module tree mirrors the Hugging Face causal-LM (`model.embed_tokens`, `model.layers.{i}.…`,
`model.norm`, `lm_head`). Entry points are functions of `(graphdef, params, state, …)` that return new
state: no mutation hides inside modules, so one function serves serving, training and notebooks.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hyspec_jax import gdn, kernels
from hyspec_jax.config import FULL, LINEAR, TargetConfig
from hyspec_jax.models.layers import (MLP, Attention, GatedDeltaNet, Linear, RMSNorm, SparseMoe, _normal,
                                      attend, dense)
from hyspec_jax import tree as tree_lib
from hyspec_jax.state import (TargetState, TreeCache, committed_ssm, empty_pending, pending_layer, write_layer,
                              settle_pending)
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

    @property
    def is_scanned(self) -> bool:
        return hasattr(self.model, "scanned")

    @staticmethod
    def _mix(layer: DecoderLayer, h: jax.Array, j, carry, gdn_mixer, attn_mixer):
        """The layer's mixer of its kind on the normed input h: (y, carry, out)."""
        mixer, module = (gdn_mixer, layer.linear_attn) if layer.is_linear else (attn_mixer, layer.self_attn)
        return mixer(module, h, j, carry)

    def _layer(self, layer: DecoderLayer, x: jax.Array, j, carry, gdn_mixer, attn_mixer):
        """One decoder layer: the mixer of its kind on the normed input, residual, MLP, residual (the scanned
        stack's; the unrolled `_stack` makes the same ops, each residual add beside the norm after it)."""
        y, carry, out = self._mix(layer, layer.input_layernorm(x), j, carry, gdn_mixer, attn_mixer)
        x = x + y
        return x + layer.mlp(layer.post_attention_layernorm(x)), carry, out

    def _stack(self, x: jax.Array, gdn_mixer, attn_mixer, tap_layers: tuple[int, ...], carry=None,
               norm_impl: kernels.Impl = "reference"):
        """The decoder stack with pluggable mixers `mixer(module, h, j, carry) -> (y, carry, out)`: j is the layer's
        row in the state stacked per kind (a Python int when unrolled, traced under the scan), carry the state
        arrays a layer updates in place (row j), out what the layer leaves for its kind's stacked output.

        Returns (final-norm hidden, taps [len(tap_layers), ...] or None, carry, gdn outs, attn outs): outs
        stacked over the layers of each kind (None when the mixers return None; unrolled only, a list when only
        some layers return one). A scanned model (`scan_layers`) runs one block under `lax.scan`, an unscanned
        one the Python loop; both compute the same thing.

        Unrolled, every residual add is made together with the norm after it (`RMSNorm.add`; norm_impl: its
        `kernels.add_rms_norm` implementation, one launch on the kernel path): a layer's MLP output is added by
        the next layer's input norm (the last layer's by the final norm). "reference" is the plain adds and norms,
        the same ops in the same order as `_layer`'s."""
        if self.is_scanned:
            return self._scanned_stack(x, gdn_mixer, attn_mixer, tap_layers, carry)
        cfg = self.config
        outs = {True: [], False: []}
        taps = {}
        pending = None                      # the previous layer's MLP output, not added yet
        for i, layer in enumerate(self.model.layers):
            x, h = layer.input_layernorm.add(x, pending, norm_impl)
            if i - 1 in tap_layers and i > 0:          # the residual stream after layer i − 1's MLP add
                taps[i - 1] = x
            y, carry, out = self._mix(layer, h, cfg.layer_slot(i), carry, gdn_mixer, attn_mixer)
            x, h = layer.post_attention_layernorm.add(x, y, norm_impl)
            pending = layer.mlp(h)
            outs[layer.is_linear].append(out)
        x, hidden = self.model.norm.add(x, pending, norm_impl)
        last = len(self.model.layers) - 1
        if last in tap_layers:
            taps[last] = x
        tap_stack = jnp.stack([taps[i] for i in tap_layers]) if tap_layers else None
        return hidden, tap_stack, carry, _stack_outs(outs[True]), _stack_outs(outs[False])

    def _scanned_stack(self, x, gdn_mixer, attn_mixer, tap_layers, carry):
        plan = scan_plan(self.config)
        per_kind = plan.per_block
        graphdefs, stacked = zip(*(nnx.split(m) for m in self.model.scanned))
        n_taps = len(tap_layers)
        taps0 = jnp.zeros((n_taps, *x.shape), x.dtype) if n_taps else None

        def block(c, xs):
            x, carry, taps = c
            b, params = xs
            outs = []
            for p, kind in enumerate(plan.kinds):
                layer = nnx.merge(graphdefs[p], params[p])
                j = b * per_kind[kind] + plan.rank[p]
                x, carry, out = self._layer(layer, x, j, carry, gdn_mixer, attn_mixer)
                outs.append(out)
                for t, li in enumerate(tap_layers):
                    if li % plan.period == p:      # row t when this block holds layer li, else dropped
                        taps = taps.at[jnp.where(b == li // plan.period, t, n_taps)].set(x, mode="drop")
            return (x, carry, taps), tuple(outs)

        (x, carry, taps), outs = jax.lax.scan(block, (x, carry, taps0),
                                              (jnp.arange(plan.blocks, dtype=jnp.int32), stacked))
        by_kind = {}
        for kind in (LINEAR, FULL):        # [blocks, ...] per position -> [blocks * per_kind, ...] in slot order
            mine = [outs[p] for p, k in enumerate(plan.kinds) if k == kind]
            by_kind[kind] = None if not mine or mine[0] is None else jax.tree.map(
                lambda *a: jnp.stack(a, axis=1).reshape(-1, *a[0].shape[1:]), *mine)
        return self.model.norm(x), taps, carry, by_kind[LINEAR], by_kind[FULL]

    def extend(self, state: TargetState, tokens: jax.Array, valid: jax.Array, *, last_only: bool = False,
               tap_layers: tuple[int, ...] = (), kernel_impl: str = "auto") -> tuple[jax.Array, jax.Array, TargetState]:
        """Append tokens [B,T] (valid [B,T] a per-row prefix mask) to every slot's committed sequence.

        Returns (logits [B,T|1,V] fp32, hidden, new state). With last_only, logits of each slot's last valid
        token only. hidden is the final-norm hidden [B,T|1,H], or with tap_layers the outputs of those decoder
        layers stacked [len(tap_layers), B, T, H] (drafter taps, all T positions).
        T == 1 uses the one-token GDN step (`kernels.gdn_decode_layer`: one Pallas launch a layer on a GPU; kernel_impl
        "reference" keeps XLA's), T > 1 the chunked closed form. Unrolled, each residual add and the norm after it
        go through `kernels.add_rms_norm` with kernel_impl (one launch a pair on a GPU).
        Deferred commit (`state.pending`): every layer starts from its checkpoint folded with its rows; T > 1
        writes the new states and empties the rows; T == 1 (a decoding step) appends its one row per layer
        instead, writing no state unless some slot's ring is full (`state.settle_pending`).
        """
        B, T = tokens.shape
        deferred_step = state.pending is not None and T == 1
        if deferred_step:
            state = settle_pending(state, 1)
        chex.assert_shape(valid, (B, T))
        x = self.model.embed_tokens(tokens)
        positions = state.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
        num_valid = jnp.sum(valid, axis=1, dtype=jnp.int32)
        key_pos = jnp.arange(state.max_len, dtype=jnp.int32)
        attn_mask = key_pos[None, None, :] <= positions[:, :, None]              # [B,T,S] causal + prefix
        write_pos = jnp.where(valid, positions, state.max_len)                    # invalid → dropped
        rows = jnp.arange(B)[:, None]

        def gdn_mixer(mix, h, j, carry):
            """Writes the layer's new state into the carry at row j; out: (new conv window when unrolled, else
            None — written into the carry too; deferred row or None). Measured on the embedded model's decoding
            step (a one-time probe, in git history as bench/dispatch_cost.py): when the state update's own
            computation fused into the row update, that fusion read the stacked array it updated and XLA copied the
            whole stack before each GDN layer (12 more kernels a step); the barrier keeps them apart, so the row is
            written in place (a decoding step's row: `kernels.gdn_decode_layer` with the layer's index). Stacking
            per-layer states after the stack instead copies the whole state once a step (slower with a large
            state); the conv windows are small, and unrolled they are stacked: their in-place updates still
            drew copies."""
            conv_j = carry.conv[j]
            S0 = committed_ssm(carry, j)           # carry.pending is only replaced after the whole stack

            def finish(out, carry, S, conv, fac):
                """The layer's new state S (None: already in the carry) and window into the carry."""
                if S is not None:
                    carry = carry.replace(ssm=write_layer(carry.ssm, j, S))
                if isinstance(j, int):
                    return out, carry, (conv, fac)
                return out, carry.replace(conv=carry.conv.at[j].set(conv)), (None, fac)

            if T == 1 and not deferred_step:       # a decoding step: one launch on a GPU (kernels.gdn_decode_layer)
                # from the in-projection's output as it is (no regroup, no slices); the gated norm included, so its
                # output goes straight to the out-projection. Unrolled (j static): the step updates layer j of the
                # state stack in place and reads its window in the window stack (no slice of either, no
                # write-back); under the scan (j traced) the layer's state and window go in and come out
                stacked = isinstance(j, int)
                proj = mix.in_proj(h)[:, 0]
                norm = mix.norm.spec if proj.dtype == x.dtype else None    # the norm rounds to the model's dtype
                step = kernels.gdn_decode_layer(proj, carry.conv if stacked else conv_j, mix.conv_weight,
                                                mix.A_log[...], mix.dt_bias[...], carry.ssm if stacked else S0,
                                                valid[:, 0], key_heads=mix.hk, key_dim=mix.dk, norm=norm,
                                                layer=j if stacked else None, impl=kernel_impl)
                if norm is not None:
                    out = mix.project_out(step.o[:, None])
                else:
                    z = gdn.split_in_proj(proj, **mix.heads).z
                    out = mix.output(step.o[:, None], z[:, None], x.dtype)
                if stacked:                        # the kernel stepped the stack's layer in place
                    return finish(out, carry.replace(ssm=step.state), None, step.window, None)
                return finish(out, carry, step.state, step.window, None)
            qkv, z, b, a = mix.project(h)
            qkv = jnp.where(valid[..., None], qkv, 0)       # HF zeroes padding before the conv
            S = fac = None
            q, k, v, g, beta = mix.mixer_inputs(gdn.causal_conv(qkv, conv_j, mix.conv_weight), b, a, valid)
            conv = gdn.conv_window_after(qkv, conv_j, num_valid)
            if deferred_step:                      # the one-node solve's factors are the row to append
                o, fac = gdn.masked_solve(S0, q, k, v, g, beta, gdn.chain_mask(B, 1), method="squaring",
                                          path_nodes=1)
            else:
                o, S = gdn.chunked_prefill(S0, q, k, v, g, beta)
            return finish(mix.output(o, z, x.dtype), carry, S, conv, fac)

        def attn_mixer(att, h, j, carry):
            q, gate, k, v = att.qkv(h, positions)
            keys = carry.keys.at[j, rows, write_pos].set(k.astype(carry.keys.dtype), mode="drop")
            values = carry.values.at[j, rows, write_pos].set(v.astype(carry.values.dtype), mode="drop")
            carry = carry.replace(keys=keys, values=values)
            return att.out(attend(q, keys[j], values[j], attn_mask), gate), carry, None

        x, taps, new_state, gdn_out, _ = self._stack(x, gdn_mixer, attn_mixer, tap_layers, state,
                                                     norm_impl=kernel_impl)
        conv, factors = gdn_out if gdn_out is not None else (None, None)
        if conv is not None:                       # unrolled: the layers' new conv windows, stacked
            new_state = new_state.replace(conv=conv)
        if deferred_step:
            path = jnp.zeros((B, 1), jnp.int32)
            new_state = new_state.replace(pending=jax.vmap(gdn.deferred_append, in_axes=(0, 0, None, None))(
                state.pending, factors, path, num_valid))
        elif state.pending is not None:
            new_state = new_state.replace(pending=empty_pending(state.pending))
        if last_only:
            x = jnp.take_along_axis(x, jnp.maximum(num_valid - 1, 0)[:, None, None], axis=1)
        new_state = new_state.replace(lengths=state.lengths + num_valid)
        return self.logits(x), (taps if tap_layers else x), new_state

    def verify(self, state: TargetState, tree: Tree, tokens: jax.Array, *, method: gdn.InverseMethod = "squaring",
               tap_layers: tuple[int, ...] = (), kernel_impl: str = "reference", packed_rows: int = 0
               ) -> tuple[jax.Array, jax.Array, TreeCache]:
        """One forward over a forest of draft trees (tokens [B,N]) from the committed state, never writing it.

        GDN layers: conv windows follow each node's ancestors into the committed raw columns; the closed-form
        masked solve from the committed S (kernel_impl "reference": `gdn.masked_solve`; "auto" / "pallas" /
        "interpret": the fail-closed `hyspec_jax.kernels.tree_solve`; attention likewise through
        `kernels.tree_attention`). Attention: the committed prefix plus the node's ancestors, at
        positions prefix_len + depth. Returns (logits [B,N,V] fp32, hidden (final-norm [B,N,H] or stacked
        taps), TreeCache with the commit factors — never per-node states).

        packed_rows C > 0: the row-wise work (embedding, projections, norms, MLP, LM head) runs on the valid nodes
        packed into C rows (`tree.pack_nodes`; the forest must hold at most C valid nodes), the per-request parts
        in the [B,N] layout; outputs as without packing at the valid nodes (invalid ones: filler or zero).
        """
        B, N = tokens.shape
        chex.assert_shape([tree.parent, tree.valid], (B, N))
        mask = tree_lib.ancestor_mask(tree)                                     # [B,N,N]
        taps_idx = tree_lib.conv_taps(tree, self.config.linear_conv_kernel_dim)
        positions = tree_lib.positions(tree, state.lengths)
        prefix_mask = jnp.arange(state.max_len, dtype=jnp.int32)[None, :] < state.lengths[:, None]   # [B,S]
        attn_mask = jnp.concatenate([jnp.broadcast_to(prefix_mask[:, None], (B, N, state.max_len)), mask], -1)
        valid = tree.valid
        packing = tree_lib.pack_nodes(tree, packed_rows) if packed_rows else None
        pack = packing.pack if packing is not None else (lambda a: a)       # [B,N,...] -> the rows the layers see
        unpack = packing.unpack if packing is not None else (lambda a: a)   # and back, for the per-request parts
        x = self.model.embed_tokens(pack(tokens))
        row_positions = pack(positions)

        def gdn_mixer(mix, h, j, carry):
            qkv, z, b, a = mix.project(h)
            qkv, b, a = unpack(qkv), unpack(b), unpack(a)
            qkv = jnp.where(valid[..., None], qkv, 0)
            conv_out = gdn.gathered_conv(qkv, state.conv[j], mix.conv_weight, taps_idx)
            q, k, v, g, beta = mix.mixer_inputs(conv_out, b, a, valid)
            if kernel_impl == "reference":         # deferred commit: checkpoint + rows, folded on the fly
                o, fac = gdn.masked_solve(committed_ssm(state, j), q, k, v, g, beta, mask, method=method,
                                          path_nodes=tree.envelope.path_nodes)
            else:                                  # the one-launch kernels merge the rows into their state tile
                stacked = isinstance(j, int)       # unrolled: the kernel reads layer j's tiles of the stack itself
                o, fac = kernels.tree_solve(state.ssm if stacked else state.ssm[j], q, k, v, g, beta, mask,
                                            tree.envelope.path_nodes, impl=kernel_impl,
                                            method="neumann" if method == "neumann" else "auto",
                                            reference_method=method, compute_dtype=x.dtype,
                                            deferred=None if state.pending is None else pending_layer(
                                                state.pending, j), layer=j if stacked else None)
            return mix.output(pack(o), z, x.dtype), carry, (fac, qkv)

        def attn_mixer(att, h, j, carry):
            q, gate, k, v = att.qkv(h, row_positions)
            q, k, v = unpack(q), unpack(k).astype(state.keys.dtype), unpack(v).astype(state.values.dtype)
            if kernel_impl == "reference":
                keys = jnp.concatenate([state.keys[j], k], axis=1)
                values = jnp.concatenate([state.values[j], v], axis=1)
                return att.out(pack(attend(q, keys, values, attn_mask)), gate), carry, (k, v)
            # the cache is read in place, never concatenated
            o = kernels.tree_attention(q, state.keys[j], state.values[j], prefix_mask, k, v, mask, impl=kernel_impl)
            return att.out(pack(o), gate), carry, (k, v)

        x, taps, _, gdn_out, attn_out = self._stack(x, gdn_mixer, attn_mixer, tap_layers, norm_impl=kernel_impl)
        (factors, conv_inputs) = gdn_out if gdn_out is not None else (None, None)
        (keys, values) = attn_out if attn_out is not None else (None, None)
        cache = TreeCache(factors=factors, conv_inputs=conv_inputs, keys=keys, values=values, mask=mask)
        logits = unpack(self.logits(x))
        if tap_layers:
            return logits, (jax.vmap(unpack)(taps) if packing is not None else taps), cache
        return logits, unpack(x), cache


def _stack_outs(outs: list):
    """Per-layer outputs of one kind -> stacked over layers (None: none; a list when only some are None)."""
    if not outs or all(o is None for o in outs):
        return None
    if any(o is None for o in outs):
        return outs
    return jax.tree.map(lambda *a: jnp.stack(a), *outs)


# ------------------------------------------------------------------------------------------------
# Scanned layers
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ScanPlan:
    """The repeating block of a hybrid stack: `period` layers (e.g. three GDN + one attention), `blocks` of them."""
    period: int
    blocks: int
    kinds: tuple[str, ...]       # layer type of each position in the block
    rank: tuple[int, ...]        # each position's row among its kind within the block

    @property
    def per_block(self) -> dict[str, int]:
        return {k: self.kinds.count(k) for k in (LINEAR, FULL)}


def scan_plan(cfg: TargetConfig) -> ScanPlan | None:
    """The shortest period after which layer types and MLP kinds repeat, or None if the stack does not repeat
    (then the layers run unrolled)."""
    n = cfg.num_hidden_layers
    signature = [(cfg.layer_types[i], cfg.is_sparse_layer(i)) for i in range(n)]
    for period in range(1, n + 1):
        if n % period == 0 and all(signature[i] == signature[i % period] for i in range(n)):
            kinds = tuple(cfg.layer_types[:period])
            rank = tuple(kinds[:p].count(kinds[p]) for p in range(period))
            return ScanPlan(period, n // period, kinds, rank) if n // period > 1 else None
    return None


def scan_layers(model: TargetModel) -> TargetModel:
    """Restack the decoder layers, in place, as `model.model.scanned[p]`: position p of the repeating block with
    every parameter stacked over blocks [blocks, ...]; the forward then runs one block under `lax.scan` (compile
    time independent of depth). Each source array is freed as soon as its stack exists, so the model is never
    held twice; shardings carry over with the block axis replicated. Checkpoint names are unchanged: save
    through `unscan_layers`. A stack that does not repeat (`scan_plan` None) is left unrolled."""
    plan = scan_plan(model.config)
    if plan is None or model.is_scanned:
        return model
    layers = list(model.model.layers)
    scanned = []
    for p in range(plan.period):
        group = layers[p::plan.period]
        graphdef, _ = nnx.split(group[0])
        states = [nnx.split(layer)[1] for layer in group]
        scanned.append(nnx.merge(graphdef, jax.tree.map(_stack_freeing, *states)))
    del model.model.layers
    model.model.scanned = nnx.List(scanned)
    return model


def unscan_layers(model: TargetModel) -> TargetModel:
    """The inverse of `scan_layers`, in place (for saving and training, which address layers by index)."""
    if not model.is_scanned:
        return model
    plan = scan_plan(model.config)
    layers = [None] * model.config.num_hidden_layers
    for p, stacked in enumerate(model.model.scanned):
        graphdef, state = nnx.split(stacked)
        for b in range(plan.blocks):
            layers[b * plan.period + p] = nnx.merge(graphdef, jax.tree.map(lambda a: a[b], state))
    del model.model.scanned
    model.model.layers = nnx.List(layers)
    return model


def _stack_freeing(*arrays):
    """Stack arrays along a new leading axis and free the sources (concrete device arrays only)."""
    if not all(isinstance(a, jax.Array) for a in arrays) or any(isinstance(a, jax.core.Tracer) for a in arrays):
        return jnp.stack(arrays)
    sharding = arrays[0].sharding
    out = jnp.stack(arrays)
    if isinstance(sharding, jax.sharding.NamedSharding):
        out = jax.device_put(out, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(
            None, *sharding.spec)))
    for a in arrays:
        a.delete()
    return out


# ------------------------------------------------------------------------------------------------
# Functional entry points
# ------------------------------------------------------------------------------------------------
def create_model(cfg: TargetConfig, *, seed: int = 0, dtype=F32, scan: bool = False) -> TargetModel:
    """A randomly initialised model (tests, the labelled random demo, training from scratch); scan: with the
    repeating block stacked (`scan_layers`)."""
    # One compiled init instead of one eager dispatch (and compile) per parameter shape.
    return nnx.jit(lambda: _maybe_scan(TargetModel(cfg, dtype=dtype, rngs=nnx.Rngs(seed)), scan))()


def abstract_model(cfg: TargetConfig, dtype=F32, *, scan: bool = False) -> TargetModel:
    """Shapes only, no allocation (loading fills it)."""
    return nnx.eval_shape(lambda: _maybe_scan(TargetModel(cfg, dtype=dtype, rngs=nnx.Rngs(0)), scan))


def _maybe_scan(model: TargetModel, scan: bool) -> TargetModel:
    return scan_layers(model) if scan else model


def extend(graphdef: nnx.GraphDef, params: nnx.State, state: TargetState, tokens: jax.Array,
           valid: jax.Array, last_only: bool = False) -> tuple[jax.Array, TargetState]:
    model = nnx.merge(graphdef, params)
    logits, _, new_state = model.extend(state, tokens, valid, last_only=last_only)
    return logits, new_state


def verify(graphdef: nnx.GraphDef, params: nnx.State, state: TargetState, tree: Tree, tokens: jax.Array,
           method: gdn.InverseMethod = "squaring", packed_rows: int = 0) -> tuple[jax.Array, TreeCache]:
    model = nnx.merge(graphdef, params)
    logits, _, cache = model.verify(state, tree, tokens, method=method, packed_rows=packed_rows)
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




# ------------------------------------------------------------------------------------------------
# One GDN layer's tree-solve call, as the verify makes it (what the kernel benchmarks time)
# ------------------------------------------------------------------------------------------------
class MixerStream(NamedTuple):
    """A GDN layer's inputs before `gdn.mixer_inputs`: what a fused peer kernel (gates and l2norm inside) takes."""
    conv_out: jax.Array   # [B, N, conv_dim] post-conv stream [q | k | v], fp32
    b: jax.Array          # [B, N, HV] β logits (model dtype)
    a: jax.Array          # [B, N, HV] decay inputs (model dtype)
    A_log: jax.Array      # [HV]
    dt_bias: jax.Array    # [HV]
    parent: jax.Array     # [B, N] each node's parent (−1: the root), nodes in topological order


@dataclasses.dataclass(frozen=True)
class TreeSolveCall:
    """One GDN layer's `kernels.tree_solve` call as `TargetModel.verify` makes it: the arguments by name, and the
    keywords that follow from the model (path_nodes from the tree's envelope, compute_dtype from the activations).
    The one source of the kernel benchmarks' inputs (`verify_solve_call`); tests/test_verify_inputs.py checks it
    against what the verify really passes the dispatcher."""
    S0: jax.Array      # [Lg, B, HV, dk, dv] every GDN layer's committed state (fp32); the layer's is S0[layer]
    q: jax.Array       # [B, N, HK, dk]
    k: jax.Array       # [B, N, HK, dk]
    v: jax.Array       # [B, N, HV, dv]
    g: jax.Array       # [B, N, HV]
    beta: jax.Array    # [B, N, HV]
    mask: jax.Array    # [B, N, N] ancestor-or-self
    path_nodes: int
    compute_dtype: jnp.dtype
    layer: int            # the layer's row in S0 (the unrolled verify hands over the stack)
    stream: MixerStream   # where q, k, v, g, β came from

    @property
    def args(self) -> tuple[jax.Array, ...]:
        return self.S0, self.q, self.k, self.v, self.g, self.beta, self.mask

    @property
    def kwargs(self) -> dict:
        return {"path_nodes": self.path_nodes, "compute_dtype": self.compute_dtype, "layer": self.layer}


def verify_solve_call(cfg: TargetConfig, batch: int, nodes: int, *, depth: int, dtype=jnp.bfloat16,
                      seed: int = 0, layer: int = 0, states: jax.Array | None = None) -> TreeSolveCall:
    """A random GDN layer's tree-solve call at `cfg`'s geometry, formed as the verify forms it: one tree per
    request of `nodes` nodes with its deepest node at `depth` (`tree.random_parents`), a post-conv stream and gate
    inputs through `gdn.mixer_inputs` (q/k at their key heads, fp32), the committed state in fp32 and the model
    computing in `dtype`. A_log and dt_bias drawn as `GatedDeltaNet` initialises them. The state is layer `layer`
    of the stack `states` [Lg, B, HV, dk, dv] (default: a random stack of `cfg`'s GDN layers), as the unrolled
    verify hands it over."""
    rng = np.random.default_rng(seed)
    shape = tree_lib.TreeShape(nodes, depth)
    tree = tree_lib.pack_forest([tree_lib.random_parents(rng, nodes, depth, min_depth=depth)
                                 for _ in range(batch)], shape)
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    ks = jax.random.split(jax.random.key(seed), 5)
    conv_out = jax.nn.silu(jax.random.normal(ks[0], (batch, nodes, cfg.conv_dim), F32))   # gdn.gathered_conv's fp32
    b, a = (jax.random.normal(kk, (batch, nodes, hv), F32).astype(dtype) for kk in ks[1:3])
    A_log = jnp.log(jax.random.uniform(ks[3], (hv,), F32, 1.0, 16.0)).astype(dtype)
    dt_bias = jnp.ones((hv,), dtype)
    q, k, v, g, beta = gdn.mixer_inputs(conv_out, b, a, tree.valid, A_log, dt_bias, key_heads=hk, key_dim=dk)
    if states is None:
        states = jax.random.normal(ks[4], (len(cfg.gdn_layers), batch, hv, dk, dv), F32) * 0.1
    chex.assert_shape(states, (None, batch, hv, dk, dv))
    if not 0 <= layer < states.shape[0]:
        raise ValueError(f"layer {layer} of a stack of {states.shape[0]} GDN layers")
    return TreeSolveCall(states, q, k, v, g, beta, tree_lib.ancestor_mask(tree), shape.path_nodes, jnp.dtype(dtype),
                         layer, MixerStream(conv_out, b, a, A_log, dt_bias, tree.parent))


@dataclasses.dataclass(frozen=True)
class DecodeCall:
    """One GDN layer's `kernels.gdn_decode_layer` call as `TargetModel.extend` makes it in a decoding step (one token
    per slot), by name: the benchmarks' inputs (`decode_step_call`); tests/test_verify_inputs.py checks them against
    the decoding step's own call."""
    proj: jax.Array         # [B, HK·G] the in-projection's output row as it is (model dtype; `gdn.in_proj_widths`)
    window: jax.Array       # [Lg, B, K−1, C] every GDN layer's conv window (the state's conv dtype); layer's: [layer]
    conv_weight: jax.Array  # [C, K] conv taps
    A_log: jax.Array        # [HV]
    dt_bias: jax.Array      # [HV]
    S: jax.Array            # [Lg, B, HV, dk, dv] fp32: every GDN layer's state (the stack the step updates in place)
    valid: jax.Array        # [B] bool
    key_heads: int
    key_dim: int
    norm: gdn.OutputNorm    # the gated output norm (weight [dv] in the model dtype, eps)
    layer: int              # the layer's row in S

    @property
    def args(self) -> tuple[jax.Array, ...]:
        return self.proj, self.window, self.conv_weight, self.A_log, self.dt_bias, self.S, self.valid

    @property
    def kwargs(self) -> dict:
        return {"key_heads": self.key_heads, "key_dim": self.key_dim, "norm": self.norm, "layer": self.layer}

    @property
    def parts(self) -> gdn.InProjParts:
        """proj's parts (`gdn.split_in_proj`): what a peer kernel without the split is handed."""
        HV, dv = self.S.shape[-3], self.S.shape[-1]
        return gdn.split_in_proj(self.proj, key_heads=self.key_heads, key_dim=self.key_dim, value_heads=HV,
                                 value_dim=dv)


def decode_step_call(cfg: TargetConfig, batch: int, *, dtype=jnp.bfloat16, seed: int = 0, layer: int = 0,
                     states: jax.Array | None = None) -> DecodeCall:
    """A random GDN layer's decoding-step call at `cfg`'s geometry, every slot active, with the model computing (and
    keeping its conv windows) in `dtype`; conv taps, A_log, dt_bias and the norm's weight drawn as `GatedDeltaNet`
    initialises them (the norm's weight perturbed around its initial 1, so that it shows). The step is layer
    `layer`'s of the state stack `states` [Lg, B, HV, dk, dv] (default: a random stack of `cfg`'s GDN layers) and of
    a random window stack of as many layers, as the unrolled model's decoding step hands them over."""
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, K = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    ks = jax.random.split(jax.random.key(seed), 6)
    normal = lambda key, *shape: jax.random.normal(key, shape, F32).astype(dtype)   # noqa: E731
    if states is None:
        states = 0.1 * jax.random.normal(ks[5], (len(cfg.gdn_layers), batch, hv, dk, dv), F32)
    chex.assert_shape(states, (None, batch, hv, dk, dv))
    if not 0 <= layer < states.shape[0]:
        raise ValueError(f"layer {layer} of a stack of {states.shape[0]} GDN layers")
    width = hk * sum(gdn.in_proj_widths(hk, hv, dk, dv).values())
    return DecodeCall(
        proj=normal(ks[0], batch, width), window=normal(ks[1], states.shape[0], batch, K - 1, cfg.conv_dim),
        conv_weight=(0.3 * jax.random.normal(ks[2], (cfg.conv_dim, K), F32)).astype(dtype),
        A_log=jnp.log(jax.random.uniform(ks[3], (hv,), F32, 1.0, 16.0)).astype(dtype), dt_bias=jnp.ones((hv,), dtype),
        S=states, valid=jnp.ones((batch,), bool), key_heads=hk, key_dim=dk,
        norm=gdn.OutputNorm((1.0 + 0.1 * jax.random.normal(ks[4], (dv,), F32)).astype(dtype), cfg.rms_norm_eps),
        layer=layer)
