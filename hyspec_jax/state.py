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

from hyspec_jax.config import DrafterConfig, TargetConfig
from hyspec_jax.gdn import SolveFactors


@struct.dataclass
class TargetState:
    ssm: jax.Array      # [Lg, B, HV, dk, dv] fp32 committed recurrent state (HF layout)
    conv: jax.Array     # [Lg, B, K-1, conv_dim] last K-1 raw (pre-conv) q/k/v inputs, oldest first
    keys: jax.Array     # [La, B, S, KVH, hd] post-norm, post-RoPE keys
    values: jax.Array   # [La, B, S, KVH, hd]
    lengths: jax.Array  # [B] int32 committed tokens per slot

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        return self.keys.shape[2]


@struct.dataclass
class TreeCache:
    """What a tree verify leaves for the commit: factors, not per-node states (Bole, Algorithm 2).

    Stacked over layers of each kind; N = tree nodes. Transient: lives for one round.
    """
    factors: SolveFactors   # Γ [Lg,B,HV,N], keys [Lg,B,HV,N,dk], corrected values V' [Lg,B,HV,N,dv]
    conv_inputs: jax.Array  # [Lg, B, N, conv_dim] raw (pre-conv) q/k/v inputs of the nodes
    keys: jax.Array         # [La, B, N, KVH, hd] node keys (post-norm, post-RoPE at the node's position)
    values: jax.Array       # [La, B, N, KVH, hd]
    mask: jax.Array         # [B, N, N] ancestor-or-self


# jitted: one dispatch fills every buffer on the device (eager jnp.zeros cost ~0.2 ms each on a GPU host, a
# visible part of a short generation); inside another jit it is inlined as before
@functools.partial(jax.jit, static_argnames=("cfg", "batch", "max_len", "dtype"))
def init_state(cfg: TargetConfig, batch: int, max_len: int, dtype=jnp.float32) -> TargetState:
    """Empty state: zero recurrent state and conv window (HF's zero left padding), empty KV."""
    lg, la = len(cfg.gdn_layers), len(cfg.attn_layers)
    return TargetState(
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


def state_bytes(state: TargetState) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
