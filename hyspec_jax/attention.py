"""GQA attention math: the one formula prefill, decode and tree verify use, and the contract of the tree-attention
kernel (`pallas_kernels.tree_attention` must equal `attend_prefix_tree`).

Pure JAX, no model state. Scores, softmax and the value products accumulate in fp32, or in the query's dtype
where that is wider (fp64 gradient checks).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

F32 = jnp.float32


def _accumulator(dtype) -> jnp.dtype:
    return jnp.promote_types(dtype, F32)


def attend(q: jax.Array, keys: jax.Array, values: jax.Array, mask: jax.Array) -> jax.Array:
    """GQA attention. q [B,T,NH,hd]; keys/values [B,S,KVH,hd]; mask [B,T,S] bool. fp32 softmax.

    Returns [B, T, NH, hd]. The one attention formula used by prefill, decode and tree verify (`attend_parts`).
    """
    return attend_parts(q, ((keys, values, mask),))


def attend_prefix_tree(q: jax.Array, keys: jax.Array, values: jax.Array, prefix_mask: jax.Array,
                       tree_keys: jax.Array, tree_values: jax.Array, tree_mask: jax.Array) -> jax.Array:
    """`attend` over [committed prefix | tree nodes] without concatenating the KV cache: equals
    attend(q, concat(keys, tree_keys), concat(values, tree_values), concat(prefix_mask[:, None], tree_mask)).
    prefix_mask [B,S]; tree_keys/values [B,N,KVH,hd]; tree_mask [B,T,N]. The verify's tree attention (it never
    copies the cache) and the reference of `pallas_kernels.tree_attention`; `hyspec bench kernels --attention`
    times both forms."""
    return attend_parts(q, ((keys, values, prefix_mask[:, None]), (tree_keys, tree_values, tree_mask)))


@jax.named_scope("attention")
def attend_parts(q: jax.Array, parts) -> jax.Array:
    """GQA attention of q [B,T,NH,hd] over the union of key/value parts ((keys [B,S_i,KVH,hd], values, mask
    [B,T or 1,S_i] bool), ...), normalised jointly (one max, one denominator: a softmax over all parts' keys),
    fp32 scores and softmax. A query row with no key in any part gets zeros (padding). Returns [B,T,NH,hd]."""
    B, T, NH, hd = q.shape
    acc = _accumulator(q.dtype)
    kvh = parts[0][0].shape[2]
    qg = q.reshape(B, T, kvh, NH // kvh, hd)
    scores = []
    for keys, _, mask in parts:
        s = jnp.einsum("btgrd,bsgd->bgrts", qg, keys, preferred_element_type=acc) * (hd ** -0.5)
        scores.append(jnp.where(mask[:, None, None], s, -jnp.inf))
    m = functools.reduce(jnp.maximum, [s.max(-1, keepdims=True) for s in scores])
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))           # 0: rows with no key at all
    probs = [jnp.exp(s - m) for s in scores]
    denom = sum(p.sum(-1, keepdims=True) for p in probs)
    out = sum(jnp.einsum("bgrts,bsgd->btgrd", p.astype(values.dtype), values, preferred_element_type=acc)
              for p, (_, values, _) in zip(probs, parts))
    denom = jnp.moveaxis(denom, 3, 1)                                        # [B,T,g,r,1] like out
    out = jnp.where(denom > 0, out / jnp.where(denom > 0, denom, 1.0), 0.0)
    return out.reshape(B, T, NH, hd).astype(q.dtype)


__all__ = ["attend", "attend_parts", "attend_prefix_tree"]
