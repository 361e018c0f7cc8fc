"""Top-k children and the log-sum-exp of every beam row of a tree level, one launch (the greedy tree build).

Must equal `biased_topk_reference`: for logits x = base[b] + bias[b, w] (fp32), (values, indices) of
`lax.top_k(x, k)` — descending, ties to the lower index — and log Σ exp(x) with the row max taken out first.

Why a kernel: at batch 1 a speculative round is launch-bound (bench/results/archive/round_profile_h200.md). Each of the
tree's levels ran the bias add, XLA's TopK custom call and the max / exp-sum / log fusions around it as separate
launches (and the TopK alone took 37 µs of GPU time a level for 16 rows of 8,192); here they are one.

One program per beam row (b, w): the whole row sits in registers (V ≤ 16,384 fp32), the log-sum-exp is one
max and one exp-sum over it, and the top k are k rounds of (max, lowest index at the max, take it out).
Lowering: Pallas' Triton lowering (row reductions only, no matrix work: nothing for Mosaic GPU's wgmma to add).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

F32 = jnp.float32
REFERENCE = "lax.top_k and the log-sum-exp of base[:, None] + bias"
MAX_VOCAB = 16384


def biased_topk_reference(base: jax.Array, bias: jax.Array | None, k: int):
    """base [B, V], bias [B, W, V] or None (W = 1) → (values [B, W, k] f32, indices [B, W, k] int32,
    lse [B, W] f32)."""
    x = base[:, None, :].astype(F32) if bias is None else base[:, None, :].astype(F32) + bias.astype(F32)
    top, idx = lax.top_k(x, k)
    # the row max by a reduction (the same value as top[..., :1]): XLA:CPU compiled the exp-sum fused with the
    # top-k's output ~30x slower (4 ms against 0.12 ms for 3 rows of 8,192), a 35% slower CPU round
    m = jnp.max(x, axis=-1, keepdims=True)
    lse = (m + jnp.log(jnp.sum(jnp.exp(x - m), axis=-1, keepdims=True)))[..., 0]
    return top, idx.astype(jnp.int32), lse


def _select(x, iota, avail, k: int, kp: int):
    """The k largest of x among `avail` (ties: lowest iota first) → (values [kp], positions [kp]); unrolled."""
    n = x.shape[0]
    lane = lax.broadcasted_iota(jnp.int32, (kp,), 0)
    vals = jnp.full((kp,), -jnp.inf, F32)
    pos = jnp.zeros((kp,), jnp.int32)
    for i in range(k):
        xm = jnp.where(avail, x, -jnp.inf)
        m = jnp.max(xm)
        j = jnp.min(jnp.where(avail & (xm == m), iota, n))
        vals = jnp.where(lane == i, m, vals)
        pos = jnp.where(lane == i, j, pos)
        avail = avail & (iota != j)
    return vals, pos


def _kernel(base_ref, bias_ref, val_ref, idx_ref, lse_ref, *, k: int):
    """One row (or one chunk of a row: grid axis 2) → its top k (global indices) and log-sum-exp."""
    x = base_ref[...].astype(F32)
    if bias_ref is not None:
        x = x + bias_ref[...].astype(F32)
    n = x.shape[0]
    iota = lax.broadcasted_iota(jnp.int32, (n,), 0)
    vals, pos = _select(x, iota, iota >= 0, k, val_ref.shape[0])
    m0 = jnp.max(vals)          # the row max is the first value taken
    val_ref[...] = vals
    idx_ref[...] = pos + pl.program_id(2) * n
    lse_ref[...] = jnp.full((1,), m0 + jnp.log(jnp.sum(jnp.exp(x - m0))), F32)


def _merge_kernel(val_ref, idx_ref, lse_ref, val_out, idx_out, lse_out, *, k: int):
    """A row's chunk results (chunk-major, so position order is index order among equal values) → its top k and
    log-sum-exp."""
    v = val_ref[...]
    n = v.shape[0]
    iota = lax.broadcasted_iota(jnp.int32, (n,), 0)
    vals, pos = _select(v, iota, iota >= 0, k, val_out.shape[0])
    idx = idx_ref[...]
    kp = val_out.shape[0]
    lane = lax.broadcasted_iota(jnp.int32, (kp,), 0)
    out = jnp.zeros((kp,), jnp.int32)
    for i in range(k):
        p = jnp.sum(jnp.where(lane == i, pos, 0))
        out = jnp.where(lane == i, jnp.sum(jnp.where(iota == p, idx, 0)), out)
    parts = lse_ref[...]
    m = jnp.max(parts)
    val_out[...] = vals
    idx_out[...] = out
    lse_out[...] = jnp.full((1,), m + jnp.log(jnp.sum(jnp.exp(parts - m))), F32)


def supported(V: int, k: int) -> bool:
    """A power-of-two vocabulary the registers of one program hold, and k ≤ V."""
    return 16 <= V <= MAX_VOCAB and (V & (V - 1)) == 0 and 1 <= k <= min(V, 64)


@functools.partial(jax.jit, static_argnames=("k", "chunks", "num_warps", "interpret"))
def biased_topk_pallas(base: jax.Array, bias: jax.Array | None, *, k: int, chunks: int = 1,
                       num_warps: int | None = None, interpret: bool = False):
    """`biased_topk_reference` in one launch (see the module docstring); chunks > 1 (a power of two): each row's
    vocabulary split over that many programs, then a second, small launch merges their top k and log-sum-exps."""
    B, V = base.shape
    W = 1 if bias is None else bias.shape[1]
    if (not supported(V, k) or (bias is not None and bias.shape != (B, W, V)) or chunks < 1
            or chunks & (chunks - 1) or V // chunks < 16):
        raise ValueError(f"unsupported top-k shape: base {base.shape}, bias "
                         f"{None if bias is None else bias.shape}, k {k}, chunks {chunks}")
    kp = 1
    while kp < k:
        kp *= 2
    Vc = V // chunks
    if num_warps is None:
        num_warps = 4 if Vc <= 4096 else 8
    in_specs = [pl.BlockSpec((None, Vc), lambda b, w, c: (b, c))]
    args = [base]
    if bias is not None:
        in_specs.append(pl.BlockSpec((None, None, Vc), lambda b, w, c: (b, w, c)))
        args.append(bias)
        kern = functools.partial(_kernel, k=k)
    else:
        kern = functools.partial(lambda base_ref, *outs, k: _kernel(base_ref, None, *outs, k=k), k=k)
    spec = lambda n: pl.BlockSpec((None, None, n), lambda b, w, c: (b, w, c))  # noqa: E731
    out_shape = [jax.ShapeDtypeStruct((B, W, chunks * kp), F32), jax.ShapeDtypeStruct((B, W, chunks * kp), jnp.int32),
                 jax.ShapeDtypeStruct((B, W, chunks), F32)]
    vals, idxs, lse = pl.pallas_call(
        kern, out_shape=out_shape, grid=(B, W, chunks), in_specs=in_specs, out_specs=[spec(kp), spec(kp), spec(1)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="tree_level_topk",
    )(*args)
    if chunks > 1:
        whole = lambda n: pl.BlockSpec((None, None, n), lambda b, w: (b, w, 0))  # noqa: E731
        vals, idxs, lse = pl.pallas_call(
            functools.partial(_merge_kernel, k=k),
            out_shape=[jax.ShapeDtypeStruct((B, W, kp), F32), jax.ShapeDtypeStruct((B, W, kp), jnp.int32),
                       jax.ShapeDtypeStruct((B, W, 1), F32)],
            grid=(B, W), in_specs=[whole(chunks * kp), whole(chunks * kp), whole(chunks)],
            out_specs=[whole(kp), whole(kp), whole(1)],
            compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
            interpret=interpret, name="tree_level_topk_merge",
        )(vals, idxs, lse)
    if kp != k:
        vals, idxs = vals[..., :k], idxs[..., :k]
    return vals, idxs, lse[..., 0]
