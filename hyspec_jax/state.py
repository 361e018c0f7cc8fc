"""Cache / recurrent-state pytrees, batched over a fixed number of slots and stacked over layers.

Stacking per layer kind ([num_gdn_layers, ...], [num_attn_layers, ...]) lets one batched op touch every
layer at once (e.g. the factorized commit of all GDN states). `TargetState` and `DrafterState` of a slot
hold the same committed length: the drafter's context K/V covers exactly the tokens the target committed.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
from flax import struct

from hyspec_jax import gdn
from hyspec_jax.config import DrafterConfig, TargetConfig
from hyspec_jax.gdn import DeferredUpdates, SolveFactors


@struct.dataclass
class TargetState:
    ssm: jax.Array      # [Lg, B, HV, dk, dv] fp32 committed recurrent state (HF layout)
    conv: jax.Array     # [Lg, B, K-1, conv_dim] last K-1 raw (pre-conv) q/k/v inputs, oldest first
    keys: jax.Array     # [La, B, S, KVH, hd] post-norm, post-RoPE keys
    values: jax.Array   # [La, B, S, KVH, hd]
    lengths: jax.Array  # [B] int32 committed tokens per slot
    # Deferred commit (None: off, `ssm` is the committed state): the committed state of GDN layer j is
    # `gdn.deferred_fold(ssm[j], pending[j])` — a checkpoint plus the accepted rows of the last rounds, folded into
    # `ssm` only when the rows run out (`settle_pending`). Stacked over layers: c [Lg,B,HV], c_i [Lg,B,HV,P],
    # keys [Lg,B,HV,P,dk], values [Lg,B,HV,P,dv], count [Lg,B] (equal over layers).
    pending: DeferredUpdates | None = None

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        return self.keys.shape[2]

    @property
    def deferred_rows(self) -> int:
        """Row capacity P of the deferred commit (0: off)."""
        return 0 if self.pending is None else self.pending.row_decay.shape[-1]


@struct.dataclass
class TreeCache:
    """What a tree verify leaves for the commit: factors, not per-node states (Bole, Algorithm 2).

    Stacked over layers of each kind; N = tree nodes. Transient: lives for one round.
    """
    factors: SolveFactors   # Γ [Lg,B,HV,N], keys [Lg,B,N,HK,dk] (as the solve took them), corrected values V' [Lg,B,HV,N,dv]
    conv_inputs: jax.Array  # [Lg, B, N, conv_dim] raw (pre-conv) q/k/v inputs of the nodes
    keys: jax.Array         # [La, B, N, KVH, hd] node keys (post-norm, post-RoPE at the node's position)
    values: jax.Array       # [La, B, N, KVH, hd]
    mask: jax.Array         # [B, N, N] ancestor-or-self


# jitted: one dispatch fills every buffer on the device (eager jnp.zeros cost ~0.2 ms each on a GPU host, a
# visible part of a short generation); inside another jit it is inlined as before
@functools.partial(jax.jit, static_argnames=("cfg", "batch", "max_len", "dtype", "deferred_rows"))
def init_state(cfg: TargetConfig, batch: int, max_len: int, dtype=jnp.float32, deferred_rows: int = 0
               ) -> TargetState:
    """Empty state: zero recurrent state and conv window (HF's zero left padding), empty KV; deferred_rows P > 0:
    with an empty ring of P pending rows per slot and GDN layer (deferred commit)."""
    lg, la = len(cfg.gdn_layers), len(cfg.attn_layers)
    pending = None
    if deferred_rows > 0:
        one = gdn.deferred_empty(batch, cfg.linear_num_value_heads, deferred_rows, cfg.linear_key_head_dim,
                                 cfg.linear_value_head_dim)
        pending = jax.tree.map(lambda x: jnp.broadcast_to(x, (lg,) + x.shape), one)
    return TargetState(
        pending=pending,
        ssm=jnp.zeros((lg, batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                       cfg.linear_value_head_dim), jnp.float32),
        conv=jnp.zeros((lg, batch, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), dtype),
        keys=jnp.zeros((la, batch, max_len, cfg.num_key_value_heads, cfg.head_dim), dtype),
        values=jnp.zeros((la, batch, max_len, cfg.num_key_value_heads, cfg.head_dim), dtype),
        lengths=jnp.zeros((batch,), jnp.int32),
    )


@struct.dataclass
class DrafterState:
    """Context K/V of committed tokens, per draft layer. Entry p holds the target features of token p."""
    keys: jax.Array     # [n_layers, B, S, KVH, hd] post-k_norm, post-RoPE
    values: jax.Array   # [n_layers, B, S, KVH, hd]
    lengths: jax.Array  # [B] int32: committed tokens with context K/V = the anchor's position

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        return self.keys.shape[2]


@functools.partial(jax.jit, static_argnames=("cfg", "batch", "max_len", "dtype"))   # one dispatch (as init_state)
def init_drafter_state(cfg: DrafterConfig, batch: int, max_len: int, dtype=jnp.float32) -> DrafterState:
    shape = (cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    return DrafterState(keys=jnp.zeros(shape, dtype), values=jnp.zeros(shape, dtype),
                        lengths=jnp.zeros((batch,), jnp.int32))


def check_state(cfg: TargetConfig, state: TargetState) -> None:
    """Shape asserts at module edges."""
    B = state.batch
    chex.assert_shape(state.ssm, (len(cfg.gdn_layers), B, cfg.linear_num_value_heads,
                                  cfg.linear_key_head_dim, cfg.linear_value_head_dim))
    chex.assert_shape(state.conv, (len(cfg.gdn_layers), B, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim))
    chex.assert_shape([state.keys, state.values],
                      (len(cfg.attn_layers), B, state.max_len, cfg.num_key_value_heads, cfg.head_dim))
    if state.pending is not None:
        lg, hv, P = len(cfg.gdn_layers), cfg.linear_num_value_heads, state.deferred_rows
        chex.assert_shape(state.pending.keys, (lg, B, hv, P, cfg.linear_key_head_dim))
        chex.assert_shape(state.pending.values, (lg, B, hv, P, cfg.linear_value_head_dim))
        chex.assert_shape(state.pending.count, (lg, B))


def pending_layer(pending: DeferredUpdates, j) -> DeferredUpdates:
    """GDN layer j's rows (j a Python int or traced, as the stacked forward passes it)."""
    return jax.tree.map(lambda x: x[j], pending)


def write_layer(stack: jax.Array, j, value: jax.Array) -> jax.Array:
    """stack with row j (a layer) replaced by value, in place. The barrier keeps value's own computation out of the
    row update: fused into it, that update read the stack it wrote and XLA copied the whole stack first (measured
    on the embedded model's decoding step: 12 more kernels a step)."""
    return stack.at[j].set(jax.lax.optimization_barrier(value.astype(stack.dtype)))


def committed_ssm(state: TargetState, j) -> jax.Array:
    """The committed recurrent state of GDN layer j [B,HV,dk,dv] fp32 (the checkpoint folded with its rows)."""
    if state.pending is None:
        return state.ssm[j]
    return gdn.deferred_fold(state.ssm[j], pending_layer(state.pending, j))


def empty_pending(pending: DeferredUpdates) -> DeferredUpdates:
    """The same ring, emptied (c = 0, no rows): the checkpoint alone is the state."""
    return jax.tree.map(jnp.zeros_like, pending)


def fold_pending(state: TargetState) -> TargetState:
    """Every slot's rows folded into its checkpoint, for every GDN layer (one state read and write)."""
    if state.pending is None:
        return state
    ssm = jax.vmap(gdn.deferred_fold)(state.ssm, state.pending)
    return state.replace(ssm=ssm.astype(state.ssm.dtype), pending=empty_pending(state.pending))


def settle_pending(state: TargetState, next_rows: int) -> TargetState:
    """Fold when the next commit of up to `next_rows` rows could overflow some slot's ring (count > P − next_rows).

    One `lax.cond` for the whole batch, so the program's shape is fixed and rounds with room write no state.
    When one slot is full every slot is folded: the fold is one pass over the whole state either way (a
    per-slot select still reads and writes all of it), and folding all of them puts every ring back at 0, so
    the batch folds about once per P / rows-per-round rounds rather than whenever any one slot is full."""
    P = state.deferred_rows
    if P == 0:
        return state
    if next_rows > P:
        raise ValueError(f"deferred commit: a round commits up to {next_rows} rows but the ring holds {P}")
    full = jnp.any(state.pending.count > P - next_rows)
    return jax.lax.cond(full, fold_pending, lambda s: s, state)


def state_bytes(state: TargetState) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
