"""Top-k children and the log-sum-exp of every beam row of a tree level, one launch (the greedy tree build); and a
whole greedy level of the beam tree in two launches (`tree_level_pallas`).

Must equal `biased_topk_reference`: for logits x = base[b] + bias[b, w] (fp32), (values, indices) of
`lax.top_k(x, k)` — descending, ties to the lower index — and log Σ exp(x) with the row max taken out first.

Why a kernel: at batch 1 a speculative round is launch-bound (bench/results/archive/round_profile_h200.md). Each of the
tree's levels ran the bias add, XLA's TopK custom call and the max / exp-sum / log fusions around it as separate
launches (and the TopK alone took 37 µs of GPU time a level for 16 rows of 8,192); here they are one.

One program per beam row (b, w): the whole row sits in registers (V ≤ 16,384 fp32), the log-sum-exp is one
max and one exp-sum over it, and the top k are k rounds of (max, lowest index at the max, take it out).
Lowering: Pallas' Triton lowering (row reductions only, no matrix work: nothing for Mosaic GPU's wgmma to add).

A level (`tree_level_pallas`, must equal `tree_level_reference`): the same top-k programs read their row of the
draft block's logits in place (no slice), then one program per batch row merges the chunks, scores the children
(ρ = the parent's ρ + log q, capped by the parent's score) and keeps the best `width` of them with their parents
(each child's rank among all W·k at once, one [W·k, W·k] comparison, not `width` dependent picks) —
where XLA ran a slice, a convert, the top-k, a select, a TopK and the gathers: 9 launches a level, 63 of the 339 a
round at 4 rows on an H100 (bench/results/budget/round_launches_h100.md), in a round bound by its launches.
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
MAX_CHILDREN = 256          # a level's W·kp children, ranked all against all: [256, 256] in one program


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


def tree_level_reference(logits: jax.Array, row: int, bias: jax.Array | None, logrho: jax.Array, logscore: jax.Array,
                         *, k: int, width: int):
    """One greedy level of the beam tree (`spec.select.expand_candidates`): the children of the W beam nodes are the
    top k of logits[:, row] + bias (fp32), node (w, i) scored ρ = logrho[w] + log q_i, capped by logscore[w]
    (−inf where the parent or the child is invalid), and the best `width` of the W·k kept (ties: parent-major, then
    rank). A node is valid where its score is > −inf: a valid parent's ρ and score are finite, so are its valid
    children's, and the validity needs no array of its own (nor a launch converting it for the kernel). logits
    [B, L, V], bias [B, W, V] or None (every beam node the same children), logrho / logscore [B, W] f32 → (token
    [B, width] int32, parent [B, width] int32 (its beam row), score, rho [B, width] f32)."""
    B, W = logscore.shape
    valid = logscore > -jnp.inf
    top, child, lse = biased_topk_reference(logits[:, row], bias, k)
    top, child = (jnp.broadcast_to(x, (B, W, k)) for x in (top, child))
    lse = jnp.broadcast_to(lse, (B, W))
    clogq = top - lse[..., None]
    cvalid = valid[..., None] & (top > -jnp.inf) & (clogq > -jnp.inf)
    crho = logrho[..., None] + clogq
    score = jnp.where(cvalid, jnp.minimum(crho, logscore[..., None]), -jnp.inf).reshape(B, W * k)
    order = lax.top_k(score, width)[1]          # stable: ties keep parent-major, draw order
    take = lambda x: jnp.take_along_axis(x.reshape(B, W * k), order, axis=1)  # noqa: E731
    return take(child).astype(jnp.int32), (order // k).astype(jnp.int32), take(score), take(crho)


def _level_kernel(val_ref, idx_ref, lse_ref, rho_ref, cap_ref, tok_out, par_out, score_out, rho_out, *, k: int,
                  width: int):
    """One batch row of a level: its W beam rows' chunk results (chunk-major) → their top k and log-sum-exps →
    the children's scores → the best `width` children (see `tree_level_reference`)."""
    v, ix = val_ref[...], idx_ref[...]                      # [W, C·kp]
    W, n = v.shape
    kp = _pow2(k)
    col = lax.broadcasted_iota(jnp.int32, (W, n), 1)
    lane = lax.broadcasted_iota(jnp.int32, (W, kp), 1)
    top = jnp.full((W, kp), -jnp.inf, F32)
    child = jnp.zeros((W, kp), jnp.int32)
    avail = col >= 0
    for i in range(k):                                      # each beam row's top k of its chunks' top k
        xm = jnp.where(avail, v, -jnp.inf)
        m = jnp.max(xm, axis=1, keepdims=True)
        j = jnp.min(jnp.where(avail & (xm == m), col, n), axis=1, keepdims=True)
        hit = col == j
        top = jnp.where(lane == i, m, top)
        child = jnp.where(lane == i, jnp.sum(jnp.where(hit, ix, 0), axis=1, keepdims=True), child)
        avail = avail & jnp.logical_not(hit)
    parts = lse_ref[...]                                    # [W, C]
    pm = jnp.max(parts, axis=1, keepdims=True)
    lse = pm + jnp.log(jnp.sum(jnp.exp(parts - pm), axis=1, keepdims=True))
    clogq = top - lse
    cap = cap_ref[...]
    cvalid = (cap > -jnp.inf) & (top > -jnp.inf) & (clogq > -jnp.inf) & (lane < k)
    crho = rho_ref[...] + clogq
    score = jnp.where(cvalid, jnp.minimum(crho, cap), -jnp.inf)
    # the best `width` of the W·k children at once, by rank (how many precede each: a higher score, or an equal
    # one earlier in parent-major order; the padding lanes (k < kp) after every child), not by `width` dependent
    # picks of five whole-block reductions each
    n2 = W * kp
    beam = lax.broadcasted_iota(jnp.int32, (W, kp), 0)
    flat = lambda x: x.reshape(n2)  # noqa: E731
    s = flat(score)
    key = flat(jnp.where(lane < k, beam * k + lane, W * k + beam * kp + lane))
    precede = (s[None, :] > s[:, None]) | ((s[None, :] == s[:, None]) & (key[None, :] < key[:, None]))
    rank = jnp.sum(precede.astype(jnp.int32), axis=1)       # [n2], a permutation of 0..n2-1
    hit = rank[None, :] == lax.broadcasted_iota(jnp.int32, (width, n2), 0)
    pick = lambda x: jnp.sum(jnp.where(hit, flat(x)[None, :], 0), axis=1)            # noqa: E731
    pickf = lambda x: jnp.max(jnp.where(hit, flat(x)[None, :], -jnp.inf), axis=1)    # noqa: E731
    tok_out[...], par_out[...], score_out[...], rho_out[...] = pick(child), pick(beam), pickf(score), pickf(crho)


