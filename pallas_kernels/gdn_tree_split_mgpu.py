"""The value pass of the split tree solve (`gdn_tree_solve`, method "split_mgpu") as a Mosaic GPU kernel (TMA loads,
Hopper wgmma): `tree_apply_mgpu`.

Same contract as `gdn_tree_solve._tree_apply_kernel` (what it must equal: `hyspec_jax.gdn.masked_solve`, through
`gdn_tree_solve.tree_solve_pallas` with method "split_mgpu"): per (request b, value head h, value tile t of width bv)

    K S0, Q S0                      (S0 = S0[b,h,:,t], [dk, bv] fp32; k, q the key head's [N, dk])
    R  = β ⊙ (v − e^Γ ⊙ K S0)       (row scalings)
    [V'; C V'] = [M; C M] R         (M = (I+L)⁻¹ and C M from the Triton operator pass, as a bf16 pair)
    o  = e^Γ ⊙ Q S0 + C V'

Why the operands are split into bf16 pairs: wgmma takes fp32 (tf32) operands only K-major ("only f16 WGMMA
supports transposes"), and the state tile S0 [dk, bv] and R [N, bv] are B operands stored N-major. bf16 operands
may be either. So S0 = S0_hi + S0_lo and R = R_hi + R_lo (each half bf16, the pair holding 16 of fp32's 24
significand bits), and the operator pass writes [M; C M] as such a pair too. k and q are bf16 already, so
K S0 = k S0_hi + k S0_lo is two bf16 products, and [M; C M] R = MC_hi R_hi + MC_lo R_hi + MC_hi R_lo is three (the
lo·lo term is below fp32 rounding of the sum's scale: ~2⁻¹⁶ relative).

Shape limits (`supported`): N = 64 (wgmma's M is a multiple of 64), bf16 q/k, dk a multiple of 64, bv in 16, 32,
64; compute capability 9.0. The dispatcher fails closed to the Triton split form elsewhere. For bv < 64 the state
pair and R have rows of fewer than 128 bytes, so a narrower swizzle, and wgmma's A operands take the same one.

Shared memory per program (N 64, dk 128, bv 64): the fp32 state tile and its bf16 pair share one region, and R's
pair reuses the state pair's first N rows; the [M; C M] pair lands where k and q were, once the state products have
read them; o and V' are staged where [M; C M] was and leave by TMA. 74 KiB and 150 registers: three programs per
SM. docs/kernels.md has the measurements of this layout and of the forms measured against it.
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
BLOCK_VS = (16, 32, 64)
PROFILE_RANGES = 16      # named-scope ranges per program `tree_apply_mgpu(profile_dir=...)` has room for (it uses 10)


def supported(N: int, dk: int, dv: int, block_v: int, qk_dtype) -> bool:
    return (N == NODES and dk % 64 == 0 and dk <= 256 and block_v in BLOCK_VS and dv % block_v == 0
            and jnp.dtype(qk_dtype) == jnp.dtype(BF16))


def split_bf16(x: jax.Array, dtype=BF16) -> tuple[jax.Array, jax.Array]:
    """x ≈ hi + lo with hi = bf16(x), lo = bf16(x − hi): 16 significand bits in two bf16 halves."""
    hi = x.astype(dtype)
    return hi, (x - hi.astype(F32)).astype(dtype)


def _check_value_pass(name: str, q, k, v, block_v: int) -> None:
    B, N, HK, dk = q.shape
    HV, dv = v.shape[2], v.shape[3]
    if not supported(N, dk, dv, block_v, q.dtype) or HV % HK or k.dtype != q.dtype:
        raise ValueError(f"{name}: unsupported N={N} dk={dk} dv={dv} block_v={block_v} HV={HV} HK={HK} "
                         f"q/k {q.dtype}/{k.dtype} (needs N={NODES}, bf16 q/k, dk % 64 == 0, block_v in {BLOCK_VS})")


def _split_state(s0f_s, s0hi_s, s0lo_s) -> None:
    """The fp32 state tile into its bf16 pair in shared memory (over the tile itself), visible to wgmma."""
    s0 = s0f_s[...]
    plgpu.commit_smem()                                 # every thread has read the fp32 tile before it is overwritten
    s0_hi, s0_lo = split_bf16(s0)
    s0hi_s[...] = s0_hi
    s0lo_s[...] = s0_lo
    plgpu.commit_smem()                                 # visible to the async proxy (wgmma)


def _store_r_pair(beta, v_s, decay, ks, s0hi_s, s0lo_s):
    """R = β ⊙ (v − e^Γ ⊙ K S0) as a bf16 pair on the state pair's first N rows (the state pair is read by then);
    returns those two refs, wgmma's B operand for the products with R."""
    N = ks.shape[0]
    v = plgpu.load(v_s, layout=plgpu.Layout.WGMMA).astype(F32)
    R_hi, R_lo = split_bf16(beta * (v - decay * ks), s0hi_s.dtype)
    rhi_s, rlo_s = s0hi_s.at[pl.ds(0, N)], s0lo_s.at[pl.ds(0, N)]
    rhi_s[...] = R_hi
    rlo_s[...] = R_lo
    return rhi_s, rlo_s


