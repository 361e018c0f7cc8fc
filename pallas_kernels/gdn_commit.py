"""Factorized path commit for every GDN layer in one launch (Bole Algorithm 2, Phase C).

Must equal `hyspec_jax.gdn.node_state` vmapped over the stacked layers:
  S_new[l, b] = e^{Γ_a} S0[l, b] + Σ_j D_aj k_j V'_jᵀ,   a = node[b],  D_aj = A_aj e^{Γ_a − Γ_j}
and S_new[l, b] = S0[l, b] where node[b] < 0 (nothing accepted).

One program per (layer l, request b, value head h, value tile t): reads the accepted node's mask row
and Γ row, the keys [N, dk] of key head h // (HV/HK) and V' [N, bv], and writes
e^{Γ_a} S0 tile + (D_a ⊙ K)ᵀ V' (one [dk × N] · [N × bv] product). The output aliases S0 (in-place
update of the state pool; when the caller does not donate S0, XLA copies it first) and requests with
node < 0 are skipped entirely, so their state is neither read nor written.

Lowering: Pallas' Triton lowering (see gdn_tree_solve.py for why not Mosaic GPU in this session; this
kernel is purely memory-bound, so the lowering matters little).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.gdn_tree_solve import Precision, _dot, _f32_precision

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
        w = jnp.where(on, jnp.exp(jnp.where(on, ga - gam, 0.0)), 0.0)   # D_a·
        kw = k_ref[...].astype(F32) * w[:, None]            # [N, dk]
        upd = _dot(kw, vc_ref[...], precision, trans_a=True)   # [dk, bv]
        out_ref[...] = jnp.exp(ga) * s0_ref[...] + upd


def supported(N: int, dk: int, dv: int, block_v: int) -> bool:
    pow2 = lambda x: x >= 16 and (x & (x - 1)) == 0
    return pow2(N) and N <= 128 and pow2(dk) and dk <= 256 and pow2(block_v) and dv % block_v == 0


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
    """The pure-JAX meaning: gdn.node_state per layer (keys in input layout, expanded here)."""
    from hyspec_jax import gdn
    HV, HK = S0.shape[2], keys.shape[3]
    keys_hf = jnp.moveaxis(jnp.repeat(keys, HV // HK, axis=3), 3, 2).astype(F32)     # [Lg,B,HV,N,dk]
    fac = gdn.SolveFactors(log_decay, keys_hf, corrected)
    return jax.vmap(gdn.node_state, in_axes=(0, 0, None, None))(S0, fac, mask, node)
