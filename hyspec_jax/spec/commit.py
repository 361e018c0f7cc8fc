"""Factorized commit of the accepted path (Bole, Algorithm 2).

Given the node each request accepted, one batched op over the stacked GDN layers forms the new recurrent
states from the verify factors, S_a = e^{Γ_a} S₀ + Σ_j D_aj k_j V'_jᵀ; the conv windows are gathered from
the accepted path's raw inputs; the path's attention K/V are compacted to consecutive positions after the
committed prefix. Rejected branches cost nothing and nothing is rolled back. node = −1 keeps the state.

Deferred commit (`TargetState.pending`, SpecConfig.deferred_rows): the path's factor rows (k_j, V'_j, Γ_j) are
appended to each slot's ring instead (`gdn.deferred_append`), and no state is written unless a ring could not take
the path (`state.settle_pending` folds first): ReplaySSM's checkpoint-plus-accepted-steps, for trees as for chains.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from hyspec_jax import gdn, kernels
from hyspec_jax import tree as tree_lib
from hyspec_jax.state import TargetState, TreeCache, settle_pending
from hyspec_jax.tree import Tree


def commit(state: TargetState, cache: TreeCache, tree: Tree, node: jax.Array, kernel_impl: str = "reference"
           ) -> TargetState:
    """Commit, for every slot b, the root-to-`node[b]` path of its tree (node −1: nothing). kernel_impl: as
    `TargetModel.verify` ("reference": gdn.node_state per layer; else `hyspec_jax.kernels.path_commit`,
    all layers in one launch)."""
    B = state.batch
    chex.assert_shape(node, (B,))
    path, length = tree_lib.path_to(tree, node)                                 # [B, d+1], [B]

    pending = None
    if state.pending is not None:
        # the factors are relative to the folded state the verify read: fold first if the path may not fit
        state = settle_pending(state, path.shape[1])
        ssm = state.ssm
        pending = jax.vmap(gdn.deferred_append, in_axes=(0, 0, None, None))(state.pending, cache.factors, path,
                                                                             length)
    else:
        factors, chain, last = _path_rows(cache.factors, path, length)
        if kernel_impl == "reference":
            ssm = jax.vmap(gdn.node_state, in_axes=(0, 0, None, None))(state.ssm, factors, chain, last)
        else:
            ssm = kernels.path_commit(state.ssm, factors.log_decay, factors.keys, factors.corrected, chain, last,
                                      impl=kernel_impl)

    K = state.conv.shape[2] + 1
    rows = tree_lib.window_taps_after(tree, node, K)                             # [B, K-1]
    def window(conv, x):                                                         # one layer: [B,K-1,C], [B,N,C]
        xs = jnp.concatenate([conv, x.astype(conv.dtype)], axis=1)
        return jnp.take_along_axis(xs, rows[..., None], axis=1)
    conv = jax.vmap(window)(state.conv, cache.conv_inputs)

    # KV of the path's nodes to positions lengths + i (i < length); other slots untouched.
    i = jnp.arange(path.shape[1], dtype=jnp.int32)[None]
    dest = jnp.where(i < length[:, None], state.lengths[:, None] + i, state.max_len)   # out of range → dropped
    src = jnp.maximum(path, 0)
    b = jnp.arange(B)[:, None]
    def place(cache_kv, node_kv):                                                # [B,S,KVH,hd], [B,N,KVH,hd]
        return cache_kv.at[b, dest].set(node_kv[b, src], mode="drop")
    keys, values = state.keys, state.values
    if cache.keys is not None:
        keys = jax.vmap(place)(state.keys, cache.keys)
        values = jax.vmap(place)(state.values, cache.values)
    return TargetState(ssm=ssm, conv=conv, keys=keys, values=values, lengths=state.lengths + length,
                       pending=pending)


def _path_rows(factors: gdn.SolveFactors, path: jax.Array, length: jax.Array
               ) -> tuple[gdn.SolveFactors, jax.Array, jax.Array]:
    """Every layer's factors at the accepted path's nodes only (path [B, d] as `tree.path_to` gives it), with the
    chain mask of that path and its last node (−1: nothing accepted): what `gdn.node_state` and
    `kernels.path_commit` need, d nodes instead of N. Gathering first also lets XLA fuse the unrolled verify's
    stacking of the layers' factors into the gather, rather than copy all N nodes of every layer into one stack for
    the commit kernel (1.1 ms of copies at the 27B geometry, B 8, N 32; the fused form not yet timed on a GPU)."""
    src = jnp.maximum(path, 0)[None]                                                 # [1, B, d]
    d = path.shape[1]
    on_path = gdn.SolveFactors(
        log_decay=jnp.take_along_axis(factors.log_decay, src[:, :, None, :], axis=3),           # [Lg,B,HV,d]
        keys=jnp.take_along_axis(factors.keys, src[..., None, None], axis=2),                 # [Lg,B,d,HK,dk]
        corrected=jnp.take_along_axis(factors.corrected, src[:, :, None, :, None], axis=3))  # [Lg,B,HV,d,dv]
    chain = jnp.broadcast_to(jnp.tril(jnp.ones((d, d), bool)), (path.shape[0], d, d))
    return on_path, chain, length - 1