def _smem_transforms(dtype, cols: int, max_swizzle: int = 128):
    """Tiling + swizzle for a row-major [rows, cols] shared-memory tile (the widest swizzle one row fills, at most
    max_swizzle bytes)."""
    size = jnp.dtype(dtype).itemsize
    swizzle = min(max_swizzle, cols * size)
    return plgpu.TilingTransform((8, swizzle // size)), plgpu.SwizzleTransform(swizzle)


def _pair_wgmma(a_pair, b_pair, shape):
    """A B ≈ A_hi B_hi + A_lo B_hi + A_hi B_lo from two bf16 pairs in shared memory (the lo·lo term is below the
    sum's fp32 rounding), accumulated in fp32 registers."""
    (a_hi, a_lo), (b_hi, b_lo) = a_pair, b_pair

    def products(acc):
        plgpu.wgmma(acc, a_hi, b_hi)
        plgpu.wgmma(acc, a_lo, b_hi)
        plgpu.wgmma(acc, a_hi, b_lo)
        plgpu.wgmma_wait(0)
        return acc[...]

    return pl.run_scoped(products, plgpu.ACC(shape, F32))


def _apply_kernel(gamma_g, beta_g, mchi_g, mclo_g, k_g, q_g, v_g, s0_g, o_g, vc_g, kq_s, v_s, state_s, gam_s, bet_s,
                  bar_state, bar_rows, bar_mc, *, r: int, bv: int):
    b, h, t = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("t")
    cols = pl.ds(t * bv, bv)
    key_head = lax.div(h, jnp.int32(r))                 # GVA is indexed, never expanded
    s0f_s, (s0hi_s, s0lo_s) = state_s
    (k_s, q_s), mc_s, (vc_s, o_s) = kq_s
    N = k_s.shape[0]
    # Issued at once, on three barriers, so each product starts when its own operands have landed; the [M; C M]
    # pair lands where k and q were, so it is loaded once they are read. The named scopes are the phases
    # `profile_dir` records (a one-time probe read them: bench/recipes/value_pass_phases.py, in git history);
    # without it they are names.
    with jax.named_scope("issue_loads"):
        plgpu.copy_gmem_to_smem(s0_g.at[b, h, :, cols], s0f_s, bar_state)
        plgpu.copy_gmem_to_smem(k_g.at[b, :, key_head, :], k_s, bar_state)
        plgpu.copy_gmem_to_smem(q_g.at[b, :, key_head, :], q_s, bar_state)
        plgpu.copy_gmem_to_smem(v_g.at[b, :, h, cols], v_s, bar_rows)
        plgpu.copy_gmem_to_smem(gamma_g.at[b, h], gam_s, bar_rows)
        plgpu.copy_gmem_to_smem(beta_g.at[b, h], bet_s, bar_rows)

    with jax.named_scope("wait_state"):
        plgpu.barrier_wait(bar_state)
    with jax.named_scope("split_state"):
        _split_state(s0f_s, s0hi_s, s0lo_s)

    def state_products(acc_k, acc_q):
        for acc, x_s in ((acc_k, k_s), (acc_q, q_s)):
            for s_s in (s0hi_s, s0lo_s):
                plgpu.wgmma(acc, x_s, s_s)
        plgpu.wgmma_wait(0)
        return acc_k[...], acc_q[...]

    with jax.named_scope("state_products"):
        ks, qs = pl.run_scoped(state_products, plgpu.ACC((N, bv), F32), plgpu.ACC((N, bv), F32))
    for src, dst in zip((mchi_g, mclo_g), mc_s):        # k and q are read (wgmma_wait above)
        plgpu.copy_gmem_to_smem(src.at[b, h], dst, bar_mc)

    with jax.named_scope("wait_rows"):
        plgpu.barrier_wait(bar_rows)
    with jax.named_scope("r_pair"):
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        rows = lambda x: lax.broadcast_in_dim(x, (N, bv), [0])                      # noqa: E731
        decay = rows(jnp.exp(plgpu.load(gam_s, layout=row_layout)))
        beta = rows(plgpu.load(bet_s, layout=row_layout))
        rhi_s, rlo_s = _store_r_pair(beta, v_s, decay, ks, s0hi_s, s0lo_s)
        plgpu.commit_smem()

    with jax.named_scope("wait_mc"):
        plgpu.barrier_wait(bar_mc)
    with jax.named_scope("mc_products"):
        out = _pair_wgmma(mc_s, (rhi_s, rlo_s), (2 * N, bv))
        o = (decay * qs + out[N:]).astype(o_g.dtype)
    # Both tiles through shared memory (where [M; C M] was) and out by TMA: whole 128-byte lines, not the
    # 8-byte stores of the WGMMA layout. The barrier: every warp's part of the product has read [M; C M].
    with jax.named_scope("stage_outputs"):
        plgpu.commit_smem()
        vc_s[...] = out[:N]
        o_s[...] = o
        plgpu.commit_smem()
    with jax.named_scope("store_outputs"):
        plgpu.copy_smem_to_gmem(vc_s, vc_g.at[b, h, :, cols])
        plgpu.copy_smem_to_gmem(o_s, o_g.at[b, :, h, cols])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@functools.partial(jax.jit, static_argnames=("block_v", "out_dtype", "profile_dir", "interpret"))
def tree_apply_mgpu(gamma, beta_hn, mc_hi, mc_lo, k, q, v, S0, *, block_v: int = 64, out_dtype=F32,
                    profile_dir: str = "", interpret: bool = False):
    """gamma, beta_hn [B,HV,N] fp32 (β in head-major layout); mc_hi, mc_lo [B,HV,2N,N] bf16 (the [M; C M] pair);
    k, q [B,N,HK,dk] bf16; v [B,N,HV,dv]; S0 [B,HV,dk,dv] fp32. Returns o [B,N,HV,dv] (out_dtype), V' [B,HV,N,dv].
    profile_dir: Mosaic GPU's profiler writes each call's per-program phase times (the kernel's named scopes)
    there as a trace (a diagnostic: on a GPU only, it adds a timer write at each phase edge)."""
    B, N, HK, dk = q.shape
    HV, dv = v.shape[2], v.shape[3]
    _check_value_pass("tree_apply_mgpu", q, k, v, block_v)
    if profile_dir and interpret:
        raise ValueError("tree_apply_mgpu: profile_dir records on a GPU (Mosaic GPU's profiler), not in interpret mode")
    if mc_hi.dtype != BF16 or mc_lo is None or mc_lo.dtype != BF16:
        raise ValueError("tree_apply_mgpu: [M; C M] comes as a bf16 pair (mc_hi, mc_lo)")
    bv = block_v
    state_pair = tuple(plgpu.SMEM((dk, bv), BF16, transforms=_smem_transforms(BF16, bv)) for _ in range(2))
    state = plgpu.RefUnion(plgpu.SMEM((dk, bv), F32), state_pair)
    # wgmma's A operands (k, q, [M; C M]) take the swizzle of its B operands (the state pair, R: bv columns)
    a_swizzle = min(128, bv * 2)
    kq = tuple(plgpu.SMEM((N, dk), BF16, transforms=_smem_transforms(BF16, dk, a_swizzle)) for _ in range(2))
    mc = tuple(plgpu.SMEM((2 * N, N), BF16, transforms=_smem_transforms(BF16, N, a_swizzle)) for _ in range(2))
    staging = (plgpu.SMEM((N, bv), F32, transforms=_smem_transforms(F32, bv)),                 # V', o tiles
               plgpu.SMEM((N, bv), out_dtype, transforms=_smem_transforms(out_dtype, bv)))
    kernel = plgpu.kernel(
        functools.partial(_apply_kernel, r=HV // HK, bv=bv),
        out_type=[jax.ShapeDtypeStruct((B, N, HV, dv), out_dtype), jax.ShapeDtypeStruct((B, HV, N, dv), F32)],
        grid=(B, HV, dv // bv), grid_names=("b", "h", "t"),
        scratch_types=[
            plgpu.RefUnion(kq, mc, staging),                                           # k, q | [M; C M] | o, V'
            plgpu.SMEM((N, bv), v.dtype, transforms=_smem_transforms(v.dtype, bv)),    # v
            state,
            plgpu.SMEM((N,), F32), plgpu.SMEM((N,), F32),                             # Γ, β
            plgpu.Barrier(num_arrivals=3), plgpu.Barrier(num_arrivals=3), plgpu.Barrier(num_arrivals=2),
        ],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
                                             **(dict(profile_space=PROFILE_RANGES, profile_dir=profile_dir)
                                                if profile_dir else {})),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name="gdn_tree_apply_mgpu",
    )
    return kernel(gamma, beta_hn, mc_hi, mc_lo, k, q, v, S0)
