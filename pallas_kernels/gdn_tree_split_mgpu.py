"""The split tree solve's two passes as Mosaic GPU kernels (TMA loads, Hopper wgmma): the node-wise operator pass
(`tree_operators_mgpu`: [M; C M] per request and value head) and the value pass (`tree_apply_mgpu`).

Operator pass, per (request b, value head h), the same math as `gdn_tree_solve._node_operators` + `_inverse`:
D = A ⊙ e^{Γ_i − Γ_j}, L = strict(A) ⊙ β kkᵀ ⊙ D, C = qkᵀ ⊙ D, M = (I+L)⁻¹ = (I−L)(I+L²)(I+L⁴)… and C M, written as
a bf16 pair. Γ = A g and β come in head-major [B, HV, N] (XLA work before it, `head_major_rows`: a TMA load
needs the node axis contiguous, and g/β arrive node-major). kkᵀ and qkᵀ are plain bf16 products (k, q are bf16); each
N × N product of the chain is a pair product X Y ≈ X_hi Y_hi + X_lo Y_hi + X_hi Y_lo, both pairs stored to
shared memory (wgmma's operands).

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
[M; C M] pair in shared memory), bf16 q/k, dk a multiple of 64, bv in 16, 32, 64. `supported` says so; the
dispatcher fails closed to the Triton form elsewhere. Needs compute capability 9.0 (wgmma). For bv < 64 the state
pair and R have rows of fewer than 128 bytes, so a narrower swizzle, and wgmma's A operands (k, q, [M; C M]) take
the same one (Mosaic GPU's layout inference refuses mismatched ones). Narrow tiles measured slower, so the default
and `method="auto"` stay at 64: at B 8 the value pass took 27.6 µs at bv 32 (86 registers, 55,320 B, four
programs per SM, 1536 programs) and 56.9 µs at bv 16, vs 22.2 µs at bv 64: each program still loads k, q and the
[M; C M] pair whole for a fraction of the work (bench/results/kernels/forms/kernels_value_bv_h200.md, bench/results/kernels/forms/kernel_resources_value_bv_h200.md).

Shared memory per value-pass program (N 64, dk 128, bv 64): k, q 32 KiB, v 8 KiB, the [M; C M] pair 32 KiB, the
fp32 state tile 32 KiB and its bf16 pair 32 KiB. `share_state_smem`: the fp32 tile and its pair share one region (a
warpgroup barrier between reading the one and writing the other), and R's pair reuses the state pair's first N
rows. `share_kq_smem`: the [M; C M] pair lands where k and q were, its load issued once the state products have
read them. Both (the default): 74 KiB, 150 registers, three programs per SM (ncu on the H200,
bench/results/kernels/kernel_resources_mgpu_h200.md); B 8, N 64: 24.6 µs, vs 27.1 without k/q sharing and 33.7 without
either (bench/results/kernels/kernels_split_mgpu_forms_h200.md, bench/results/archive/kernels_split_mgpu_h200.md). `tma_store` (the default): o and V' are staged
where [M; C M] was and leave by TMA, whole 128-byte lines instead of the WGMMA layout's 8-byte stores from registers
(the value pass ran at 62% of L2 throughput, 46% of its tag requests): 23.4 vs 24.7 µs at B 8, 79.3 vs 80.7 at
B 32, 6.2 vs 6.1 at B 1 (bench/results/kernels/forms/kernels_value_store_h200.md). Measured with it and dropped, no gain: programmatic dependent
launch of the value pass (no overlap with the operator pass in the trace, also with the operator pass triggering it
as it starts, under XLA's command buffers; without them the launches overlapped but saved nothing, as three
operator programs per SM leave no room for a value program) and Pallas' automatic shared-memory barriers left out
(−0.2 µs at B 8). Also a head's two value tiles as one cluster multicasting k, q and [M; C M]: half their L2 reads,
but 25.6 vs 23.4 µs at B 8, slower at every batch (bench/results/kernels/forms/kernels_value_pdl_multicast_h200.md). Also measured and dropped:
one program of two warpgroups per (request, value head), one per value tile, sharing k, q and [M; C M] (half the
L2 reads). It needed ≤ 128 registers a thread for two programs per SM; ptxas gave it 152 and Mosaic GPU has no
register cap, so one program per SM ran: 29.1 vs 23.5 µs at B 8 (bench/results/kernels/forms/kernels_value_two_warpgroups_h200.md). Also
measured and dropped: each program prefetching into L2 (`plgpu.async_prefetch`, one thread, nothing waits on it) the
state and v tiles of the program one wave on, so the second wave's state would come from L2: issued at the start it
delayed the first wave's own loads (value pass 25.4 vs 23.0 µs at B 8 with operator_out "f16"), issued after the
state products it was within noise at B 8 (22.9 vs 23.2) and slower at B 16 and 32
(bench/results/kernels/forms/kernels_value_prefetch_h200.md). Also measured and dropped: a short launch before the operator pass that starts the L2
fetch of every state tile (and v) while the operator pass, bound by its chain rather than HBM, runs: the value pass
was no faster at any batch (B 8: 23.3 vs 23.0 µs with operator_out "f16") and the launch cost 4.2 µs at B 8, 11.5 at
B 32 (bench/results/kernels/forms/kernels_l2_prefetch_h200.md); with its state already in L2 the value pass is no faster either (B 4: 13.1 vs
11.5 µs; bench/results/kernels/forms/value_pass_l2_probe_h200.md): it is not bound by fetching the state. Also measured and dropped: the fp16
[M; C M] load issued once the K S0 products have read k (it lands where k was), within noise (B 8: 32.8 / 33.1 vs
32.9 / 33.0 µs in all; bench/results/kernels/forms/kernels_early_mc_h200.md). Under Nsight Compute no unit is near its peak at B 8 (DRAM 39%,
L2 61%, shared memory 44%, tensor pipe 31%, issue 23%; bench/results/kernels/forms/kernel_resources_value_pass_ncu_h200.md): the pass is bound by
each program's chain of latencies with three programs per SM, the most its shared memory allows. Its phases, from
Mosaic GPU's profiler (`profile_dir`; bench/recipes/value_pass_phases.py, bench/results/kernels/forms/value_pass_phases_h200.md), at B 8 with
operator_out "f16": of a program's 8.5 µs, 3.1 wait for the state tile, k and q, 1.1 split the state, 0.65 + 0.34
are the products; every phase is about twice as long with three programs per SM as alone (B 4 vs B 1), the three
sharing the SM's shared memory, TMA unit and L2 link phase by phase. Also measured and dropped on that reading: the
state tile, k and q in two chunks of 64 key rows, the first split and multiplied while the second lands (the wait
fell to 1.9 + 0.2 µs, but twelve TMA copies issue slower than six: 23.5 vs 22.9 µs at B 8, slower at every batch;
bench/results/kernels/forms/kernels_chunked_state_h200.md), and one program per key head with a warpgroup per value head, loading k and q
once for the three (200 KiB, one program per SM: 25.8 vs 23.0 µs at B 8, 9.8 vs 6.2 at B 1, where the 96 heads
ran on 32 SMs; bench/results/kernels/forms/kernels_group_heads_h200.md). Also measured and dropped: persistent programs, each looping over
several items with the next item's loads issued during this one. Any program running more than one item got 184–238
registers (152 for one; three per SM need ≤ 168), so two programs per SM ran: B 8 36.4–43.3 vs 32.8 µs in all with
operator_out "f16", slower at every batch ≥ 8. The per-item form's SMs end within 2.2 µs of each other (B 8: 20.8
to 23.0 µs), so better packing had little to win (bench/results/kernels/forms/kernels_value_persistent_h200.md). Also measured and dropped: the
value pass transposed, every product with the value tile's columns as its rows so that wgmma takes S0ᵀ's and Rᵀ's
pairs as A operands from registers ((K S0)ᵀ = S0ᵀ Kᵀ, V'ᵀ = Rᵀ Mᵀ; no state pair or R pair in shared memory). Correct
on the H200 (5–8e-8 from this pass), but 170–191 registers, so two programs per SM: B 8 24.2–26.9 vs 22.5 µs, slower
at every batch ≥ 8; and alone (B 1) only 4.80 vs 4.96 µs, so the round trips it removes were not where the time goes
(code d86e76a, bench/results/kernels/forms/kernels_transposed_halves_h200.md, bench/results/kernels/forms/value_pass_transposed_probe_h200.json).

The Mosaic GPU operator pass (85 KiB, 230 registers, two programs per SM) is ~40x more accurate than the Triton
one (o error 4.6e-6 vs 2.0e-4 against the fp32 reference) but slower on the H200 (B 8: 25.5 µs + 3.9 µs of XLA
for Γ and β, vs 15.3 µs): each of its chained N × N products is a round trip through shared memory and a
barrier, and its 384 programs at B 8 take 1.45 waves. So `tree_solve_pallas` uses the Triton operator pass with
this value pass unless told otherwise (operator_pass="mgpu"). The Triton pass can form M and C M by bf16-pair
products too (`operator_chain="pair"`: o error 4.6e-6, 18.8 vs 14.8 µs at B 8, its 183 registers leave room for two
programs per SM; bench/results/kernels/forms/kernels_operator_chain_h200.md). Those were against its chain in one-pass tf32;
its default chain is now fp16 (`gdn_tree_solve._f16_dot`: the same roundings, 11.7 vs 14.9 µs at B 8, 158 registers
and 32 KiB; bench/results/kernels/forms/kernels_operator_f16_h200.md).

`operator_out="f16"` (`gdn_tree_solve.tree_solve_pallas`): the Triton operator pass writes [M; C M] as one fp16
matrix (11 significand bits, those of the fp16 chain that formed it) instead of the bf16 pair, and this value pass
forms R as an fp16 pair: half the bytes of [M; C M] and two products instead of three. Faster at every batch
measured — B 8: 33.0 vs 34.3 µs; B 16: 57.6 vs 63.7; B 32: 105.1 vs 117.5; chain of 64: 39.3 vs 41.2 — with o error
2.3e-4 vs 1.9e-4 (bench/results/kernels/forms/kernels_operator_out_f16_h200.md), and at B 1 too: 11.6 vs 12.5 µs
(bench/results/kernels/forms/kernels_value_state_h200.md). Not the default: R's fp16 pair overflows where |R| passes 65504 (bf16's range is
fp32's), which bounded GDN states do not reach but nothing here checks.

`value_state="f16"` (with operator_out "f16"): the state tile becomes one fp16 matrix (R's fp16 view of its bytes)
against fp16 q, k that the Triton operator pass writes once per key head: one product each for K S0 and Q S0, 122
registers instead of 152. Measured slower in all (B 8: 34.5 vs 33.2 µs): the value pass gains only 0.7 µs (it is
bound by its loads and stores, not its products), the operator pass's q, k copies cost 2.0 µs
(bench/results/kernels/forms/kernels_value_state_h200.md). An option.

The value pass that builds C (`tree_apply_cv_mgpu`, `build_c=True` in `gdn_tree_solve.tree_solve_pallas`): the
Triton operator pass sends M's pair alone (half the bytes, no C M product: 12.7 vs 15.3 µs at B 8), and each value
program forms C = q kᵀ ⊙ D from the q and k it loads anyway (one bf16 product, exact) and 64 ancestor bits per node,
then o = e^Γ Q S0 + C V' (V' as a bf16 pair). That is 40x more accurate than the default (o error 4.9e-6 vs 1.9e-4:
no tf32 product is left on o's path) but not faster: its value pass does a product more and a second round trip
through shared memory, 30.7 vs 24.7 µs at B 8, so 43.4 vs 40.2 µs in all (B 32: 130.7 vs 131.7; B 16: 73.8 vs 72.5;
bench/results/kernels/forms/kernels_cv_confirm_h200.md, bench/results/kernels/forms/kernels_cvp_h200.md). 167 registers and 75800 B, three programs per SM
(bench/results/kernels/forms/kernel_resources_cv_h200.md). Every Mosaic GPU shared-memory allocation is rounded up to 1 KiB: with Γ, β and the bits
as five small refs the kernel took 78.9 KB, two programs per SM, 30.5 µs (bench/results/kernels/forms/kernels_split_mgpu_cv_2sm_h200.md), hence
`node_rows`. Its persistent option (`programs`: two per SM loop over the items, the next state tile streaming in
during this one) measured no better — 42.1 µs at B 8, 134.0 at B 32 — with 255 registers and k, q, v still loaded
after each item (bench/results/kernels/forms/kernel_resources_cvp_h200.md). Both stay options; the default is unchanged.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from hyspec_jax import gdn

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
NODES = 64
BLOCK_VS = (16, 32, 64)
PROFILE_RANGES = 16      # named-scope ranges per program `tree_apply_mgpu(profile_dir=...)` has room for (it uses 10)


def supported(N: int, dk: int, dv: int, block_v: int, qk_dtype) -> bool:
    return (N == NODES and dk % 64 == 0 and dk <= 256 and block_v in BLOCK_VS and dv % block_v == 0
            and jnp.dtype(qk_dtype) == jnp.dtype(BF16))


def split_bf16(x: jax.Array, dtype=BF16) -> tuple[jax.Array, jax.Array]:
    """x ≈ hi + lo with hi = bf16(x), lo = bf16(x − hi): 16 significand bits in two bf16 halves (dtype fp16: 22
    bits over fp16's narrower range)."""
    hi = x.astype(dtype)
    return hi, (x - hi.astype(F32)).astype(dtype)


def ancestor_bits(A: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The ancestor mask A [..., N, N] (0/1, N ≤ 64) as two int32 bit sets per row (lo, hi [..., N]): bit j of lo is
    A[i, j], of hi A[i, 32 + j]. Written by the operator pass (plain jnp: any lowering), so the value pass rebuilds A
    (`ancestors_from_bits`) from 512 bytes instead of holding the 16 KiB fp32 mask in its shared memory."""
    cols = lax.broadcasted_iota(jnp.int32, A.shape, A.ndim - 1)
    bit = jnp.where(A > 0, lax.shift_left(jnp.ones_like(cols), cols & 31), 0)    # 1 << 31 wraps: the sign bit
    return jnp.sum(jnp.where(cols < 32, bit, 0), axis=-1), jnp.sum(jnp.where(cols >= 32, bit, 0), axis=-1)


def node_rows(gamma: jax.Array, beta: jax.Array, A: jax.Array) -> tuple[jax.Array, ...]:
    """The four rows Γ, β, ancestor bits lo, hi (the bits bitcast to fp32) of the [4, N] block `tree_apply_cv_mgpu`
    loads per (request, value head): Γ, β [N]; A [N, N]. Rows, not one stacked array: the Triton operator pass
    writes them one by one."""
    lo, hi = ancestor_bits(A)
    return gamma, beta, lax.bitcast_convert_type(lo, F32), lax.bitcast_convert_type(hi, F32)


def ancestors_from_bits(lo: jax.Array, hi: jax.Array, cols: jax.Array) -> jax.Array:
    """A[i, j] > 0 from `ancestor_bits`' two words of row i (lo, hi broadcast along the rows) and the column index."""
    word = jnp.where(cols < 32, lo, hi)
    return (lax.shift_right_logical(word, cols & 31) & 1) != 0


def _check_value_pass(name: str, q, k, v, block_v: int, allow_f16: bool = False) -> None:
    B, N, HK, dk = q.shape
    HV, dv = v.shape[2], v.shape[3]
    qk_dtype = BF16 if allow_f16 and q.dtype == F16 else q.dtype      # fp16 q/k: written by the operator pass
    if not supported(N, dk, dv, block_v, qk_dtype) or HV % HK or k.dtype != q.dtype:
        raise ValueError(f"{name}: unsupported N={N} dk={dk} dv={dv} block_v={block_v} HV={HV} HK={HK} "
                         f"q/k {q.dtype}/{k.dtype} (needs N={NODES}, bf16 q/k, dk % 64 == 0, block_v in {BLOCK_VS})")


def _split_state(s0f_s, s0hi_s, s0lo_s, shared: bool) -> None:
    """The fp32 state tile into its bf16 pair in shared memory (shared: over the tile itself), visible to wgmma;
    s0lo_s None: into one matrix of s0hi_s's dtype (fp16: `value_state="f16"`)."""
    s0 = s0f_s[...]
    if shared:
        plgpu.commit_smem()                             # every thread has read the fp32 tile before it is overwritten
    if s0lo_s is None:
        s0hi_s[...] = s0.astype(s0hi_s.dtype)
    else:
        s0_hi, s0_lo = split_bf16(s0)
        s0hi_s[...] = s0_hi
        s0lo_s[...] = s0_lo
    plgpu.commit_smem()                                 # visible to the async proxy (wgmma)


def _store_r_pair(beta, v_s, decay, ks, s0hi_s, s0lo_s):
    """R = β ⊙ (v − e^Γ ⊙ K S0) as a pair of the refs' dtype (bf16, or fp16 against an fp16 [M; C M]) on the state
    pair's first N rows (the state pair is read by then); returns those two refs, wgmma's B operand for the products
    with R."""
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
    sum's fp32 rounding), accumulated in fp32 registers; A_lo None: A is one matrix, A B_hi + A B_lo."""
    (a_hi, a_lo), (b_hi, b_lo) = a_pair, b_pair

    def products(acc):
        plgpu.wgmma(acc, a_hi, b_hi)
        if a_lo is not None:
            plgpu.wgmma(acc, a_lo, b_hi)
        plgpu.wgmma(acc, a_hi, b_lo)
        plgpu.wgmma_wait(0)
        return acc[...]

    return pl.run_scoped(products, plgpu.ACC(shape, F32))


def _iotas(shape):
    rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
    cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
    return rows, cols


def _operator_kernel(mask_g, gamma_g, beta_g, q_g, k_g, mchi_g, mclo_g,
                     k_s, q_s, mask_s, gam_s, gam_col_s, bet_s, xhi_s, xlo_s, yhi_s, ylo_s, bar, *, r: int,
                     rounds: int):
    N = k_s.shape[0]
    b, h = lax.axis_index("b"), lax.axis_index("h")
    key_head = lax.div(h, jnp.int32(r))
    plgpu.copy_gmem_to_smem(k_g.at[b, :, key_head, :], k_s, bar)
    plgpu.copy_gmem_to_smem(q_g.at[b, :, key_head, :], q_s, bar)
    plgpu.copy_gmem_to_smem(mask_g.at[b], mask_s, bar)
    plgpu.copy_gmem_to_smem(gamma_g.at[b, h], gam_s, bar)
    plgpu.copy_gmem_to_smem(gamma_g.at[b, h], gam_col_s, bar)   # one ref is loaded in one layout only (row / column)
    plgpu.copy_gmem_to_smem(beta_g.at[b, h], bet_s, bar)
    plgpu.barrier_wait(bar)

    def gram(acc_kk, acc_qk):
        plgpu.wgmma(acc_kk, k_s, k_s.transpose((1, 0)))
        plgpu.wgmma(acc_qk, q_s, k_s.transpose((1, 0)))
        plgpu.wgmma_wait(0)
        return acc_kk[...], acc_qk[...]

    kk, qk = pl.run_scoped(gram, plgpu.ACC((N, N), F32), plgpu.ACC((N, N), F32))
    A = plgpu.load(mask_s, layout=plgpu.Layout.WGMMA)
    on = A > 0
    gamma_i = lax.broadcast_in_dim(plgpu.load(gam_s, layout=plgpu.Layout.WGMMA.reduce(1)), (N, N), [0])
    gamma_j = lax.broadcast_in_dim(plgpu.load(gam_col_s, layout=plgpu.Layout.WGMMA.reduce(0)), (N, N), [1])
    beta_i = lax.broadcast_in_dim(plgpu.load(bet_s, layout=plgpu.Layout.WGMMA.reduce(1)), (N, N), [0])
    D = gdn.masked_exp(on, gamma_i - gamma_j)
    rows, cols = _iotas((N, N))
    L = jnp.where(on & (rows != cols), beta_i * kk * D, 0.0)
    C = qk * D

    def pair_product(X, Y):
        """X Y ≈ X_hi Y_hi + X_lo Y_hi + X_hi Y_lo, both pairs through shared memory (P P too: one wgmma's two
        operands must be distinct refs). wgmma could take X from registers; Mosaic GPU's interpret mode cannot,
        and the CPU test must run the same code."""
        y_hi, y_lo = split_bf16(Y)
        x_hi, x_lo = (y_hi, y_lo) if X is Y else split_bf16(X)
        yhi_s[...] = y_hi
        ylo_s[...] = y_lo
        xhi_s[...] = x_hi
        xlo_s[...] = x_lo
        plgpu.commit_smem()
        return _pair_wgmma((xhi_s, xlo_s), (yhi_s, ylo_s), (N, N))

    M = gdn.block_inverse(L, rows, cols, rounds, pair_product)
    for row0, X in ((0, M), (N, pair_product(C, M))):
        x_hi, x_lo = split_bf16(X)
        mchi_g.at[b, h, pl.ds(row0, N)][...] = x_hi
        mclo_g.at[b, h, pl.ds(row0, N)][...] = x_lo


@functools.partial(jax.jit, static_argnames=("rounds", "interpret"))
def tree_operators_mgpu(mask, gamma, beta_hn, q, k, *, rounds: int, interpret: bool = False):
    """mask [B,N,N] fp32 0/1; gamma = A g, beta_hn [B,HV,N] fp32; q, k [B,N,HK,dk] bf16. Returns the [M; C M] bf16
    pair [B,HV,2N,N] ×2. rounds: edges on the longest path (M as `gdn.block_inverse` forms it)."""
    B, N, HK, dk = q.shape
    HV = gamma.shape[1]
    if N != NODES or dk % 64 or jnp.dtype(q.dtype) != jnp.dtype(BF16) or k.dtype != q.dtype or HV % HK:
        raise ValueError(f"tree_operators_mgpu: unsupported N={N} dk={dk} q/k {q.dtype}/{k.dtype} HV={HV} HK={HK}")
    pair = jax.ShapeDtypeStruct((B, HV, 2 * N, N), BF16)
    kernel = plgpu.kernel(
        functools.partial(_operator_kernel, r=HV // HK, rounds=rounds),
        out_type=[pair, pair],
        grid=(B, HV), grid_names=("b", "h"),
        scratch_types=[
            plgpu.SMEM((N, dk), BF16, transforms=_smem_transforms(BF16, dk)),          # k
            plgpu.SMEM((N, dk), BF16, transforms=_smem_transforms(BF16, dk)),          # q
            plgpu.SMEM((N, N), F32),                                                   # mask
            plgpu.SMEM((N,), F32), plgpu.SMEM((N,), F32), plgpu.SMEM((N,), F32),     # Γ (row, column), β
            *[plgpu.SMEM((N, N), BF16, transforms=_smem_transforms(BF16, N))           # A and B operand pairs
              for _ in range(4)],
            plgpu.Barrier(num_arrivals=6),
        ],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name="gdn_tree_operators_mgpu",
    )
    return kernel(mask.astype(F32), gamma, beta_hn, q, k)


def head_major_rows(mask, g, beta):
    """Γ = A g (gdn.tree_log_decay) and β in head-major layout [B, HV, N], what both passes load by TMA."""
    return gdn.tree_log_decay(mask, jnp.swapaxes(g, 1, 2)), jnp.swapaxes(beta.astype(F32), 1, 2)


def _apply_kernel(gamma_g, beta_g, *refs, r: int, bv: int, share_state_smem: bool, share_kq_smem: bool,
                  tma_store: bool, mc_pair: bool, state_f16: bool):
    mc_g = refs[:2] if mc_pair else refs[:1]            # [M; C M]: a bf16 pair, or one fp16 matrix
    k_g, q_g, v_g, s0_g, o_g, vc_g, kq_s, v_s, state_s, gam_s, bet_s, bar_state, bar_rows, bar_mc = refs[len(mc_g):]
    b, h, t = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("t")
    cols = pl.ds(t * bv, bv)
    key_head = lax.div(h, jnp.int32(r))                 # GVA is indexed, never expanded
    if share_state_smem:                                # r_view: R's fp16 view of the state pair (fp16 [M; C M])
        s0f_s, (s0hi_s, s0lo_s), *r_view = state_s
    else:
        (s0f_s, s0hi_s, s0lo_s), r_view = state_s, []
    (k_s, q_s), mc_s, *staging = kq_s if share_kq_smem else (kq_s[:2], kq_s[2:2 + len(mc_g)])
    N = k_s.shape[0]
    # Issued at once, on three barriers, so each product starts when its own operands have landed (with
    # share_kq_smem the [M; C M] pair lands where k and q were, so it is loaded once they are read). The named
    # scopes are the phases `profile_dir` records (bench/recipes/value_pass_phases.py); without it they are names.
    with jax.named_scope("issue_loads"):
        plgpu.copy_gmem_to_smem(s0_g.at[b, h, :, cols], s0f_s, bar_state)
        plgpu.copy_gmem_to_smem(k_g.at[b, :, key_head, :], k_s, bar_state)
        plgpu.copy_gmem_to_smem(q_g.at[b, :, key_head, :], q_s, bar_state)
        plgpu.copy_gmem_to_smem(v_g.at[b, :, h, cols], v_s, bar_rows)
        plgpu.copy_gmem_to_smem(gamma_g.at[b, h], gam_s, bar_rows)
        plgpu.copy_gmem_to_smem(beta_g.at[b, h], bet_s, bar_rows)

    def load_mc():
        for src, dst in zip(mc_g, mc_s):
            plgpu.copy_gmem_to_smem(src.at[b, h], dst, bar_mc)

    if not share_kq_smem:
        load_mc()

    with jax.named_scope("wait_state"):
        plgpu.barrier_wait(bar_state)
    # state_f16: S0 as one fp16 matrix (R's fp16 view of the same bytes) against fp16 k, q: one product each
    state_refs = (r_view[0][0], None) if state_f16 else (s0hi_s, s0lo_s)
    with jax.named_scope("split_state"):
        _split_state(s0f_s, *state_refs, share_state_smem)

    def state_products(acc_k, acc_q):
        for acc, x_s in ((acc_k, k_s), (acc_q, q_s)):
            for s_s in state_refs:
                if s_s is not None:
                    plgpu.wgmma(acc, x_s, s_s)
        plgpu.wgmma_wait(0)
        return acc_k[...], acc_q[...]

    with jax.named_scope("state_products"):
        ks, qs = pl.run_scoped(state_products, plgpu.ACC((N, bv), F32), plgpu.ACC((N, bv), F32))
    if share_kq_smem:
        load_mc()                                       # k and q are read (wgmma_wait above)

    with jax.named_scope("wait_rows"):
        plgpu.barrier_wait(bar_rows)
    with jax.named_scope("r_pair"):
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        rows = lambda x: lax.broadcast_in_dim(x, (N, bv), [0])
        decay = rows(jnp.exp(plgpu.load(gam_s, layout=row_layout)))
        beta = rows(plgpu.load(bet_s, layout=row_layout))
        rhi_s, rlo_s = _store_r_pair(beta, v_s, decay, ks, *(r_view[0] if r_view else (s0hi_s, s0lo_s)))
        plgpu.commit_smem()

    with jax.named_scope("wait_mc"):
        plgpu.barrier_wait(bar_mc)
    with jax.named_scope("mc_products"):
        out = _pair_wgmma((mc_s[0], mc_s[1] if mc_pair else None), (rhi_s, rlo_s), (2 * N, bv))
        o = (decay * qs + out[N:]).astype(o_g.dtype)
    if not tma_store:
        vc_g.at[b, h, :, cols][...] = out[:N]
        o_g.at[b, :, h, cols][...] = o
        return
    # Both tiles through shared memory (where [M; C M] was) and out by TMA: whole 128-byte lines, not the
    # 8-byte stores of the WGMMA layout. The barrier: every warp's part of the product has read [M; C M].
    (vc_s, o_s), = staging
    with jax.named_scope("stage_outputs"):
        plgpu.commit_smem()
        vc_s[...] = out[:N]
        o_s[...] = o
        plgpu.commit_smem()
    with jax.named_scope("store_outputs"):
        plgpu.copy_smem_to_gmem(vc_s, vc_g.at[b, h, :, cols])
        plgpu.copy_smem_to_gmem(o_s, o_g.at[b, :, h, cols])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _apply_cv_kernel(gamma_g, rows_g, mhi_g, mlo_g, k_g, q_g, v_g, s0_g, o_g, vc_g,
                     kq_s, v_s, state_s, rows_s, gam_col_s, bar_state, bar_in, bar_m, *, r: int, bv: int,
                     programs: int):
    """The value pass that builds C itself (`build_c`): the operator pass sends only M's pair, and
    o = e^Γ Q S0 + C V' with C = q kᵀ ⊙ D from the q and k this program loads anyway (one more bf16 product) and
    the ancestor bits. Shared memory as the default form's: [C; M] pairs land where k and q were, R's pair (then
    V''s) on the state pair's first N rows; Γ, β and the bits come as one [4, N] block (`node_rows`: every shared
    memory allocation is rounded up to 1 KiB, and one more would leave room for only two programs per SM).

    Work items are (request, value head, value tile) triples; program p takes items p, p + P, p + 2P, … (P =
    programs). With more items than programs the state tile has two slots: the next item's tile streams in while
    this one is computed (its k, q, v and rows load when this item is done: their buffers are reused within it)."""
    HV, nt = gamma_g.shape[1], o_g.shape[3] // bv
    items = gamma_g.shape[0] * HV * nt
    pid = lax.axis_index("p")
    s0f_s, s0p_s = state_s
    slots = s0f_s.shape[0]
    (k_s, q_s), (chi_s, clo_s, mhi_s, mlo_s) = kq_s
    N = k_s.shape[0]

    def coords(i):
        item = pid + i * programs
        return lax.div(item, HV * nt), lax.rem(lax.div(item, nt), HV), lax.rem(item, nt)

    def load_state(i, slot):
        b, h, t = coords(i)
        plgpu.copy_gmem_to_smem(s0_g.at[b, h, :, pl.ds(t * bv, bv)], s0f_s.at[slot], bar_state.at[slot])

    def load_inputs(i):
        b, h, t = coords(i)
        key_head = lax.div(h, jnp.int32(r))             # GVA is indexed, never expanded
        plgpu.copy_gmem_to_smem(k_g.at[b, :, key_head, :], k_s, bar_in)
        plgpu.copy_gmem_to_smem(q_g.at[b, :, key_head, :], q_s, bar_in)
        plgpu.copy_gmem_to_smem(v_g.at[b, :, h, pl.ds(t * bv, bv)], v_s, bar_in)
        plgpu.copy_gmem_to_smem(rows_g.at[b, h], rows_s, bar_in)
        plgpu.copy_gmem_to_smem(gamma_g.at[b, h], gam_col_s, bar_in)   # one ref is loaded in one layout only

    def item(i, slot, last):
        b, h, t = coords(i)
        cols = pl.ds(t * bv, bv)
        if slots == 2:
            @pl.when(jnp.logical_not(last))
            def _():
                load_state(i + 1, 1 - slot)             # its slot was freed by the item before this one
        s0f, s0hi_s, s0lo_s = s0f_s.at[slot], s0p_s.at[slot, 0], s0p_s.at[slot, 1]
        plgpu.barrier_wait(bar_state.at[slot])
        plgpu.barrier_wait(bar_in)
        _split_state(s0f, s0hi_s, s0lo_s, True)

        def first_products(acc_k, acc_q, acc_qk):
            plgpu.wgmma(acc_k, k_s, s0hi_s)
            plgpu.wgmma(acc_k, k_s, s0lo_s)
            plgpu.wgmma(acc_q, q_s, s0hi_s)
            plgpu.wgmma(acc_q, q_s, s0lo_s)
            plgpu.wgmma(acc_qk, q_s, k_s.transpose((1, 0)))
            plgpu.wgmma_wait(0)
            return acc_k[...], acc_q[...], acc_qk[...]

        ks, qs, qk = pl.run_scoped(first_products, plgpu.ACC((N, bv), F32), plgpu.ACC((N, bv), F32),
                                   plgpu.ACC((N, N), F32))
        plgpu.copy_gmem_to_smem(mhi_g.at[b, h], mhi_s, bar_m)      # k and q are read: M's pair lands there
        plgpu.copy_gmem_to_smem(mlo_g.at[b, h], mlo_s, bar_m)

        row_layout = plgpu.Layout.WGMMA.reduce(1)
        rows = lambda x, n: lax.broadcast_in_dim(x, (N, n), [0])                    # noqa: E731
        node_row = lambda i: plgpu.load(rows_s.at[i], layout=row_layout)            # noqa: E731
        decay = rows(jnp.exp(node_row(0)), bv)
        beta = rows(node_row(1), bv)
        rhi_s, rlo_s = _store_r_pair(beta, v_s, decay, ks, s0hi_s, s0lo_s)
        _, node_cols = _iotas((N, N))
        bits = lambda i: rows(lax.bitcast_convert_type(node_row(i), jnp.int32), N)   # noqa: E731
        on = ancestors_from_bits(bits(2), bits(3), node_cols)
        gamma_i = rows(node_row(0), N)
        gamma_j = lax.broadcast_in_dim(plgpu.load(gam_col_s, layout=plgpu.Layout.WGMMA.reduce(0)), (N, N), [1])
        C_hi, C_lo = split_bf16(qk * gdn.masked_exp(on, gamma_i - gamma_j))
        chi_s[...] = C_hi
        clo_s[...] = C_lo
        plgpu.commit_smem()

        plgpu.barrier_wait(bar_m)
        U = _pair_wgmma((mhi_s, mlo_s), (rhi_s, rlo_s), (N, bv))       # V' = M R
        vc_g.at[b, h, :, cols][...] = U
        U_hi, U_lo = split_bf16(U)
        rhi_s[...] = U_hi                               # R is read (the wgmma above has completed)
        rlo_s[...] = U_lo
        plgpu.commit_smem()
        CU = _pair_wgmma((chi_s, clo_s), (rhi_s, rlo_s), (N, bv))
        if slots == 2:
            @pl.when(jnp.logical_not(last))
            def _():
                load_inputs(i + 1)                      # every buffer of this item's is read
        o_g.at[b, :, h, cols][...] = (decay * qs + CU).astype(o_g.dtype)

    load_state(0, 0)
    load_inputs(0)
    if slots == 1:                                      # one item per program
        item(0, 0, True)
        return
    n_items = lax.div(items - pid + programs - 1, programs)

    def body(i, carry):
        item(i, lax.rem(i, 2), i + 1 >= n_items)
        return carry

    lax.fori_loop(0, n_items, body, 0)


def sm_count() -> int | None:
    """Streaming multiprocessors of the first device (None off a GPU)."""
    return getattr(jax.devices()[0], "core_count", None) or None


def value_programs(items: int, per_sm: int = 2) -> int:
    """Programs of the persistent value pass: per_sm per SM (the double-buffered state tile leaves room for two),
    looping over the items; one per item off a GPU or where there are fewer items than that."""
    sms = sm_count()
    return min(items, per_sm * sms) if sms else items


@functools.partial(jax.jit, static_argnames=("block_v", "programs", "out_dtype", "interpret"))
def tree_apply_cv_mgpu(gamma, rows, m_hi, m_lo, k, q, v, S0, *, block_v: int = 64, programs: int | None = None,
                       out_dtype=F32, interpret: bool = False):
    """The value pass that builds C itself (`_apply_cv_kernel`). gamma [B,HV,N] fp32; rows [B,HV,4,N] fp32
    (`node_rows`); m_hi, m_lo [B,HV,N,N] bf16 (M's pair); the rest as `tree_apply_mgpu`. programs: how many
    programs loop over the B·HV·(dv/bv) items (None: one per item; fewer double-buffer the state tile)."""
    B, N, HK, dk = q.shape
    HV, dv = v.shape[2], v.shape[3]
    _check_value_pass("tree_apply_cv_mgpu", q, k, v, block_v)
    bv = block_v
    items = B * HV * (dv // bv)
    programs = items if programs is None else max(1, min(programs, items))
    slots = 1 if programs == items else 2
    state = plgpu.RefUnion(plgpu.SMEM((slots, dk, bv), F32),          # slot s: the same bytes in both views
                           plgpu.SMEM((slots, 2, dk, bv), BF16, transforms=_smem_transforms(BF16, bv)))
    a_swizzle = min(128, bv * 2)                        # wgmma's A operands take its B operands' swizzle
    kq = tuple(plgpu.SMEM((N, dk), BF16, transforms=_smem_transforms(BF16, dk, a_swizzle)) for _ in range(2))
    cm = tuple(plgpu.SMEM((N, N), BF16, transforms=_smem_transforms(BF16, N, a_swizzle)) for _ in range(4))
    kernel = plgpu.kernel(
        functools.partial(_apply_cv_kernel, r=HV // HK, bv=bv, programs=programs),
        out_type=[jax.ShapeDtypeStruct((B, N, HV, dv), out_dtype), jax.ShapeDtypeStruct((B, HV, N, dv), F32)],
        grid=(programs,), grid_names=("p",),
        scratch_types=[
            plgpu.RefUnion(kq, cm),                                                    # k, q | C and M pairs
            plgpu.SMEM((N, bv), v.dtype, transforms=_smem_transforms(v.dtype, bv)),    # v
            state,
            plgpu.SMEM((4, N), F32), plgpu.SMEM((N,), F32),                           # node rows, Γ (column)
            plgpu.Barrier(num_arrivals=1, num_barriers=slots), plgpu.Barrier(num_arrivals=5),
            plgpu.Barrier(num_arrivals=2),
        ],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name="gdn_tree_apply_cv_mgpu",
    )
    return kernel(gamma, rows, m_hi, m_lo, k, q, v, S0)


@functools.partial(jax.jit, static_argnames=("block_v", "share_state_smem", "share_kq_smem", "tma_store",
                                             "out_dtype", "profile_dir", "interpret"))
def tree_apply_mgpu(gamma, beta_hn, mc_hi, mc_lo, k, q, v, S0, *, block_v: int = 64, share_state_smem: bool = True,
                    share_kq_smem: bool = True, tma_store: bool = True, out_dtype=F32, profile_dir: str = "",
                    interpret: bool = False):
    """gamma, beta_hn [B,HV,N] fp32 (β in head-major layout); mc_hi, mc_lo [B,HV,2N,N] bf16 (the [M; C M] pair; or
    mc_hi fp16 [M; C M] and mc_lo None: then R is an fp16 pair, two products instead of three, half the bytes);
    k, q [B,N,HK,dk] bf16; v [B,N,HV,dv]; S0 [B,HV,dk,dv] fp32. Returns o [B,N,HV,dv] (out_dtype), V' [B,HV,N,dv].
    tma_store: o and V' leave through shared memory by TMA (needs share_kq_smem: they are staged where k, q and
    [M; C M] were; share_kq_smem=False stores them from registers). profile_dir: Mosaic GPU's profiler writes
    each call's per-program phase times (the kernel's named scopes) there as a trace (a diagnostic: on a GPU only,
    it adds a timer write at each phase edge)."""
    B, N, HK, dk = q.shape
    HV, dv = v.shape[2], v.shape[3]
    _check_value_pass("tree_apply_mgpu", q, k, v, block_v, allow_f16=True)
    if profile_dir and interpret:
        raise ValueError("tree_apply_mgpu: profile_dir records on a GPU (Mosaic GPU's profiler), not in interpret mode")
    bv = block_v
    state_f32 = plgpu.SMEM((dk, bv), F32)
    state_pair = [plgpu.SMEM((dk, bv), BF16, transforms=_smem_transforms(BF16, bv)) for _ in range(2)]
    mc_pair = mc_lo is not None
    if not mc_pair and not (share_state_smem and mc_hi.dtype == F16):
        raise ValueError("tree_apply_mgpu: an fp16 [M; C M] (mc_lo None) needs share_state_smem (R's fp16 pair is a "
                         f"view of the state pair) and dtype float16; got {mc_hi.dtype}")
    state_f16 = q.dtype == F16
    if state_f16 and mc_pair:
        raise ValueError("tree_apply_mgpu: fp16 q/k (the state tile as one fp16 matrix) need the fp16 [M; C M] "
                         "(mc_lo None): S0's fp16 matrix is a view of the bytes R's fp16 pair uses")
    r_view = [] if mc_pair else [tuple(plgpu.SMEM((dk, bv), F16, transforms=_smem_transforms(F16, bv))
                                       for _ in range(2))]
    state = (plgpu.RefUnion(state_f32, tuple(state_pair), *r_view) if share_state_smem
             else [state_f32, *state_pair])
    # wgmma's A operands (k, q, [M; C M]) take the swizzle of its B operands (the state pair, R: bv columns)
    a_swizzle = min(128, bv * 2)
    kq = [plgpu.SMEM((N, dk), q.dtype, transforms=_smem_transforms(q.dtype, dk, a_swizzle)) for _ in range(2)]
    mc = [plgpu.SMEM((2 * N, N), mc_hi.dtype, transforms=_smem_transforms(mc_hi.dtype, N, a_swizzle))
          for _ in range(2 if mc_pair else 1)]
    tma_store = tma_store and share_kq_smem
    staging = [(plgpu.SMEM((N, bv), F32, transforms=_smem_transforms(F32, bv)),                # V', o tiles
                plgpu.SMEM((N, bv), out_dtype, transforms=_smem_transforms(out_dtype, bv)))] if tma_store else []
    kq_mc = plgpu.RefUnion(tuple(kq), tuple(mc), *staging) if share_kq_smem else [*kq, *mc]
    kernel = plgpu.kernel(
        functools.partial(_apply_kernel, r=HV // HK, bv=bv, share_state_smem=share_state_smem,
                          share_kq_smem=share_kq_smem, tma_store=tma_store, mc_pair=mc_pair,
                          state_f16=state_f16),
        out_type=[jax.ShapeDtypeStruct((B, N, HV, dv), out_dtype), jax.ShapeDtypeStruct((B, HV, N, dv), F32)],
        grid=(B, HV, dv // bv), grid_names=("b", "h", "t"),
        scratch_types=[
            kq_mc,                                                                     # k, q | [M; C M] pair
            plgpu.SMEM((N, bv), v.dtype, transforms=_smem_transforms(v.dtype, bv)),    # v
            state,
            plgpu.SMEM((N,), F32), plgpu.SMEM((N,), F32),                             # Γ, β
            plgpu.Barrier(num_arrivals=3), plgpu.Barrier(num_arrivals=3), plgpu.Barrier(num_arrivals=len(mc)),
        ],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
                                             **(dict(profile_space=PROFILE_RANGES, profile_dir=profile_dir)
                                                if profile_dir else {})),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name="gdn_tree_apply_mgpu",
    )
    return kernel(gamma, beta_hn, *([mc_hi] if mc_lo is None else [mc_hi, mc_lo]), k, q, v, S0)
