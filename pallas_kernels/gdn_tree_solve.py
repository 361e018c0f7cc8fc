"""Closed-form GDN tree verification (Bole Algorithm 1, value-tiled) as a Pallas GPU kernel.

Must equal `hyspec_jax.gdn.masked_solve(S0, q, k, v, g, beta, mask, method=..., max_depth=...)`:
returns o [B,N,HV,dv] (fp32 by default) and the commit factors Γ = log_decay [B,HV,N] and
V' = corrected [B,HV,N,dv] (the keys are the inputs themselves).

One program per (request b, value head h, value tile t of width block_v). It loads the committed state
tile S0[b,h,:,t] [dk, bv] and the tree's q/k [N, dk] (key head h // (HV/HK): GVA is indexed, never
expanded), v [N, bv], g/β [N] and the ancestor mask [N, N]; builds Γ = A g, D = A ⊙ e^{Γ_i−Γ_j},
L = strict(A) ⊙ β kkᵀ ⊙ D and C = qkᵀ ⊙ D on chip; solves V' = (I+L)⁻¹ R with R = β(v − e^Γ (K S0))
by `rounds` Neumann rounds (Z ← −L Z, V' += Z) or by repeated squaring ((I−L)(I+L²)(I+L⁴)…, ⌈log₂(d+1)⌉
factors); and writes only o = e^Γ (Q S0) + C V' and V' (and Γ). method "inverse" builds M = (I+L)⁻¹ as an
N × N matrix (the same squaring factors) and C M before the state tile is loaded, so the value tile needs only
V' = M R and o = e^Γ (Q S0) + (C M) R, two independent products; method "split" does that node-wise part in a
first launch per (request, value head) — shared by all value tiles instead of redone in each — and the value
tiles in a second (M and C M pass through HBM: 2·N² fp32 words per head). Nothing per node ever reaches HBM
except those outputs. With deferred updates (the previous rounds' accepted paths, not yet merged: see
`gdn.DeferredUpdates`) the program merges them into its S0 tile first — P extra rows of k and V' against a
dk × bv tile — and can write the merged tile back, so a commit never needs its own pass over the state.

Lowering: this file uses Pallas' Triton lowering (selected by `pltriton.CompilerParams`), although
DESIGN §5 prefers Mosaic GPU, for every form but "split_mgpu". Reason (checked against jax 0.11.2's Mosaic GPU
lowering): Mosaic GPU has no `dot_general` lowering, only `plgpu.wgmma`, which needs M to be a multiple of 64 and,
for fp32 (tf32) operands, both operands K-major with no transposes ("Only f16 WGMMA supports transposes"). The
forms here need products with the node axis as M (N = 16/32 < 64) and fp32 operands stored N-major (the state
S0 [dk, bv] in K S0, Q S0). Method "split_mgpu" (gdn_tree_split_mgpu) is the Mosaic GPU port of the split form
at 64 nodes: bf16 hi/lo pairs stand in for the fp32 operands (bf16 may be N-major), TMA loads everything, and on
the H200 its value pass beats the Triton one at every batch (B 8: 24.6 vs 37.6 µs). The smaller trees and the
one-launch forms stay in Triton, where tl.dot takes any 2-D operand ≥ 16 and handles transposes.
"""

from __future__ import annotations

import functools
from typing import Literal, get_args

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hyspec_jax import gdn
from pallas_kernels import gdn_tree_split_mgpu, tile_dim_ok

F32 = jnp.float32
Method = Literal["neumann", "squaring", "inverse", "split", "split_mgpu"]
METHODS = get_args(Method)
Precision = Literal["tf32", "tf32x3", "ieee"]
# How the Triton operator pass forms M = (I+L)⁻¹ and C M (`_tree_operator_kernel`): one-pass fp16 products (the
# default of split_mgpu, `_f16_dot`), one-pass tf32 (the same roundings, more instructions), or bf16-pair products
# (~40x more accurate, slower: their registers leave room for two programs per SM, not three).
# "f16_parallel": the fp16 products with C M's chain beside M's (`gdn.squaring_factors_with_query`: one level of
# dependent products fewer, two products more), for paths within `gdn.SERIES_BLOCK` nodes (deeper: "f16"'s order).
# 15x more accurate with the pair output (o 1.3e-5 vs 1.9e-4: M and C M keep their leading terms I − L and C in
# fp32) but slower at B ≥ 8 (34.4 → 37.2 µs at B 8), where three operator programs per SM are bound by their work,
# not their chain's depth (bench/results/kernels/forms/kernels_chain_parallel_h200.md). An option.
# Measured and dropped: the fp16 products on the two halves of the nodes (in a topological order the operators are
# lower triangular: three half-size blocks, M21 = −M22 L21 M11, about half the tensor-core work). Triton gave it 255
# registers at 4 warps and at 2, so two programs per SM: B 8 20–21 vs 9.9 µs for the operator pass at 4 warps, 11.3 at
# 2 warps but slower at B 1 and 16 (code d86e76a–8d331a2, bench/results/kernels/forms/kernels_transposed_halves_h200.md). Also the
# chain accumulated in fp16, its tiles fp16: 168 registers (the accumulators are not what holds them), slightly slower
# at every batch (B 8: 33.4 vs 33.1 µs in all; code 62c5c88, the same file).
OperatorChain = Literal["tf32", "pair", "f16", "f16_parallel"]
# The ancestor mask as the Triton operator pass reads it: fp32 (16 KiB per program at N 64) or int8 (4 KiB, the
# default of split_mgpu). Every program of a request reads the same mask, so it is L2 traffic, not HBM, but at the
# start of one wave of three programs per SM: int8 took split_mgpu's operator pass from 11.7 to 10.9 µs at B 8,
# N 64 (21.3 → 20.6 at B 16, 39.5 → 37.9 at B 32, 6.2 both at B 1; bench/results/kernels/forms/kernels_mask_i8_h200.md).
OperatorMask = Literal["f32", "i8"]
# How the Triton operator pass hands [M; C M] to the Mosaic GPU value pass: a bf16 pair (16 significand bits, 32 KiB
# per head at N 64, three products against R's bf16 pair) or one fp16 matrix (11 bits, as the fp16 chain that formed
# it; 16 KiB, two products against R's fp16 pair).
OperatorOut = Literal["pair", "f16"]
# How the Mosaic GPU value pass multiplies the fp32 state tile (with operator_out "f16"): as a bf16 pair against the
# bf16 q, k (16 significand bits, two products each for K S0 and Q S0) or as one fp16 matrix against q, k in fp16,
# which the operator pass writes beside [M; C M] (11 bits, as one-pass tf32; one product each).
ValueState = Literal["pair", "f16"]

