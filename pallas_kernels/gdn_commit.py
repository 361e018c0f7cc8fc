"""Factorized path commit for every GDN layer in one launch (Bole Algorithm 2, Phase C).

Must equal `hyspec_jax.gdn.node_state` vmapped over the stacked layers:
  S_new[l, b] = e^{Γ_a} S0[l, b] + Σ_j D_aj k_j V'_jᵀ,   a = node[b],  D_aj = A_aj e^{Γ_a − Γ_j}
and S_new[l, b] = S0[l, b] where node[b] < 0 (nothing accepted).

One program per (layer l, request b, value head h, value tile t): reads the accepted node's mask row
and Γ row, the keys [N, dk] of key head h // (HV/HK) and V' [N, bv], and writes
e^{Γ_a} S0 tile + (D_a ⊙ K)ᵀ V' (one [dk × N] · [N × bv] product). The output aliases S0 (in-place
update of the state pool; when the caller does not donate S0, XLA copies it first) and requests with
node < 0 are skipped entirely, so their state is neither read nor written.

Lowering: Pallas' Triton lowering (gdn_tree_solve.py says why not Mosaic GPU; this kernel is purely
memory-bound, so the lowering matters little).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hyspec_jax import gdn
from hyspec_jax.pallas_kernels import tile_dim_ok
from hyspec_jax.pallas_kernels.gdn_tree_solve import Precision, _dot, _f32_precision

F32 = jnp.float32
REFERENCE = "jax.vmap(hyspec_jax.gdn.node_state) over layers"


def _commit_kernel(node_ref, mask_ref, gamma_ref, k_ref, vc_ref, s0_ref, out_ref, *, precision):
    a = node_ref[...]

    @pl.when(a >= 0)
    def _():
        arow = mask_ref[a, :]                               # [N]  ancestors of a (and a)
        gam = gamma_ref[...]                                # [N]
        ga = gamma_ref[a]                                   # Γ_a
        on = arow > 0
        w = gdn.masked_exp(on, ga - gam)                    # D_a·
        kw = k_ref[...].astype(F32) * w[:, None]            # [N, dk]
        upd = _dot(kw, vc_ref[...], precision, trans_a=True)   # [dk, bv]
        out_ref[...] = jnp.exp(ga) * s0_ref[...] + upd


def supported(N: int, dk: int, dv: int, block_v: int) -> bool:
    return (tile_dim_ok(N) and N <= 128 and tile_dim_ok(dk) and dk <= 256 and tile_dim_ok(block_v)
            and dv % block_v == 0)


@functools.partial(jax.jit, static_argnames=("block_v", "precision", "num_warps", "interpret"))
def path_commit_pallas(S0, log_decay, keys, corrected, mask, node, *, block_v: int = 64,
                       precision: Precision = "tf32x3", num_warps: int | None = None, interpret: bool = False):
    """S0 [Lg,B,HV,dk,dv] f32; log_decay Γ [Lg,B,HV,N]; keys [Lg,B,N,HK,dk] (input layout, key heads);
    corrected V' [Lg,B,HV,N,dv]; mask [B,N,N]; node [B] int (−1 = keep S0). Returns S_new like S0."""
    Lg, B, HV, dk, dv = S0.shape
    N, HK = keys.shape[2], keys.shape[3]
    if not supported(N, dk, dv, block_v) or HV % HK:
        raise ValueError(f"unsupported shape N={N} dk={dk} dv={dv} block_v={block_v} HV={HV} HK={HK}")
    r = HV // HK
    nv = dv // block_v
    if num_warps is None:
        num_warps = 4 if block_v * dk <= 128 * 64 else 8
    kern = functools.partial(_commit_kernel, precision=_f32_precision(precision, interpret))
    in_specs = [
        pl.BlockSpec((None,), lambda l, b, h, t: (b,)),                                   # node
        pl.BlockSpec((None, N, N), lambda l, b, h, t: (b, 0, 0)),                         # mask
        pl.BlockSpec((None, None, None, N), lambda l, b, h, t: (l, b, h, 0)),             # Γ
        pl.BlockSpec((None, None, N, None, dk), lambda l, b, h, t: (l, b, 0, h // r, 0)),  # keys
        pl.BlockSpec((None, None, None, N, block_v), lambda l, b, h, t: (l, b, h, 0, t)),  # V'
        pl.BlockSpec((None, None, None, dk, block_v), lambda l, b, h, t: (l, b, h, 0, t)),  # S0
    ]
    out_spec = pl.BlockSpec((None, None, None, dk, block_v), lambda l, b, h, t: (l, b, h, 0, t))
    return pl.pallas_call(
        kern, out_shape=jax.ShapeDtypeStruct(S0.shape, F32), grid=(Lg, B, HV, nv),
        in_specs=in_specs, out_specs=out_spec, input_output_aliases={5: 0},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="gdn_path_commit",
    )(node.astype(jnp.int32), mask.astype(F32), log_decay.astype(F32), keys, corrected.astype(F32),
      S0.astype(F32))


def path_commit_reference(S0, log_decay, keys, corrected, mask, node):
    """The pure-JAX meaning: gdn.node_state per layer (keys in input layout [Lg, B, N, HK, dk], as the factors
    hold them)."""
    from hyspec_jax import gdn
    fac = gdn.SolveFactors(log_decay, keys, corrected)
    return jax.vmap(gdn.node_state, in_axes=(0, 0, None, None))(S0, fac, mask, node)


# ------------------------------------------------------------------------------------------------
# Deferred commit: append the accepted paths' factor rows (gdn.deferred_append) for every layer, one launch
# ------------------------------------------------------------------------------------------------
def _append_kernel(path_ref, length_ref, count_ref, gamma_ref, k_ref, vc_ref, c_in, rc_in, pk_in, pv_in,
                   c_ref, rc_ref, pk_ref, pv_ref, count_out_ref, *, ratio: int, layers: int):
    # The whole path at once: one gather of its rows and one masked scatter. (A loop of ≤ d guarded row copies
    # left each program waiting on 2d dependent loads: 119 vs 79 µs at B 8, bench/results/kernels/deferred_h200.md.)
    # layers > 1: every block has a leading axis of that many layers, copied as one 3-D gather and scatter.
    n = length_ref[...]
    cnt = count_ref[...]
    P = rc_ref.shape[-1]
    dp = path_ref.shape[0]
    i = lax.broadcasted_iota(jnp.int32, (dp,), 0)
    on_path = i < n
    j = jnp.where(on_path, path_ref[...], 0)
    ok = on_path & (cnt + i < P)
    dst = jnp.where(ok, cnt + i, 0)
    lead = () if layers == 1 else (layers,)

    def grid(shape):
        """Index arrays of `shape` (lead + (dp,) + rest): the path axis → (rows j, rows dst), the others their
        iota; and the store mask."""
        ax = len(lead)
        others = [a for a in range(len(shape)) if a != ax]
        on = lambda x: jnp.broadcast_to(jnp.expand_dims(x, others), shape)  # noqa: E731
        iota = [lax.broadcasted_iota(jnp.int32, shape, a) for a in range(len(shape))]
        put = lambda rows: tuple(on(rows) if a == ax else iota[a] for a in range(len(shape)))  # noqa: E731
        return put(j), put(dst), on(ok)

    def copy(src_ref, dst_ref):                          # rows j of src → rows dst of dst, every lead/column
        src, dst_ix, m = grid(lead + (dp, dst_ref.shape[-1]))
        pltriton.store(dst_ref.at[dst_ix], src_ref[src].astype(dst_ref.dtype), mask=m)

    src, dst_ix, m = grid(lead + (dp,))
    gam = gamma_ref[src]                                                             # Γ_j   [lead, dp]
    c = c_in[...]                                                                    # [lead]
    cb = c if layers == 1 else c[:, None]
    pltriton.store(rc_ref.at[dst_ix], cb + gam, mask=m)
    c_ref[...] = c + jnp.sum(jnp.where(jnp.broadcast_to(i == n - 1, gam.shape), gam, 0.0), axis=-1)  # c ← c + Γ_a
    copy(vc_ref, pv_ref)

    @pl.when(pl.program_id(2) % ratio == 0)               # one value head per key head writes the key rows
    def _():
        copy(k_ref, pk_ref)

    @pl.when((pl.program_id(0) == 0) & (pl.program_id(2) == 0))
    def _():
        count_out_ref[...] = jnp.minimum(cnt + n, P)


@functools.partial(jax.jit, static_argnames=("num_warps", "layers_per_program", "interpret"))
def deferred_append_pallas(deferred, log_decay, keys, corrected, path, length, *, num_warps: int = 1,
                           layers_per_program: int = 1, interpret: bool = False):
    """Commit each request's accepted path for every GDN layer by appending its rows to the deferred updates.

    deferred = (c [Lg,B,HV], c_i [Lg,B,HV,P], keys [Lg,B,P,HK,dk], values [Lg,B,HV,P,dv], count [B]) — the
    kernel layout of `gdn.DeferredUpdates` stacked over layers (count shared by the layers); log_decay Γ
    [Lg,B,HV,N], keys [Lg,B,N,HK,dk], corrected V' [Lg,B,HV,N,dv] from the verify; path [B,d] / length [B]
    from `tree.path_to`. One program per (layer, request, value head) copies ≤ d rows as one gather and one
    masked scatter (the path padded to a power of two); nothing of the state itself is read or written.
    layers_per_program > 1 (a power of two dividing Lg): one program per (group of that many layers, request,
    value head), its copies one gather and one scatter over all of them — fewer, larger programs. The four
    update arrays are updated in place when donated; returns them and the new count.
    """
    c, rc, pk, pv, count = deferred
    Lg, B, HV, P = rc.shape
    N, HK, dk = keys.shape[2], keys.shape[3], keys.shape[4]
    dv = corrected.shape[-1]
    d = path.shape[1]
    if not (tile_dim_ok(P) and tile_dim_ok(N) and tile_dim_ok(dk) and tile_dim_ok(dv)) or HV % HK:
        raise ValueError(f"unsupported shape P={P} N={N} dk={dk} dv={dv} HV={HV} HK={HK}")
    r = HV // HK
    lb = layers_per_program
    if lb < 1 or Lg % lb or lb & (lb - 1):
        raise ValueError(f"layers_per_program {lb} must be a power of two dividing the {Lg} layers")
    dp = max(2, 1 << (d - 1).bit_length())                  # Triton tensors: a power-of-two path length
    path = jnp.pad(path, ((0, 0), (0, dp - d)))
    kern = functools.partial(_append_kernel, ratio=r, layers=lb)
    per_b = lambda *shape: pl.BlockSpec((None,) + shape, lambda l, b, h: (b,) + (0,) * len(shape))  # noqa: E731
    L = None if lb == 1 else lb                             # the layer block: squeezed, or lb layers
    in_specs = [
        per_b(dp),                                                                        # path
        per_b(),                                                                          # length
        per_b(),                                                                          # count
        pl.BlockSpec((L, None, None, N), lambda l, b, h: (l, b, h, 0)),                   # Γ
        pl.BlockSpec((L, None, N, None, dk), lambda l, b, h: (l, b, 0, h // r, 0)),       # keys
        pl.BlockSpec((L, None, None, N, dv), lambda l, b, h: (l, b, h, 0, 0)),            # V'
    ]
    upd_specs = [
        pl.BlockSpec((L, None, None), lambda l, b, h: (l, b, h)),                         # c
        pl.BlockSpec((L, None, None, P), lambda l, b, h: (l, b, h, 0)),                   # c_i
        pl.BlockSpec((L, None, P, None, dk), lambda l, b, h: (l, b, 0, h // r, 0)),       # key rows
        pl.BlockSpec((L, None, None, P, dv), lambda l, b, h: (l, b, h, 0, 0)),            # value rows
    ]
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (c, rc, pk, pv)]
    out_shape.append(jax.ShapeDtypeStruct((B,), jnp.int32))
    return pl.pallas_call(
        kern, out_shape=out_shape, grid=(Lg // lb, B, HV), in_specs=in_specs + upd_specs,
        out_specs=upd_specs + [per_b()], input_output_aliases={6: 0, 7: 1, 8: 2, 9: 3},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="gdn_deferred_append",
    )(path.astype(jnp.int32), length.astype(jnp.int32), count.astype(jnp.int32), log_decay.astype(F32), keys,
      corrected.astype(F32), c, rc, pk, pv)


def deferred_to_reference(deferred, num_value_heads: int):
    """Kernel layout (stacked layers, key-head key rows) → `gdn.DeferredUpdates` stacked over layers."""
    from hyspec_jax import gdn
    c, rc, pk, pv, count = deferred
    keys = jnp.moveaxis(gdn.value_heads(pk, num_value_heads), 3, 2).astype(F32)       # [Lg, B, HV, P, dk]
    return gdn.DeferredUpdates(c, rc, keys, pv, jnp.broadcast_to(count, c.shape[:2]))


def deferred_append_reference(deferred, log_decay, keys, corrected, path, length):
    """The pure-JAX meaning of `deferred_append_pallas`: gdn.deferred_append per layer, in kernel layout."""
    from hyspec_jax import gdn
    HV, HK = corrected.shape[2], keys.shape[3]
    new = jax.vmap(lambda p, f: gdn.deferred_append(p, f, path, length))(
        deferred_to_reference(deferred, HV),
        gdn.SolveFactors(log_decay.astype(F32), keys, corrected.astype(F32)))
    pk = jnp.moveaxis(new.keys[:, :, ::HV // HK], 2, 3).astype(deferred[2].dtype)       # back to key heads
    return new.log_decay, new.row_decay, pk, new.values, new.count[0]
