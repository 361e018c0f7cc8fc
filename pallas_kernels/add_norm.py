"""A residual add and the RMSNorm after it in one launch: the decoder layer's `x = x + y; h = norm(x)`.

Must equal `hyspec_jax.gdn.add_rms_norm(x, y, weight, eps, zero_centred=...)`: from rows x, y [R, H] of one dtype
and the norm's weight [H], the new residual stream s = x + y (in x's dtype, as XLA adds it: bit for bit) and the
normed h = `gdn.rms_norm(s, ...)` (its fp32 sum of squares summed in another order: within rounding).

What it replaces: in the decoding step at batch 1 on an H100, XLA runs each residual add and the norm after it as
three kernels — the split-K sum of the product before it with the add, the norm's sum of squares, then its scaling
(bench/results/scale/decode_hlo_h100_decode_row.md). Here the add and the norm are one kernel, beside whatever XLA
makes of the split-K sum; the effect on the step's kernel count and time is not measured on a GPU yet.

One program a row (grid (R,)): the row's x, y and both outputs are blocks of their full width H (which need not be a
power of two), read and written in chunks of C, the largest power of two dividing H capped at 1024 (every load of a
Triton program is a power of two long). Pass 1 adds each chunk, stores it into s and sums its squares in fp32; the
chunks stay in registers. Pass 2 scales them by 1/rms (`gdn.rms_apply`, the reference's own elementwise half) and
stores h.

Lowering: Pallas' Triton lowering; elementwise work and one fp32 sum a row, no products.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hyspec_jax import gdn

F32 = jnp.float32
REFERENCE = "hyspec_jax.gdn.add_rms_norm"
MIN_CHUNK, MAX_CHUNK = 16, 1024


def chunk(hidden: int) -> int:
    """The chunk a program reads its row in: the largest power of two dividing `hidden`, at most MAX_CHUNK."""
    return min(hidden & -hidden, MAX_CHUNK) if hidden > 0 else 0


def supported(hidden: int) -> bool:
    """Row widths the kernel takes: a power-of-two chunk of at least MIN_CHUNK divides the row (H % 16 == 0)."""
    return hidden > 0 and chunk(hidden) >= MIN_CHUNK


def _add_norm_kernel(x_ref, y_ref, w_ref, s_ref, h_ref, *, eps: float, zero_centred: bool, block: int):
    hidden = x_ref.shape[-1]
    parts = [pl.ds(c * block, block) for c in range(hidden // block)]
    sums, total = [], jnp.zeros((), F32)
    for at in parts:                                   # pass 1: the residual stream and its sum of squares
        s = x_ref[at] + y_ref[at]
        s_ref[at] = s
        sf = s.astype(F32)
        total = total + jnp.sum(sf * sf)
        sums.append(s)
    inv = gdn.inverse_rms(total / hidden, eps)
    for at, s in zip(parts, sums):                     # pass 2: the norm, chunk by chunk
        h_ref[at] = gdn.rms_apply(s, inv, w_ref[at], zero_centred=zero_centred).astype(h_ref.dtype)


def add_rms_norm_pallas(x: jax.Array, y: jax.Array, weight: jax.Array, *, eps: float, zero_centred: bool,
                        num_warps: int = 4, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Kernel entry, `gdn.add_rms_norm`'s contract on rows: x, y [R, H] of one dtype, weight [H] → (s [R, H] in x's
    dtype, h [R, H] in `gdn.rms_apply`'s dtype)."""
    if x.ndim != 2 or y.shape != x.shape or y.dtype != x.dtype or weight.shape != (x.shape[1],) \
            or not supported(x.shape[1]):
        raise ValueError(f"unsupported add + RMSNorm: x {x.shape} {x.dtype}, y {y.shape} {y.dtype}, weight "
                         f"{weight.shape} (rows [R, H] of one dtype, H a multiple of {MIN_CHUNK})")
    return _add_rms_norm(x, y, weight, eps=float(eps), zero_centred=bool(zero_centred), num_warps=num_warps,
                         interpret=interpret)


@functools.partial(jax.jit, static_argnames=("eps", "zero_centred", "num_warps", "interpret"))
def _add_rms_norm(x, y, weight, *, eps: float, zero_centred: bool, num_warps: int, interpret: bool):
    R, H = x.shape
    h_dtype = jax.eval_shape(functools.partial(gdn.rms_apply, zero_centred=zero_centred),
                             jax.ShapeDtypeStruct((H,), x.dtype), jax.ShapeDtypeStruct((), F32), weight).dtype
    row = pl.BlockSpec((None, H), lambda r: (r, 0))
    return pl.pallas_call(
        functools.partial(_add_norm_kernel, eps=eps, zero_centred=zero_centred, block=chunk(H)),
        out_shape=[jax.ShapeDtypeStruct((R, H), x.dtype), jax.ShapeDtypeStruct((R, H), h_dtype)],
        grid=(R,),
        in_specs=[row, row, pl.BlockSpec((H,), lambda r: (0,))],
        out_specs=[row, row],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="add_rms_norm",
    )(x, y, weight)