REFERENCE = "hyspec_jax.gdn.masked_solve"


def _form_option(name: str, value, choices, default, plain, allowed: bool, refusal: str):
    """One option of a kernel form: None takes `default`; a value outside the Literal `choices` is refused, and so is
    any value but `plain` (what the other forms do) where it is not `allowed` (`refusal`: the error, which says
    what the option needs)."""
    value = default if value is None else value
    if value not in get_args(choices):
        raise ValueError(f"unknown {name} {value!r}")
    if value != plain and not allowed:
        raise ValueError(refusal)
    return value


def series_ok(max_depth: int, n: int) -> bool:
    """Whether method "squaring" may run: at most gdn.SERIES_BLOCK nodes on a path (`gdn.block_inverse`)."""
    return num_rounds(max_depth, n) < gdn.SERIES_BLOCK


def _f32_precision(precision: Precision, interpret: bool):
    """Precision argument for fp32 × fp32 dots inside the kernel."""
    if interpret or precision == "ieee":
        return (lax.Precision.HIGHEST, lax.Precision.HIGHEST)        # IEEE fp32 on GPU; exact on CPU
    if precision == "tf32":
        return (lax.Precision.DEFAULT, lax.Precision.DEFAULT)        # one tf32 tensor-core pass
    if precision == "tf32x3":
        return lax.DotAlgorithmPreset.TF32_TF32_F32_X3               # 3 passes, ~fp32 accurate
    raise ValueError(f"unknown precision {precision!r}")


