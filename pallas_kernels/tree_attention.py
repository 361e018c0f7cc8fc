"""Tree attention of a full-attention layer: committed prefix (the KV cache) + ancestor-masked tree nodes.

Must equal `hyspec_jax.attention.attend_prefix_tree` (the one attention formula, `attend_parts`, with the
prefix and the tree as its two parts).

XLA runs this as score einsum → fp32 softmax over [B, KVH, R, T, S] in HBM → PV einsum. The prefix is the big
part (S tokens of K/V, read once), the tree part is small (N ≤ 128 keys), so:

1. `prefix_partials_pallas`, split-S flash attention over the prefix: one program per (request b, KV head g,
   tile of query rows, split of S). Query rows are the T tree nodes × R = NH/KVH query heads of one KV head,
   so every K/V block loaded serves all R heads (GQA). Each program streams its S/splits keys in blocks of
   block_s with an online softmax and writes its unnormalised partial (acc [rows, hd], running max m, sum l).
   The splits give B·KVH·row_tiles·splits programs, enough to fill the GPU at batch 1 (B·KVH = 4 alone is not).
2. `combine` (XLA, small): the tree part's scores [B, KVH, rows, N] with the ancestor mask, then one joint
   max/denominator over the splits' partials and the tree part — the same normalisation as `attend_parts`.

Lowering: Pallas' Triton lowering, like the GDN kernels (`gdn_tree_solve.py` says why). Block shapes must be
powers of two: rows are padded to a multiple of block_rows, and S/splits must be a power-of-two multiple of
block_s (`supported`). `hyspec_jax.kernels.attention_tiling` picks the tiling per shape; docs/kernels.md has the
measurements.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hyspec_jax.pallas_kernels import tile_dim_ok

F32 = jnp.float32
REFERENCE = "hyspec_jax.attention.attend_prefix_tree"


def supported(S: int, hd: int, *, block_s: int, splits: int, block_rows: int) -> bool:
    if splits < 1 or S % splits:
        return False
    per = S // splits
    return (tile_dim_ok(hd) and hd <= 256 and tile_dim_ok(block_s) and tile_dim_ok(block_rows) and tile_dim_ok(per)
            and per % block_s == 0)


def _prefix_kernel(q_ref, k_ref, v_ref, mask_ref, acc_ref, m_ref, l_ref, *, block_s: int, scale: float):
    q = q_ref[...]                                                     # [rows, hd]
    rows, hd = q.shape

    def body(i, carry):
        m, l, acc = carry
        blk = pl.ds(i * block_s, block_s)
        k, v, ok = k_ref[blk, :], v_ref[blk, :], mask_ref[blk] > 0     # [bs, hd] ×2, [bs]
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=F32) * scale
        s = jnp.where(ok[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        m_safe = jnp.where(m_new > -jnp.inf, m_new, 0.0)               # a row with no key yet: nothing to scale
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[:, None])
        l = l * alpha + p.sum(axis=1)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=F32)
        return m_new, l, acc * alpha[:, None] + pv

    init = (jnp.full((rows,), -jnp.inf, F32), jnp.zeros((rows,), F32), jnp.zeros((rows, hd), F32))
    m, l, acc = lax.fori_loop(0, k_ref.shape[0] // block_s, body, init)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(jax.jit, static_argnames=("block_s", "splits", "block_rows", "num_warps", "num_stages",
                                             "interpret"))
def prefix_partials_pallas(qg, keys, values, prefix_mask, *, block_s: int = 64, splits: int = 8,
                           block_rows: int = 64, num_warps: int = 4, num_stages: int = 2,
                           interpret: bool = False):
    """qg [B, KVH, rows, hd] (rows a multiple of block_rows); keys/values [B, S, KVH, hd] (the cache layout);
    prefix_mask [B, S] bool. Returns the split partials (acc [B,KVH,splits,rows,hd], m, l [B,KVH,splits,rows])
    of softmax(qg kᵀ / √hd) v over the masked prefix, each split normalised by its own running max m."""
    B, KVH, rows, hd = qg.shape
    S = keys.shape[1]
    if not supported(S, hd, block_s=block_s, splits=splits, block_rows=block_rows) or rows % block_rows:
        raise ValueError(f"unsupported shape S={S} hd={hd} rows={rows} block_s={block_s} splits={splits} "
                         f"block_rows={block_rows}")
    per = S // splits
    grid = (B, KVH, rows // block_rows, splits)
    kern = functools.partial(_prefix_kernel, block_s=block_s, scale=hd ** -0.5)
    in_specs = [
        pl.BlockSpec((None, None, block_rows, hd), lambda b, g, r, s: (b, g, r, 0)),   # qg
        pl.BlockSpec((None, per, None, hd), lambda b, g, r, s: (b, s, g, 0)),          # keys
        pl.BlockSpec((None, per, None, hd), lambda b, g, r, s: (b, s, g, 0)),          # values
        pl.BlockSpec((None, per), lambda b, g, r, s: (b, s)),                           # prefix mask
    ]
    out_specs = [
        pl.BlockSpec((None, None, None, block_rows, hd), lambda b, g, r, s: (b, g, s, r, 0)),
        pl.BlockSpec((None, None, None, block_rows), lambda b, g, r, s: (b, g, s, r)),
        pl.BlockSpec((None, None, None, block_rows), lambda b, g, r, s: (b, g, s, r)),
    ]
    out_shape = [jax.ShapeDtypeStruct((B, KVH, splits, rows, hd), F32),
                 jax.ShapeDtypeStruct((B, KVH, splits, rows), F32),
                 jax.ShapeDtypeStruct((B, KVH, splits, rows), F32)]
    return pl.pallas_call(
        kern, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="tree_attention_prefix",
    )(qg, keys, values, prefix_mask.astype(jnp.int32))


def combine(acc, m, l, qg, tree_keys, tree_values, tree_mask_rows):
    """Joint softmax over the prefix partials and the tree part. qg [B,KVH,rows,hd]; tree_keys/values
    [B,N,KVH,hd]; tree_mask_rows [B,rows,N] bool. Returns [B,KVH,rows,hd] fp32 (zeros for a row with no key)."""
    hd = qg.shape[-1]
    s_t = jnp.einsum("bgxd,bngd->bgxn", qg, tree_keys, preferred_element_type=F32) * (hd ** -0.5)
    s_t = jnp.where(tree_mask_rows[:, None], s_t, -jnp.inf)
    M = jnp.maximum(m.max(axis=2), s_t.max(axis=-1))                  # [B,KVH,rows]
    M = jnp.where(jnp.isfinite(M), M, 0.0)
    w = jnp.exp(m - M[:, :, None])                                     # [B,KVH,splits,rows]
    p_t = jnp.exp(s_t - M[..., None])
    num = (acc * w[..., None]).sum(axis=2) + jnp.einsum(
        "bgxn,bngd->bgxd", p_t.astype(tree_values.dtype), tree_values, preferred_element_type=F32)
    den = (l * w).sum(axis=2) + p_t.sum(axis=-1)
    return jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)


@functools.partial(jax.jit, static_argnames=("block_s", "splits", "block_rows", "num_warps", "num_stages",
                                             "interpret"))
def prefix_tree_attention(q, keys, values, prefix_mask, tree_keys, tree_values, tree_mask, *, block_s: int = 64,
                          splits: int = 8, block_rows: int = 64, num_warps: int = 4, num_stages: int = 2,
                          interpret: bool = False):
    """The contract of `attention.attend_prefix_tree`: q [B,T,NH,hd]; keys/values [B,S,KVH,hd]; prefix_mask [B,S];
    tree_keys/values [B,N,KVH,hd]; tree_mask [B,T,N]. Returns [B,T,NH,hd] in q's dtype."""
    B, T, NH, hd = q.shape
    KVH = keys.shape[2]
    R = NH // KVH
    rows = T * R
    rows_p = -(-rows // block_rows) * block_rows
    qg = q.reshape(B, T, KVH, R, hd).transpose(0, 2, 1, 3, 4).reshape(B, KVH, rows, hd)   # row = t·R + r
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows_p - rows), (0, 0)))
    acc, m, l = prefix_partials_pallas(qg, keys, values, prefix_mask, block_s=block_s, splits=splits,
                                       block_rows=block_rows, num_warps=num_warps, num_stages=num_stages,
                                       interpret=interpret)
    mask_rows = jnp.repeat(tree_mask, R, axis=1)                       # [B, rows, N], row t·R + r ← node t
    mask_rows = jnp.pad(mask_rows, ((0, 0), (0, rows_p - rows), (0, 0)))
    out = combine(acc, m, l, qg, tree_keys, tree_values, mask_rows)[:, :, :rows]
    return out.reshape(B, KVH, T, R, hd).transpose(0, 2, 1, 3, 4).reshape(B, T, NH, hd).astype(q.dtype)


def default_splits(B: int, rows: int, S: int, kvh: int, block_rows: int, block_s: int, programs: int = 264) -> int:
    """Splits of the prefix: the fewest (a power of two) that give about two programs per H200 SM (132), each
    split still a power-of-two multiple of block_s keys."""
    tiles = -(-rows // block_rows)
    splits = 1
    while B * kvh * tiles * splits < programs and S % (2 * splits) == 0 and S // (2 * splits) >= block_s:
        splits *= 2
    return splits


__all__ = ["REFERENCE", "supported", "prefix_partials_pallas", "combine", "prefix_tree_attention", "default_splits"]
