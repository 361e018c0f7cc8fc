"""The split tree solve's value pass (pass 2) as a Mosaic GPU kernel: TMA loads and Hopper wgmma.

Same contract as `gdn_tree_solve._tree_apply_kernel` (what it must equal: `hyspec_jax.gdn.masked_solve`, through
`gdn_tree_solve.tree_solve_pallas(method="split_mgpu")`): per (request b, value head h, value tile t of width bv)

    K S0, Q S0                      (S0 = S0[b,h,:,t], [dk, bv] fp32; k, q the key head's [N, dk])
    R  = β ⊙ (v − e^Γ ⊙ K S0)       (row scalings)
    [V'; C V'] = [M; C M] R         (M = (I+L)⁻¹ and C M from the operator pass)
    o  = e^Γ ⊙ Q S0 + C V'

Why the operands are split into bf16 pairs: wgmma takes fp32 (tf32) operands only K-major ("only f16 WGMMA
supports transposes"), and the state tile S0 [dk, bv] and R [N, bv] are B operands stored N-major. bf16 operands
may be either. So S0 = S0_hi + S0_lo and R = R_hi + R_lo (each half bf16, the pair holding 16 of fp32's 24
significand bits), and the operator pass writes [M; C M] as such a pair too. k and q are bf16 already, so
K S0 = k S0_hi + k S0_lo is two bf16 products (the same tensor-core time as one tf32 product), and
[M; C M] R = MC_hi R_hi + MC_lo R_hi + MC_hi R_lo is three (the lo·lo term is below fp32 rounding of the sum's
scale: ~2⁻¹⁶ relative). Both are more accurate than the Triton pass's one-pass tf32 (~2⁻¹¹ per operand).

Shape limits: N = 64 (wgmma's M is a multiple of 64; 128 nodes would need [256, bv] accumulators and 128 KiB of
[M; C M] pair in shared memory), bf16 q/k, dk a multiple of 64, bv = 64. `supported` says so; the dispatcher
fails closed to the Triton form elsewhere. Needs compute capability 9.0 (wgmma).

Shared memory per program (N 64, dk 128, bv 64): k, q 32 KiB, v 8 KiB, the [M; C M] pair 32 KiB, the fp32 state
tile 32 KiB and its bf16 pair 32 KiB. With `share_state_smem` the fp32 tile and its pair share one region (a
warpgroup barrier between reading the one and writing the other), and R's pair reuses the state pair's first N
rows: 104 KiB, two programs per SM instead of one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

F32, BF16 = jnp.float32, jnp.bfloat16
NODES = 64
BLOCK_VS = (64,)


def supported(N: int, dk: int, dv: int, block_v: int, qk_dtype) -> bool:
    return (N == NODES and dk % 64 == 0 and dk <= 256 and block_v in BLOCK_VS and dv % block_v == 0
            and jnp.dtype(qk_dtype) == jnp.dtype(BF16))


def split_bf16(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x ≈ hi + lo with hi = bf16(x), lo = bf16(x − hi): 16 significand bits in two bf16 halves."""
    hi = x.astype(BF16)
    return hi, (x - hi.astype(F32)).astype(BF16)