def _dot(a, b, precision, *, trans_a=False, trans_b=False):
    """a @ b (optionally with either side transposed) with fp32 accumulation."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    if a.dtype == F32 or b.dtype == F32:
        a, b = a.astype(F32), b.astype(F32)
        prec = precision
    else:
        prec = None                                                   # bf16/f16 tensor cores
    return lax.dot_general(a, b, dims, precision=prec, preferred_element_type=F32)


def num_rounds(max_depth: int, n: int) -> int:
    """d = edges on the longest path: the Neumann series has d nonzero terms after the identity."""
    return max(0, min(max_depth, n) - 1)


def _fold_deferred(s0, c_ref, rc_ref, pk_ref, pv_ref, count_ref, precision):
    """e^{c} S_base + Σ_{i<count} e^{c − c_i} k_i v_iᵀ on one [dk, bv] tile (gdn.deferred_fold)."""
    c = c_ref[...]
    rows = lax.broadcasted_iota(jnp.int32, rc_ref.shape, 0)
    used = rows < count_ref[...]
    w = gdn.masked_exp(used, c - rc_ref[...])                                           # [P]
    kw = pk_ref[...].astype(F32) * w[:, None]                                           # [P, dk]
    return jnp.exp(c) * s0 + _dot(kw, pv_ref[...], precision, trans_a=True)


def _decays(on, gamma):
    """D = A ⊙ e^{Γ_i−Γ_j} (on: A > 0)."""
    return gdn.masked_exp(on, gamma[:, None] - gamma[None, :])


def _query_operator(q, k, D, precision):
    """C = qkᵀ ⊙ D."""
    return _dot(q, k, precision, trans_b=True) * D


def _node_operators(mask_ref, g_ref, beta_ref, q, k, precision):
    """Γ = A g, the ancestor-masked L = strict(A) ⊙ β kkᵀ ⊙ D and C = qkᵀ ⊙ D (node by node, no value tile; q None:
    no C)."""
    n = mask_ref.shape[0]
    A = mask_ref[...]                                   # [N, N] 0/1, f32 or int8 (`operator_mask`)
    A = A if A.dtype == F32 else A.astype(F32)
    g = g_ref[...]                                      # [N]
    beta = beta_ref[...]                                # [N]
    on = A > 0
    gamma = jnp.sum(A * g[None, :], axis=1)             # Γ = A g            [N]
    D = _decays(on, gamma)
    row = lax.broadcasted_iota(jnp.int32, (n, n), 0)
    col = lax.broadcasted_iota(jnp.int32, (n, n), 1)
    kk = _dot(k, k, precision, trans_b=True)            # [N, N]
    L = jnp.where(on & (row != col), beta[:, None] * kk * D, 0.0)
    if q is None:                                       # C not wanted (built by the value pass, or later)
        return gamma, beta, L, None
    return gamma, beta, L, _query_operator(q, k, D, precision)


def _inverse(L, rounds: int, precision, dot=None):
    """(I+L)⁻¹ as an explicit N × N matrix: (I−L)(I+L²)(I+L⁴)… (L is nilpotent: L^{d+1} = 0), on diagonal blocks
    joined by doublings past 8 nodes per path (`gdn.block_inverse`, where the series loses its digits). dot: the
    N × N product (default: `_dot` at `precision`)."""
    n = L.shape[0]
    rows, cols = lax.broadcasted_iota(jnp.int32, (n, n), 0), lax.broadcasted_iota(jnp.int32, (n, n), 1)
    return gdn.block_inverse(L, rows, cols, rounds, dot or functools.partial(_dot, precision=precision))


def _pair_dot(a, b):
    """a b ≈ a_hi b_hi + a_lo b_hi + a_hi b_lo from bf16 pairs (gdn_tree_split_mgpu.split_bf16; ~2⁻¹⁶ relative,
    vs one-pass tf32's ~2⁻¹¹): three bf16 tensor-core products. Triton feeds a 16-bit A operand from registers in
    the accumulator's own layout, where an fp32 (tf32) A is rounded element by element on its way in."""
    (a_hi, a_lo), (b_hi, b_lo) = gdn_tree_split_mgpu.split_bf16(a), gdn_tree_split_mgpu.split_bf16(b)
    return _dot(a_hi, b_hi, None) + _dot(a_lo, b_hi, None) + _dot(a_hi, b_lo, None)


def _f16_dot(a, b):
    """a b from fp16 operands, fp32 accumulation: the same 11 significand bits as one-pass tf32 (both round to
    nearest), but Triton converts to fp16 in one instruction per two elements and feeds a 16-bit A operand from
    registers in the accumulator's own layout, where tf32 rounding is emulated per element (add, mask, a NaN test
    and a select) and the A operand is permuted through warp shuffles. fp16's range (6e-8 … 65504) holds the
    operator chain's values under the GDN's own preconditions: l2-normalized keys, β ≤ 2 and decays ≤ 1 give
    |L_ij| ≤ 2, and along a path of 8 nodes every entry of L², L⁴ and M = (I+L)⁻¹ is at most 2·3⁶ = 1458. Longer
    paths are not summed by the series (gdn.block_inverse): its doublings multiply entries of M and L."""
    return _dot(a.astype(jnp.float16), b.astype(jnp.float16), None)


def _apply_inverse(L, R, rounds: int, method: str, precision):
    """V' = (I+L)⁻¹ R against one value tile: Neumann rounds, or the squaring factors applied to R."""
    if rounds == 0:
        return R
    if method == "neumann":      # Horner, U ← R − L U: the sum of the terms (−L)ⁿR themselves loses its digits
        U = R                    # past ~8 nodes per path (gdn.block_inverse says why); these iterates stay bounded
        for _ in range(rounds):
            U = R - _dot(L, U, precision)
        return U
    U = R - _dot(L, R, precision)                       # squaring
    P = L
    for _ in range(gdn.num_squarings(rounds) - 1):
        P = _dot(P, P, precision)
        U = U + _dot(P, U, precision)
    return U


def _tree_solve_kernel(*refs, rounds: int, method: str, precision, deferred: bool, write_state: bool):
    mask_ref, g_ref, beta_ref, q_ref, k_ref, v_ref, s0_ref = refs[:7]
    rest = refs[7:]
    if deferred:
        c_ref, rc_ref, pk_ref, pv_ref, count_ref = rest[:5]
        rest = rest[5:]
    o_ref, gamma_ref, vc_ref = rest[:3]
    q = q_ref[...]                                      # [N, dk] (input dtype)
    k = k_ref[...]
    gamma, beta, L, C = _node_operators(mask_ref, g_ref, beta_ref, q, k, precision)
    if method == "inverse":                             # node-wise work first, before the state tile is live
        M = _inverse(L, rounds, precision)
        CM = _dot(C, M, precision)
    s0 = s0_ref[...]                                    # [dk, bv] f32
    if deferred:                                        # merge the committed-but-deferred path updates
        s0 = _fold_deferred(s0, c_ref, rc_ref, pk_ref, pv_ref, count_ref, precision)
        if write_state:
            rest[3][...] = s0                           # the merged state replaces S_base (aliased)
    ks = _dot(k, s0, precision)                         # [N, bv]
    qs = _dot(q, s0, precision)
    eg = jnp.exp(gamma)
    R = beta[:, None] * (v_ref[...].astype(F32) - eg[:, None] * ks)
    if method == "inverse":                             # V' = M R and C V' = (C M) R: two independent products
        U = _dot(M, R, precision)
        o = eg[:, None] * qs + _dot(CM, R, precision)
    else:
        U = _apply_inverse(L, R, rounds, method, precision)
        o = eg[:, None] * qs + _dot(C, U, precision)
    o_ref[...] = o.astype(o_ref.dtype)
    vc_ref[...] = U
    gamma_ref[...] = gamma                              # every value tile writes the same Γ


def _tree_operator_kernel(mask_ref, g_ref, beta_ref, q_ref, k_ref, gamma_ref, *out_refs, rounds: int, precision,
                          form: str, chain: str = "tf32", r: int = 1):
    """Split form, pass 1 (one program per request and value head): Γ and the node-wise operators to HBM, as
    `_tree_operators_triton`'s form says: "fp32" [M; C M] (one output); "pair" the same as a bf16 pair hi + lo with β
    head-major for the Mosaic GPU value pass (three outputs: hi, lo, β [HV, N]; gdn_tree_split_mgpu says why);
    "f16" [M; C M] as one fp16 matrix with β head-major (two outputs; `OperatorOut`), and with two more output refs
    q and k in fp16 (`ValueState` "f16"; written by the first of each key head's r programs);
    "m_pair" only M's pair and Γ, β and the ancestor bits as one block (three: hi, lo, node rows [4, N];
    gdn_tree_split_mgpu.node_rows) for the value pass that builds C itself. chain (`OperatorChain`): how M and
    C M are formed — one-pass tf32, bf16-pair (`_pair_dot`) or one-pass fp16 products (`_f16_dot`). In form "pair"
    with tf32 or fp16, C is built after M's chain (not live through it; the mask is read again): with tf32 14.8 vs
    15.5 µs at B 8, N 64, 0.7–0.9 µs less at B 16 and 32 too, with the same 163–165 registers
    (bench/results/kernels/forms/kernels_operator_chain_h200.md). The pair chain is faster with C first (18.8 vs 21.1 µs); so is
    form "fp32" kept (its measured order)."""
    n = mask_ref.shape[0]
    parallel = chain == "f16_parallel" and form != "m_pair" and rounds < gdn.SERIES_BLOCK
    c_first = chain == "pair" or form == "fp32" or parallel
    q = None if form == "m_pair" or not c_first else q_ref[...]
    gamma, beta, L, C = _node_operators(mask_ref, g_ref, beta_ref, q, k_ref[...], precision)
    dot = ({"pair": _pair_dot, "f16": _f16_dot, "f16_parallel": _f16_dot}.get(chain)
           or functools.partial(_dot, precision=precision))
    CM = None
    if parallel:                                        # C M's chain beside M's, not after it
        eye = (lax.broadcasted_iota(jnp.int32, (n, n), 0) == lax.broadcasted_iota(jnp.int32, (n, n), 1))
        M, CM = gdn.squaring_factors_with_query(L, C, eye.astype(L.dtype), gdn.num_squarings(rounds), dot)
    else:
        M = _inverse(L, rounds, precision, dot)
    if form == "fp32":
        # The Triton split form's rows of the kernel table were measured with this order (168 registers); ptxas'
        # register count moves with such orders: with C after M's chain and Γ stored before C M this form took 214,
        # and the "pair" form 224 (bench/results/kernels/forms/kernels_operator_chain_h200.md, run 3). So it is kept as measured.
        gamma_ref[...] = gamma
        out_refs[0][pl.ds(0, n), :] = M
        out_refs[0][pl.ds(n, n), :] = dot(C, M) if CM is None else CM
        return
    if form != "m_pair" and not c_first:
        C = _query_operator(q_ref[...], k_ref[...], _decays(mask_ref[...] > 0, gamma), precision)   # mask read again
    if CM is None and C is not None:
        CM = dot(C, M)
    gamma_ref[...] = gamma                              # after C M: 165 registers (before it: 224)
    if form == "f16":
        mc_ref, rows_ref, *qk16_refs = out_refs
        rows_ref[...] = beta                            # β head-major
        mc_ref[pl.ds(0, n), :] = M.astype(jnp.float16)
        mc_ref[pl.ds(n, n), :] = CM.astype(jnp.float16)
        if qk16_refs:                                   # value_state "f16": q, k in fp16, once per key head
            @pl.when(lax.rem(pl.program_id(1), r) == 0)
            def _():
                for dst, src in zip(qk16_refs, (q_ref, k_ref)):
                    dst[...] = src[...].astype(jnp.float16)
        return
    hi_ref, lo_ref, rows_ref = out_refs
    if form == "m_pair":
        hi_ref[...], lo_ref[...] = gdn_tree_split_mgpu.split_bf16(M)
        for i, row in enumerate(gdn_tree_split_mgpu.node_rows(gamma, beta, mask_ref[...])):
            rows_ref[i, :] = row
        return
    rows_ref[...] = beta                                # β head-major
    for rows, X in ((pl.ds(0, n), M), (pl.ds(n, n), CM)):
        hi_ref[rows, :], lo_ref[rows, :] = gdn_tree_split_mgpu.split_bf16(X)


def _tree_apply_kernel(gamma_ref, beta_ref, mc_ref, k_ref, q_ref, v_ref, s0_ref, o_ref, vc_ref, *, precision):
    """Split form, pass 2 (one program per request, value head and value tile): K S0 and Q S0 from the key
    head's own q/k, R = β(v − e^Γ K S0), then one product of 2N rows, [M; C M] R.

    Measured on the H200 (bench/results/kernels/forms/kernels_split_forms_h200.md, B 8, N 64): this beats a [k; q]
    concatenated first for one 2N-row product (51.3 vs 58.8 µs: the concatenation was a 3.4 µs launch and its
    copy), a program per key head over its r value heads (unrolled 57.7, a device loop 50.9 but slower at
    B 1 and N 16), and two pipeline stages (61.8)."""
    n = gamma_ref.shape[0]
    s0 = s0_ref[...]                                                                   # [dk, bv] f32
    ks, qs = _dot(k_ref[...], s0, precision), _dot(q_ref[...], s0, precision)
    eg = jnp.exp(gamma_ref[...])
    R = beta_ref[...][:, None] * (v_ref[...].astype(F32) - eg[:, None] * ks)
    U, CU = lax.split(_dot(mc_ref[...], R, precision), (n, n), axis=0)
    vc_ref[...] = U
    o_ref[...] = (eg[:, None] * qs + CU).astype(o_ref.dtype)


def _tree_operators_triton(q, k, g, beta, mask, *, rounds, precision, form, operator_warps, interpret, chain="tf32",
                           mask_dtype=F32, qk16=False):
    """The split form's Triton operator pass (`_tree_operator_kernel` says what each form writes): form "fp32"
    returns Γ, [M; C M] fp32; "pair" Γ, the [M; C M] bf16 pair, β head-major; "f16" Γ, [M; C M] fp16, β head-major
    (qk16: and q, k in fp16, [B, N, HK, dk]); "m_pair" Γ, M's bf16 pair and the node rows [B, HV, 4, N] (Γ, β,
    ancestor bits)."""
    B, N, HK, dk = q.shape
    HV = g.shape[2]
    r = HV // HK
    rows = N if form == "m_pair" else 2 * N
    mats = 1 if form in ("fp32", "f16") else 2
    mat_dtype = {"fp32": F32, "f16": jnp.float16}.get(form, jnp.bfloat16)
    shapes = [jax.ShapeDtypeStruct((B, HV, rows, N), mat_dtype)] * mats
    specs = [pl.BlockSpec((None, None, rows, N), lambda b, h: (b, h, 0, 0))] * mats
    if form in ("pair", "f16"):                                                     # β head-major
        shapes.append(jax.ShapeDtypeStruct((B, HV, N), F32))
        specs.append(pl.BlockSpec((None, None, N), lambda b, h: (b, h, 0)))
    if form == "m_pair":                                                            # node rows
        shapes.append(jax.ShapeDtypeStruct((B, HV, 4, N), F32))
        specs.append(pl.BlockSpec((None, None, 4, N), lambda b, h: (b, h, 0, 0)))
    if qk16:                                                                        # q, k in fp16 (key heads)
        if form != "f16":
            raise ValueError(f"fp16 q/k come with the operator pass's form 'f16', not {form!r}")
        shapes += [jax.ShapeDtypeStruct(q.shape, jnp.float16)] * 2
        specs += [pl.BlockSpec((None, N, None, dk), lambda b, h: (b, 0, h // r, 0))] * 2
    return pl.pallas_call(
        functools.partial(_tree_operator_kernel, rounds=rounds, precision=precision, form=form, chain=chain, r=r),
        out_shape=[jax.ShapeDtypeStruct((B, HV, N), F32), *shapes],
        grid=(B, HV),
        in_specs=[
            pl.BlockSpec((None, N, N), lambda b, h: (b, 0, 0)),                    # mask
            pl.BlockSpec((None, N, None), lambda b, h: (b, 0, h)),                 # g
            pl.BlockSpec((None, N, None), lambda b, h: (b, 0, h)),                 # beta
            pl.BlockSpec((None, N, None, dk), lambda b, h: (b, 0, h // r, 0)),     # q (key head)
            pl.BlockSpec((None, N, None, dk), lambda b, h: (b, 0, h // r, 0)),     # k (key head)
        ],
        out_specs=[pl.BlockSpec((None, None, N), lambda b, h: (b, h, 0)), *specs],
        compiler_params=pltriton.CompilerParams(num_warps=operator_warps, num_stages=1),
        interpret=interpret, name="gdn_tree_operators",
    )(mask.astype(mask_dtype), g.astype(F32), beta.astype(F32), q, k)


def _tree_solve_split(S0, q, k, v, g, beta, mask, *, rounds, block_v, precision, out_dtype, num_warps, num_stages,
                      operator_warps, interpret, value_pass="triton", operator_pass="triton",
                      share_state_smem=True, share_kq_smem=True, tma_store=True, build_c=False,
                      value_programs=None, operator_chain="tf32", operator_mask="f32", operator_out="pair",
                      value_state="pair"):
    """Two launches: the node-wise operators once per (request, value head) — Γ and [M; C M], 2·N² fp32 words
    per head through HBM — then the value tiles, which hold no N × N chain: three products, K S0, Q S0, [M; C M] R.
    value_pass "mgpu": the second launch is the Mosaic GPU kernel (gdn_tree_split_mgpu), fed the bf16 pair."""
    B, N, HK, dk = q.shape
    HV, dv = v.shape[2], v.shape[3]
    r = HV // HK
    if value_pass == "mgpu" and build_c:             # the operator pass sends M only; the value pass builds C
        gamma, m_hi, m_lo, rows = _tree_operators_triton(
            q, k, g, beta, mask, rounds=rounds, precision=precision, form="m_pair", operator_warps=operator_warps,
            interpret=interpret, chain=operator_chain)
        o, vc = gdn_tree_split_mgpu.tree_apply_cv_mgpu(gamma, rows, m_hi, m_lo, k, q, v, S0.astype(F32),
                                                       block_v=block_v, programs=value_programs, out_dtype=out_dtype,
                                                       interpret=interpret)
        return o, gamma, vc
    if value_pass == "mgpu":
        if operator_pass == "mgpu":                  # both passes in Mosaic GPU
            gamma, beta_hn = gdn_tree_split_mgpu.head_major_rows(mask, g, beta)
            mc_hi, mc_lo = gdn_tree_split_mgpu.tree_operators_mgpu(
                mask, gamma, beta_hn, q, k, rounds=rounds, interpret=interpret)
        else:
            outs = _tree_operators_triton(
                q, k, g, beta, mask, rounds=rounds, precision=precision, form=operator_out,
                operator_warps=operator_warps, interpret=interpret, chain=operator_chain,
                mask_dtype={"f32": F32, "i8": jnp.int8}[operator_mask], qk16=value_state == "f16")
            gamma, mc_hi, mc_lo, beta_hn = outs[:4] if operator_out == "pair" else (outs[0], outs[1], None, outs[2])
            if value_state == "f16":
                q, k = outs[3:5]
        o, vc = gdn_tree_split_mgpu.tree_apply_mgpu(gamma, beta_hn, mc_hi, mc_lo, k, q, v, S0.astype(F32),
                                                    block_v=block_v, share_state_smem=share_state_smem,
                                                    share_kq_smem=share_kq_smem, tma_store=tma_store,
                                                    out_dtype=out_dtype,
                                                    interpret=interpret)
        return o, gamma, vc
    gamma, MC = _tree_operators_triton(q, k, g, beta, mask, rounds=rounds, precision=precision, form="fp32",
                                       operator_warps=operator_warps, interpret=interpret)
    o, vc = pl.pallas_call(
        functools.partial(_tree_apply_kernel, precision=precision),
        out_shape=[jax.ShapeDtypeStruct((B, N, HV, dv), out_dtype), jax.ShapeDtypeStruct((B, HV, N, dv), F32)],
        grid=(B, HV, dv // block_v),
        in_specs=[
            pl.BlockSpec((None, None, N), lambda b, h, t: (b, h, 0)),                   # Γ
            pl.BlockSpec((None, N, None), lambda b, h, t: (b, 0, h)),                   # beta
            pl.BlockSpec((None, None, 2 * N, N), lambda b, h, t: (b, h, 0, 0)),         # [M; C M]
            pl.BlockSpec((None, N, None, dk), lambda b, h, t: (b, 0, h // r, 0)),       # k (key head)
            pl.BlockSpec((None, N, None, dk), lambda b, h, t: (b, 0, h // r, 0)),       # q (key head)
            pl.BlockSpec((None, N, None, block_v), lambda b, h, t: (b, 0, h, t)),       # v
            pl.BlockSpec((None, None, dk, block_v), lambda b, h, t: (b, h, 0, t)),      # S0
        ],
        out_specs=[pl.BlockSpec((None, N, None, block_v), lambda b, h, t: (b, 0, h, t)),
                   pl.BlockSpec((None, None, N, block_v), lambda b, h, t: (b, h, 0, t))],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="gdn_tree_apply",
    )(gamma, beta.astype(F32), MC, k, q, v, S0.astype(F32))
    return o, gamma, vc


# The N × N fp32 products at 128 nodes with fp32-accurate (3-pass or IEEE) dots need more shared memory than the
# H200 has: the embedded fp32 model's 128-node verify failed to launch there ("requested 262144, available:
# 232448"). One-pass tf32 (what bf16/f16 inputs get) launches at 128 nodes
# (bench/recipes/tree_solve_launch_probe.py).
FP32_ACCURATE_MAX_NODES = 64


def supported(N: int, dk: int, dv: int, block_v: int, precision: Precision = "tf32") -> bool:
    return (tile_dim_ok(N) and N <= 128 and tile_dim_ok(dk) and dk <= 256 and tile_dim_ok(block_v)
            and dv % block_v == 0 and (precision == "tf32" or N <= FP32_ACCURATE_MAX_NODES))


@functools.partial(jax.jit, static_argnames=("max_depth", "method", "block_v", "precision", "out_dtype",
                                             "num_warps", "num_stages", "operator_warps", "write_state",
                                             "share_state_smem", "share_kq_smem", "tma_store", "operator_pass",
                                             "build_c", "value_programs", "operator_chain", "operator_mask",
                                             "operator_out", "value_state", "interpret"))
def tree_solve_pallas(S0, q, k, v, g, beta, mask, deferred=None, *, max_depth: int, method: Method = "neumann",
                      block_v: int = 64, precision: Precision = "tf32", out_dtype=F32,
                      num_warps: int | None = None, num_stages: int = 1, operator_warps: int = 4,
                      write_state: bool = False, share_state_smem: bool = True, share_kq_smem: bool = True,
                      tma_store: bool = True, operator_pass: Literal["triton", "mgpu"] = "triton",
                      build_c: bool = False, value_programs: int | None = None,
                      operator_chain: OperatorChain | None = None, operator_mask: OperatorMask | None = None,
                      operator_out: OperatorOut | None = None, value_state: ValueState | None = None,
                      interpret: bool = False):
    """Kernel entry. q, k [B,N,HK,dk] (HK | HV, key head of value head h is h // (HV/HK)); v [B,N,HV,dv];
    g, β [B,N,HV] fp32; S0 [B,HV,dk,dv] fp32; mask [B,N,N]. N must be a power of two in [16, 128]
    (the dispatcher pads with identity nodes). Returns (o [B,N,HV,dv], Γ [B,HV,N], V' [B,HV,N,dv]).

    deferred: the state is S0 plus committed-but-unmerged path updates (`gdn.DeferredUpdates` in kernel
    layout: c [B,HV], c_i [B,HV,P], keys [B,P,HK,dk] (key heads), values [B,HV,P,dv], count [B]; P a power
    of two ≥ 16), merged on chip after the S0 tile is loaded. write_state: also return the merged state
    (fourth output, written over S0 — donate S0 to make it in place); the caller then empties the updates.
    num_warps / num_stages: the value-tile programs'; operator_warps: the split form's operator pass.
    method "split_mgpu": the split form with its value pass in Mosaic GPU (gdn_tree_split_mgpu: N = 64, bf16
    q/k, compute capability 9.0); share_state_smem / share_kq_smem / tma_store are that kernel's options
    (gdn_tree_split_mgpu.tree_apply_mgpu), and
    operator_pass "mgpu" runs the operator pass in Mosaic GPU too (gdn_tree_split_mgpu.tree_operators_mgpu);
    build_c: the operator pass sends M alone and the value pass builds C from q kᵀ (gdn_tree_split_mgpu.
    tree_apply_cv_mgpu), with the Triton operator pass; value_programs: that kernel's program count (None: one
    per item; fewer loop over the items with a double-buffered state tile). operator_chain: how that Triton
    operator pass forms M and C M (`OperatorChain`; "f16", the default with the default value pass: one-pass fp16
    products, `_f16_dot`; "tf32": one-pass tf32, the same roundings with more instructions, the default with
    build_c, whose rows were measured so; "pair": bf16 pairs, ~2⁻¹⁶; "f16_parallel": fp16 products with C M's
    chain beside M's). operator_mask (`OperatorMask`): the dtype in
    which that operator pass (with the default value pass) reads the ancestor mask ("i8" there by default, the
    same outputs bit for bit as "f32"; "f32" elsewhere). operator_out (`OperatorOut`, with the default value pass):
    [M; C M] as a bf16 pair ("pair", the default) or one fp16 matrix ("f16"). value_state (`ValueState`, with
    operator_out "f16"): the state tile as a bf16 pair ("pair", the default) or one fp16 matrix against fp16 q, k
    ("f16").
    """
    B, N, HK, dk = q.shape
    HV, dv = v.shape[2], v.shape[3]
    if not supported(N, dk, dv, block_v, precision) or HV % HK:
        raise ValueError(f"unsupported shape N={N} dk={dk} dv={dv} block_v={block_v} HV={HV} HK={HK} "
                         f"precision={precision}")
    if write_state and deferred is None:
        raise ValueError("write_state needs deferred updates (without them the state is S0 itself)")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}")
    if method == "squaring" and not series_ok(max_depth, N):
        raise ValueError(f"method 'squaring' applies the series (I−L)(I+L²)… to the value tile, which loses its digits "
                         f"past {gdn.SERIES_BLOCK} nodes per path (max_depth={max_depth}): use 'inverse', 'split' or "
                         "'neumann'")
    # The forms that own an option: split_mgpu with its Triton operator pass (build_c, value_programs,
    # operator_chain) and, of those, the one with the default value pass (operator_mask; f16 chain by default).
    triton_operators = method == "split_mgpu" and operator_pass == "triton"
    default_value_pass = triton_operators and not build_c
    if (build_c or value_programs is not None) and not triton_operators:
        raise ValueError("build_c / value_programs are options of method 'split_mgpu' with its Triton operator pass; "
                         f"got method={method!r} operator_pass={operator_pass!r}")
    triton_owner = (f"method 'split_mgpu' with its Triton operator pass; got method={method!r} "
                    f"operator_pass={operator_pass!r}")
    default_owner = (f"method 'split_mgpu' with its Triton operator pass and its default value pass; got "
                     f"method={method!r} operator_pass={operator_pass!r} build_c={build_c}")
    operator_chain = _form_option("operator_chain", operator_chain, OperatorChain,
                                  "f16" if default_value_pass else "tf32", "tf32", triton_operators,
                                  f"operator_chain is an option of {triton_owner}")
    operator_mask = _form_option("operator_mask", operator_mask, OperatorMask, "i8" if default_value_pass else "f32",
                                 "f32", default_value_pass, f"operator_mask is an option of {default_owner}")
    operator_out = _form_option("operator_out", operator_out, OperatorOut, "pair", "pair", default_value_pass,
                                f"operator_out is an option of {default_owner}")
    value_state = _form_option("value_state", value_state, ValueState, "pair", "pair", operator_out == "f16",
                               "value_state 'f16' needs operator_out 'f16' (the state's fp16 matrix shares R's fp16 "
                               f"pair's bytes); got operator_out={operator_out!r}")
    if value_programs is not None and not build_c:
        raise ValueError("value_programs sets the build_c value pass's program count (build_c=True)")
    r = HV // HK
    nv = dv // block_v
    if num_warps is None:
        num_warps = 4 if block_v * dk <= 128 * 64 else 8     # keep the fp32 state tile in registers
    if method in ("split", "split_mgpu"):
        if deferred is not None:
            raise ValueError(f"method {method!r} takes no deferred updates (use 'inverse', its one-pass form)")
        if method == "split_mgpu" and not (precision == "tf32"
                                           and gdn_tree_split_mgpu.supported(N, dk, dv, block_v, q.dtype)):
            raise ValueError(f"method 'split_mgpu' needs N={gdn_tree_split_mgpu.NODES}, bf16 q/k, block_v in "
                             f"{gdn_tree_split_mgpu.BLOCK_VS} and precision 'tf32' (its bf16-pair products are "
                             f"~2^-16 accurate, not fp32); got N={N} {q.dtype} block_v={block_v} {precision}")
        return _tree_solve_split(S0, q, k, v, g, beta, mask, rounds=num_rounds(max_depth, N), block_v=block_v,
                                 precision=_f32_precision(precision, interpret), out_dtype=out_dtype,
                                 num_warps=num_warps, num_stages=num_stages, operator_warps=operator_warps,
                                 interpret=interpret, value_pass="mgpu" if method == "split_mgpu" else "triton",
                                 operator_pass=operator_pass, share_state_smem=share_state_smem,
                                 share_kq_smem=share_kq_smem, tma_store=tma_store, build_c=build_c,
                                 value_programs=value_programs, operator_chain=operator_chain,
                                 operator_mask=operator_mask, operator_out=operator_out, value_state=value_state)
    kern = functools.partial(_tree_solve_kernel, rounds=num_rounds(max_depth, N), method=method,
                             precision=_f32_precision(precision, interpret), deferred=deferred is not None,
                             write_state=write_state)
    in_specs = [
        pl.BlockSpec((None, N, N), lambda b, h, t: (b, 0, 0)),                 # mask
        pl.BlockSpec((None, N, None), lambda b, h, t: (b, 0, h)),              # g
        pl.BlockSpec((None, N, None), lambda b, h, t: (b, 0, h)),              # beta
        pl.BlockSpec((None, N, None, dk), lambda b, h, t: (b, 0, h // r, 0)),  # q (key head)
        pl.BlockSpec((None, N, None, dk), lambda b, h, t: (b, 0, h // r, 0)),  # k (key head)
        pl.BlockSpec((None, N, None, block_v), lambda b, h, t: (b, 0, h, t)),  # v
        pl.BlockSpec((None, None, dk, block_v), lambda b, h, t: (b, h, 0, t)),  # S0
    ]
    out_specs = [
        pl.BlockSpec((None, N, None, block_v), lambda b, h, t: (b, 0, h, t)),  # o
        pl.BlockSpec((None, None, N), lambda b, h, t: (b, h, 0)),              # Γ
        pl.BlockSpec((None, None, N, block_v), lambda b, h, t: (b, h, 0, t)),  # V'
    ]
    out_shape = [jax.ShapeDtypeStruct((B, N, HV, dv), out_dtype),
                 jax.ShapeDtypeStruct((B, HV, N), F32),
                 jax.ShapeDtypeStruct((B, HV, N, dv), F32)]
    operands = [mask.astype(F32), g.astype(F32), beta.astype(F32), q, k, v, S0.astype(F32)]
    aliases = {}
    if deferred is not None:
        c, rc, pk, pv, count = deferred
        P = rc.shape[-1]
        if not tile_dim_ok(P) or pk.shape != (B, P, HK, dk) or pv.shape != (B, HV, P, dv):
            raise ValueError(f"deferred updates: P={P} must be a power of two >= 16, keys [B,P,HK,dk], "
                             f"values [B,HV,P,dv]; got {pk.shape}, {pv.shape}")
        in_specs += [
            pl.BlockSpec((None, None), lambda b, h, t: (b, h)),                     # c
            pl.BlockSpec((None, None, P), lambda b, h, t: (b, h, 0)),               # c_i
            pl.BlockSpec((None, P, None, dk), lambda b, h, t: (b, 0, h // r, 0)),   # keys (key head)
            pl.BlockSpec((None, None, P, block_v), lambda b, h, t: (b, h, 0, t)),   # values
            pl.BlockSpec((None,), lambda b, h, t: (b,)),                            # count
        ]
        operands += [c.astype(F32), rc.astype(F32), pk, pv.astype(F32), count.astype(jnp.int32)]
        if write_state:
            out_specs.append(pl.BlockSpec((None, None, dk, block_v), lambda b, h, t: (b, h, 0, t)))
            out_shape.append(jax.ShapeDtypeStruct((B, HV, dk, dv), F32))
            aliases = {6: 3}
    return pl.pallas_call(
        kern, out_shape=out_shape, grid=(B, HV, nv), in_specs=in_specs, out_specs=out_specs,
        input_output_aliases=aliases,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name=f"gdn_tree_solve_{method}" + ("_deferred" if deferred is not None else ""),
    )(*operands)