def level_supported(logits_shape: tuple, row: int, bias_shape: tuple | None, W: int, k: int, width: int) -> bool:
    """A level `tree_level_pallas` takes: `supported`, the row inside the logits stack [B, L, V], a bias [B, W, V] or
    none, and beam and kept widths that are powers of two (Triton's block shapes), width ≤ W·k, and at most
    MAX_CHILDREN children (padded to a power of two) to rank all against all in registers."""
    B, L, V = logits_shape
    pow2 = lambda n: n >= 1 and _pow2(n) == n  # noqa: E731
    return (supported(V, k) and 0 <= row < L and (bias_shape is None or tuple(bias_shape) == (B, W, V))
            and pow2(W) and pow2(width) and width <= W * k and W * _pow2(k) <= MAX_CHILDREN)


def _select_warps(children: int) -> int:
    """Warps of a select program: its [children, children] ranking at ≤ 64 elements a thread, at most 8 (on an
    H100, 16 beam rows of 8 children: 24 / 11 / 8.6 / 6.6 µs on 1 / 2 / 4 / 8 warps; 32 rows: 68 / 36 / 23 / 19 µs;
    bench/results/budget/select_rank_h100.md)."""
    return max(1, min(8, children * children // 2048))


def _pow2(n: int) -> int:
    """The least power of two ≥ n (Triton's block shapes)."""
    p = 1
    while p < n:
        p *= 2
    return p


def _chunk_topk(base: jax.Array, base_spec: pl.BlockSpec, bias: jax.Array | None, B: int, W: int, *, k: int,
                chunks: int, num_warps: int | None, interpret: bool):
    """The top-k programs over (batch row, beam row, vocabulary chunk): each chunk's top k (global indices, padded to
    a power of two with −inf) and log-sum-exp → [B, W, chunks · kp], [B, W, chunks · kp], [B, W, chunks]. base_spec
    picks a program's chunk of base logits (a [B, V] array, or a row of a [B, L, V] stack)."""
    kp = _pow2(k)
    Vc = base_spec.block_shape[-1]
    if num_warps is None:
        num_warps = 4 if Vc <= 4096 else 8
    in_specs, args = [base_spec], [base]
    if bias is not None:
        in_specs.append(pl.BlockSpec((None, None, Vc), lambda b, w, c: (b, w, c)))
        args.append(bias)
        kern = functools.partial(_kernel, k=k)
    else:
        kern = functools.partial(lambda base_ref, *outs, k: _kernel(base_ref, None, *outs, k=k), k=k)
    spec = lambda n: pl.BlockSpec((None, None, n), lambda b, w, c: (b, w, c))  # noqa: E731
    return pl.pallas_call(
        kern, out_shape=[jax.ShapeDtypeStruct((B, W, chunks * kp), F32),
                         jax.ShapeDtypeStruct((B, W, chunks * kp), jnp.int32),
                         jax.ShapeDtypeStruct((B, W, chunks), F32)],
        grid=(B, W, chunks), in_specs=in_specs, out_specs=[spec(kp), spec(kp), spec(1)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="tree_level_topk",
    )(*args)


@functools.partial(jax.jit, static_argnames=("row", "k", "width", "chunks", "num_warps", "select_warps",
                                             "interpret"))
def tree_level_pallas(logits: jax.Array, bias: jax.Array | None, logrho: jax.Array, logscore: jax.Array, *,
                      row: int, k: int, width: int, chunks: int = 1,
                      num_warps: int | None = None, select_warps: int | None = None, interpret: bool = False):
    """`tree_level_reference` in two launches (see the module docstring): the top-k programs over (batch row, beam
    row, vocabulary chunk; num_warps each), then one program per batch row (select_warps; default: by its
    children, `_select_warps`)."""
    B, L, V = logits.shape
    W = logscore.shape[1]
    if (not level_supported(logits.shape, row, None if bias is None else bias.shape, W, k, width)
            or chunks < 1 or chunks & (chunks - 1) or V // chunks < 16):
        raise ValueError(f"unsupported tree level: logits {logits.shape} row {row}, bias "
                         f"{None if bias is None else bias.shape}, beam {W}, k {k}, width {width}, chunks {chunks}")
    kp = _pow2(k)
    vals, idxs, lse = _chunk_topk(logits, pl.BlockSpec((None, None, V // chunks), lambda b, w, c: (b, row, c)), bias,
                                  B, W, k=k, chunks=chunks, num_warps=num_warps, interpret=interpret)
    whole = lambda *n: pl.BlockSpec((None,) + n, lambda b: (b,) + (0,) * len(n))  # noqa: E731
    col = lambda x: x.astype(F32)[..., None]  # noqa: E731
    return tuple(pl.pallas_call(
        functools.partial(_level_kernel, k=k, width=width),
        out_shape=[jax.ShapeDtypeStruct((B, width), jnp.int32), jax.ShapeDtypeStruct((B, width), jnp.int32),
                   jax.ShapeDtypeStruct((B, width), F32), jax.ShapeDtypeStruct((B, width), F32)],
        grid=(B,), in_specs=[whole(W, chunks * kp), whole(W, chunks * kp), whole(W, chunks), whole(W, 1),
                             whole(W, 1)],
        out_specs=[whole(width)] * 4,
        compiler_params=pltriton.CompilerParams(num_warps=select_warps or _select_warps(W * kp), num_stages=1),
        interpret=interpret, name="tree_level_select",
    )(vals, idxs, lse, col(logrho), col(logscore)))


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
    kp = _pow2(k)
    vals, idxs, lse = _chunk_topk(base, pl.BlockSpec((None, V // chunks), lambda b, w, c: (b, c)), bias, B, W, k=k,
                                  chunks=chunks, num_warps=num_warps, interpret=interpret)
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