def _smem_transforms(dtype, cols: int):
    """Tiling + swizzle for a row-major [rows, cols] shared-memory tile (the widest swizzle one row fills)."""
    size = jnp.dtype(dtype).itemsize
    swizzle = min(128, cols * size)
    return plgpu.TilingTransform((8, swizzle // size)), plgpu.SwizzleTransform(swizzle)


def _apply_kernel(gamma_g, beta_g, mchi_g, mclo_g, k_g, q_g, v_g, s0_g, o_g, vc_g,
                  k_s, q_s, v_s, mchi_s, mclo_s, state_s, gam_s, bet_s, bar_state, bar_rows, bar_mc,
                  *, r: int, bv: int, share_state_smem: bool):
    N = k_s.shape[0]
    b, h, t = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("t")
    cols = pl.ds(t * bv, bv)
    key_head = lax.div(h, jnp.int32(r))                 # GVA is indexed, never expanded
    if share_state_smem:
        s0f_s, (s0hi_s, s0lo_s) = state_s
    else:
        s0f_s, s0hi_s, s0lo_s = state_s
    # Everything is issued at once, on three barriers, so each product starts when its own operands have landed.
    plgpu.copy_gmem_to_smem(s0_g.at[b, h, :, cols], s0f_s, bar_state)
    plgpu.copy_gmem_to_smem(k_g.at[b, :, key_head, :], k_s, bar_state)
    plgpu.copy_gmem_to_smem(q_g.at[b, :, key_head, :], q_s, bar_state)
    plgpu.copy_gmem_to_smem(v_g.at[b, :, h, cols], v_s, bar_rows)
    plgpu.copy_gmem_to_smem(gamma_g.at[b, h], gam_s, bar_rows)
    plgpu.copy_gmem_to_smem(beta_g.at[b, h], bet_s, bar_rows)
    plgpu.copy_gmem_to_smem(mchi_g.at[b, h], mchi_s, bar_mc)
    plgpu.copy_gmem_to_smem(mclo_g.at[b, h], mclo_s, bar_mc)

    plgpu.barrier_wait(bar_state)
    s0 = s0f_s[...]
    if share_state_smem:
        plgpu.commit_smem()                             # every thread has read the fp32 tile before it is overwritten
    s0_hi, s0_lo = split_bf16(s0)
    s0hi_s[...] = s0_hi
    s0lo_s[...] = s0_lo
    plgpu.commit_smem()                                 # visible to the async proxy (wgmma)

    def state_products(acc_k, acc_q):
        plgpu.wgmma(acc_k, k_s, s0hi_s)
        plgpu.wgmma(acc_k, k_s, s0lo_s)
        plgpu.wgmma(acc_q, q_s, s0hi_s)
        plgpu.wgmma(acc_q, q_s, s0lo_s)
        plgpu.wgmma_wait(0)
        return acc_k[...], acc_q[...]

    ks, qs = pl.run_scoped(state_products, plgpu.ACC((N, bv), F32), plgpu.ACC((N, bv), F32))

    plgpu.barrier_wait(bar_rows)
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    rows = lambda x: lax.broadcast_in_dim(x, (N, bv), [0])
    decay = rows(jnp.exp(plgpu.load(gam_s, layout=row_layout)))
    beta = rows(plgpu.load(bet_s, layout=row_layout))
    v = plgpu.load(v_s, layout=plgpu.Layout.WGMMA).astype(F32)
    R_hi, R_lo = split_bf16(beta * (v - decay * ks))
    rhi_s, rlo_s = s0hi_s.at[pl.ds(0, N)], s0lo_s.at[pl.ds(0, N)]   # the state pair is no longer read
    rhi_s[...] = R_hi
    rlo_s[...] = R_lo
    plgpu.commit_smem()

    plgpu.barrier_wait(bar_mc)

    def node_product(acc):
        plgpu.wgmma(acc, mchi_s, rhi_s)
        plgpu.wgmma(acc, mclo_s, rhi_s)
        plgpu.wgmma(acc, mchi_s, rlo_s)
        plgpu.wgmma_wait(0)
        return acc[...]

    out = pl.run_scoped(node_product, plgpu.ACC((2 * N, bv), F32))
    vc_g.at[b, h, :, cols][...] = out[:N]
    o_g.at[b, :, h, cols][...] = (decay * qs + out[N:]).astype(o_g.dtype)


@functools.partial(jax.jit, static_argnames=("block_v", "share_state_smem", "out_dtype", "interpret"))
def tree_apply_mgpu(gamma, beta_hn, mc_hi, mc_lo, k, q, v, S0, *, block_v: int = 64, share_state_smem: bool = True,
                    out_dtype=F32, interpret: bool = False):
    """gamma, beta_hn [B,HV,N] fp32 (β in head-major layout); mc_hi, mc_lo [B,HV,2N,N] bf16 (the [M; C M] pair);
    k, q [B,N,HK,dk] bf16; v [B,N,HV,dv]; S0 [B,HV,dk,dv] fp32. Returns o [B,N,HV,dv] (out_dtype), V' [B,HV,N,dv]."""
    B, N, HK, dk = q.shape
    HV, dv = v.shape[2], v.shape[3]
    if not supported(N, dk, dv, block_v, q.dtype) or HV % HK or k.dtype != q.dtype:
        raise ValueError(f"tree_apply_mgpu: unsupported N={N} dk={dk} dv={dv} block_v={block_v} HV={HV} HK={HK} "
                         f"q/k {q.dtype}/{k.dtype} (needs N={NODES}, bf16 q/k, dk % 64 == 0, block_v in {BLOCK_VS})")
    bv = block_v
    state_f32 = plgpu.SMEM((dk, bv), F32)
    state_pair = [plgpu.SMEM((dk, bv), BF16, transforms=_smem_transforms(BF16, bv)) for _ in range(2)]
    state = plgpu.RefUnion(state_f32, tuple(state_pair)) if share_state_smem else [state_f32, *state_pair]
    kernel = plgpu.kernel(
        functools.partial(_apply_kernel, r=HV // HK, bv=bv, share_state_smem=share_state_smem),
        out_type=[jax.ShapeDtypeStruct((B, N, HV, dv), out_dtype), jax.ShapeDtypeStruct((B, HV, N, dv), F32)],
        grid=(B, HV, dv // bv), grid_names=("b", "h", "t"),
        scratch_types=[
            plgpu.SMEM((N, dk), BF16, transforms=_smem_transforms(BF16, dk)),          # k
            plgpu.SMEM((N, dk), BF16, transforms=_smem_transforms(BF16, dk)),          # q
            plgpu.SMEM((N, bv), v.dtype, transforms=_smem_transforms(v.dtype, bv)),    # v
            plgpu.SMEM((2 * N, N), BF16, transforms=_smem_transforms(BF16, N)),        # [M; C M] hi
            plgpu.SMEM((2 * N, N), BF16, transforms=_smem_transforms(BF16, N)),        # [M; C M] lo
            state,
            plgpu.SMEM((N,), F32), plgpu.SMEM((N,), F32),                             # Γ, β
            plgpu.Barrier(num_arrivals=3), plgpu.Barrier(num_arrivals=3), plgpu.Barrier(num_arrivals=2),
        ],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name="gdn_tree_apply_mgpu",
    )
    return kernel(gamma, beta_hn, mc_hi, mc_lo, k, q, v, S0)
