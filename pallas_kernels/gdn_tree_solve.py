"""Closed-form GDN tree verification (Bole Algorithm 1, value-tiled) as Pallas GPU kernels.

`tree_solve_pallas` must equal `hyspec_jax.gdn.masked_solve(S0, q, k, v, g, beta, mask, path_nodes=...)`: it returns
o [B,N,HV,dv] and the commit factors Γ = log_decay [B,HV,N] and V' = corrected [B,HV,N,dv] (the keys are the
inputs themselves). Its form and tiling are one `SolveConfig`.

One program per (request b, value head h, value tile t of width block_v) loads the state tile S0[b,h,:,t] and the
tree's q/k (key head h // (HV/HK): GVA is indexed, never expanded), v, g/β and the ancestor mask; builds
Γ = A g, D = A ⊙ e^{Γ_i−Γ_j}, L = strict(A) ⊙ β kkᵀ ⊙ D and C = qkᵀ ⊙ D on chip; solves V' = (I+L)⁻¹ R with
R = β(v − e^Γ (K S0)); and writes only o = e^Γ (Q S0) + C V', V' and Γ. The forms (`Method`):
- "neumann": V' by Horner's Neumann rounds U ← R − L U;
- "squaring": V' by the factors (I−L)(I+L²)(I+L⁴)… applied to R (at most gdn.SERIES_BLOCK nodes per path);
- "inverse": M = (I+L)⁻¹ and C M built before the state tile is loaded, then V' = M R, o = e^Γ Q S0 + (C M) R;
- "split": that node-wise part in a first launch per (request, value head), the value tiles in a second;
- "split_mgpu": the split form with its value pass in Mosaic GPU (`gdn_tree_split_mgpu`: 64 nodes, bf16 q/k,
  compute capability 9.0).
With deferred updates (`gdn.DeferredUpdates`) the one-launch forms merge them into their S0 tile first and can
write the merged tile back. docs/kernels.md has each form's measurements.

Lowering: Pallas' Triton lowering for every form but split_mgpu's value pass, although docs/design.md §5 prefers Mosaic
GPU. Mosaic GPU has no `dot_general`, only `plgpu.wgmma`, which needs M a multiple of 64 and tf32 operands K-major
without transposes; these forms need products with the node axis as M (16 or 32 nodes) and the fp32 state stored
N-major.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hyspec_jax import gdn
from hyspec_jax.pallas_kernels import gdn_tree_split_mgpu, tile_dim_ok

F32 = jnp.float32
Method = Literal["neumann", "squaring", "inverse", "split", "split_mgpu"]
METHODS = get_args(Method)
Precision = Literal["tf32", "tf32x3", "ieee"]
# How split_mgpu's Triton operator pass forms M = (I+L)⁻¹ and C M: one-pass fp16 products (`_f16_dot`, the default:
# the roundings of one-pass tf32 in fewer instructions) or bf16-pair products (`_pair_dot`: ~40x more accurate,
# slower; docs/kernels.md).
OperatorChain = Literal["f16", "pair"]

REFERENCE = "hyspec_jax.gdn.masked_solve"


@dataclasses.dataclass(frozen=True)
class SolveConfig:
    """Form and tiling of `tree_solve_pallas`: hashable, so a static jit argument. Raises ValueError on a
    combination no kernel implements (shape limits are checked per call: `supported`).

    method: the kernel's form (`Method`). block_v: value tile width (a power of two ≥ 16 dividing dv; split_mgpu:
    16, 32 or 64). precision of the fp32 × fp32 products: "tf32" (one pass, ~3e-4 relative), "tf32x3" (~fp32),
    "ieee"; split_mgpu takes "tf32" only. out_dtype: o's dtype. num_warps (None: 4, or 8 for tiles over 128 × 64)
    and num_stages: the value-tile programs'; operator_warps: the split forms' Triton operator pass.
    operator_chain: split_mgpu's operator pass (`OperatorChain`; None: "f16")."""
    method: Method = "neumann"
    block_v: int = 64
    precision: Precision = "tf32"
    out_dtype: Any = F32
    num_warps: int | None = None
    num_stages: int = 1
    operator_warps: int = 4
    operator_chain: OperatorChain | None = None

    def __post_init__(self):
        object.__setattr__(self, "out_dtype", jnp.dtype(self.out_dtype))
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r} (one of {METHODS})")
        if self.precision not in get_args(Precision):
            raise ValueError(f"unknown precision {self.precision!r} (one of {get_args(Precision)})")
        if not tile_dim_ok(self.block_v):
            raise ValueError(f"block_v must be a power of two >= 16, got {self.block_v}")
        for name in ("num_warps", "operator_warps"):
            w = getattr(self, name)
            if w is not None and (w < 1 or w & (w - 1)):
                raise ValueError(f"{name} must be a power of two, got {w}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")
        if self.operator_chain is not None and self.operator_chain not in get_args(OperatorChain):
            raise ValueError(f"unknown operator_chain {self.operator_chain!r} (one of {get_args(OperatorChain)})")
        if self.method == "split_mgpu":
            if self.precision != "tf32":
                raise ValueError("method 'split_mgpu' takes precision 'tf32' only (its bf16-pair products are "
                                 f"~2^-16 accurate, not fp32); got {self.precision!r}")
            if self.block_v not in gdn_tree_split_mgpu.BLOCK_VS:
                raise ValueError(f"method 'split_mgpu' takes block_v in {gdn_tree_split_mgpu.BLOCK_VS}, "
                                 f"got {self.block_v}")
        elif self.operator_chain is not None:
            raise ValueError(f"operator_chain is an option of method 'split_mgpu'; got method={self.method!r}")

    @property
    def chain(self) -> str:
        """How the Triton operator pass forms M and C M: split_mgpu's `operator_chain`, else products at `precision`."""
        return (self.operator_chain or "f16") if self.method == "split_mgpu" else "precision"


def series_ok(path_nodes: int, n: int) -> bool:
    """Whether method "squaring" may run: at most gdn.SERIES_BLOCK nodes on a path (`gdn.block_inverse`)."""
    return num_rounds(path_nodes, n) < gdn.SERIES_BLOCK


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


def num_rounds(path_nodes: int, n: int) -> int:
    """d = edges on the longest path: the Neumann series has d nonzero terms after the identity."""
    return max(0, min(path_nodes, n) - 1)


def _fold_deferred(s0, c_ref, rc_ref, pk_ref, pv_ref, count_ref, precision):
    """e^{c} S_base + Σ_{i<count} e^{c − c_i} k_i v_iᵀ on one [dk, bv] tile (gdn.deferred_fold)."""
    c = c_ref[...]
    rows = lax.broadcasted_iota(jnp.int32, rc_ref.shape, 0)
    used = rows < count_ref[...]
    w = gdn.masked_exp(used, c - rc_ref[...])                                           # [P]
    kw = pk_ref[...].astype(F32) * w[:, None]                                           # [P, dk]
    return jnp.exp(c) * s0 + _dot(kw, pv_ref[...], precision, trans_a=True)


def tile_nodes(n: int) -> int:
    """The node tile of a tree of n nodes: the next power of two, at least 16 (a tensor-core product's smallest
    side). The one-launch forms read the n nodes into it (`_node_rows`); the split forms take n = the tile."""
    t = 16
    while t < n:
        t *= 2
    return t


def _node_rows(ref, n: int):
    """A block whose leading axis is the node tile: rows past the tree's n nodes read as zeros (g = 0, β = 0,
    q = k = v = 0: identity steps, as zero-padded nodes were), no load issued for them."""
    if n >= ref.shape[0]:
        return ref[...]
    rows = lax.broadcasted_iota(jnp.int32, ref.shape, 0)
    return pltriton.load(ref, mask=rows < n, other=0)


def _store_node_rows(ref, x, n: int):
    """Write x's first n rows (the tree's nodes) into a node-tiled output block; the tile's padding is not written."""
    if n >= ref.shape[0]:
        ref[...] = x
        return
    rows = lax.broadcasted_iota(jnp.int32, ref.shape, 0)
    pltriton.store(ref, x, mask=rows < n)


def _ancestors(mask_ref, n: int):
    """The ancestor mask A [tile, tile] as f32 0/1; padded nodes are their own only ancestor (identity steps that
    no node of the tree descends from)."""
    if n >= mask_ref.shape[0]:
        A = mask_ref[...]
        return A if A.dtype == F32 else A.astype(F32)
    shape = mask_ref.shape
    row, col = lax.broadcasted_iota(jnp.int32, shape, 0), lax.broadcasted_iota(jnp.int32, shape, 1)
    A = pltriton.load(mask_ref, mask=(row < n) & (col < n), other=0).astype(F32)
    return jnp.where((row == col) & (row >= n), 1.0, A)


def _decays(on, gamma):
    """D = A ⊙ e^{Γ_i−Γ_j} (on: A > 0)."""
    return gdn.masked_exp(on, gamma[:, None] - gamma[None, :])


def _query_operator(q, k, D, precision):
    """C = qkᵀ ⊙ D."""
    return _dot(q, k, precision, trans_b=True) * D


def _node_operators(mask_ref, g_ref, beta_ref, q, k, precision, nodes: int | None = None):
    """Γ = A g, the ancestor-masked L = strict(A) ⊙ β kkᵀ ⊙ D and C = qkᵀ ⊙ D (node by node, no value tile; q None:
    no C). nodes: the tree's nodes when fewer than the tile (`_node_rows`)."""
    n = mask_ref.shape[0]
    nodes = n if nodes is None else nodes
    A = _ancestors(mask_ref, nodes)                     # [N, N] 0/1 f32 (read as f32 or int8)
    g = _node_rows(g_ref, nodes)                        # [N]
    beta = _node_rows(beta_ref, nodes)                  # [N]
    on = A > 0
    gamma = jnp.sum(A * g[None, :], axis=1)             # Γ = A g            [N]
    D = _decays(on, gamma)
    row = lax.broadcasted_iota(jnp.int32, (n, n), 0)
    col = lax.broadcasted_iota(jnp.int32, (n, n), 1)
    kk = _dot(k, k, precision, trans_b=True)            # [N, N]
    L = jnp.where(on & (row != col), beta[:, None] * kk * D, 0.0)
    if q is None:                                       # C not wanted (built later)
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


def _tree_solve_kernel(*refs, rounds: int, method: str, precision, deferred: bool, write_state: bool, nodes: int,
                       stacked: bool):
    if stacked:                                         # first the layer's index, then S0 is the whole state stack
        layer_ref, refs = refs[0], refs[1:]
    mask_ref, g_ref, beta_ref, q_ref, k_ref, v_ref, s0_ref = refs[:7]
    rest = refs[7:]
    if deferred:
        c_ref, rc_ref, pk_ref, pv_ref, count_ref = rest[:5]
        rest = rest[5:]
    o_ref, gamma_ref, vc_ref = rest[:3]
    q = _node_rows(q_ref, nodes)                        # [N, dk] (input dtype; N the node tile)
    k = _node_rows(k_ref, nodes)
    gamma, beta, L, C = _node_operators(mask_ref, g_ref, beta_ref, q, k, precision, nodes)
    if method == "inverse":                             # node-wise work first, before the state tile is live
        M = _inverse(L, rounds, precision)
        CM = _dot(C, M, precision)
    if not stacked:
        s0 = s0_ref[...]                                # [dk, bv] f32
    else:     # the layer's tile, at an index read from memory: every layer runs this one kernel (one Triton compile)
        block_v = vc_ref.shape[-1]
        tile = pl.ds(pl.program_id(2) * block_v, block_v)
        s0 = s0_ref[jnp.sum(layer_ref[...]), pl.program_id(0), pl.program_id(1), :, tile]
    if deferred:                                        # merge the committed-but-deferred path updates
        s0 = _fold_deferred(s0, c_ref, rc_ref, pk_ref, pv_ref, count_ref, precision)
        if write_state:
            rest[3][...] = s0                           # the merged state replaces S_base (aliased)
    ks = _dot(k, s0, precision)                         # [N, bv]
    qs = _dot(q, s0, precision)
    eg = jnp.exp(gamma)
    R = beta[:, None] * (_node_rows(v_ref, nodes).astype(F32) - eg[:, None] * ks)
    if method == "inverse":                             # V' = M R and C V' = (C M) R: two independent products
        U = _dot(M, R, precision)
        o = eg[:, None] * qs + _dot(CM, R, precision)
    else:
        U = _apply_inverse(L, R, rounds, method, precision)
        o = eg[:, None] * qs + _dot(C, U, precision)
    _store_node_rows(o_ref, o.astype(o_ref.dtype), nodes)
    _store_node_rows(vc_ref, U, nodes)
    _store_node_rows(gamma_ref, gamma, nodes)           # every value tile writes the same Γ


def _tree_operator_kernel(mask_ref, g_ref, beta_ref, q_ref, k_ref, gamma_ref, *out_refs, rounds: int, precision,
                          form: str, chain: str):
    """Split form, pass 1 (one program per request and value head): Γ and the node-wise operators to HBM. form
    "fp32": [M; C M] in fp32 (one output); "pair": the same as a bf16 pair hi + lo with β head-major for the Mosaic
    GPU value pass (three outputs: hi, lo, β [HV, N]; gdn_tree_split_mgpu says why). chain: how M and C M are
    formed, "precision" (`_dot` at `precision`), "f16" (`_f16_dot`) or "pair" (`_pair_dot`). With the fp16 chain,
    C is built after M's chain (not live through it; the mask is read again): 0.7-0.9 µs less at B 8-32, N 64;
    the pair chain is faster with C first."""
    n = mask_ref.shape[0]
    c_first = chain == "pair" or form == "fp32"
    q = q_ref[...] if c_first else None
    gamma, beta, L, C = _node_operators(mask_ref, g_ref, beta_ref, q, k_ref[...], precision)
    dot = {"pair": _pair_dot, "f16": _f16_dot}.get(chain) or functools.partial(_dot, precision=precision)
    M = _inverse(L, rounds, precision, dot)
    if form == "fp32":
        # This order (C live through M's chain, Γ stored first) took 168 registers; others took up to 214.
        gamma_ref[...] = gamma
        out_refs[0][pl.ds(0, n), :] = M
        out_refs[0][pl.ds(n, n), :] = dot(C, M)
        return
    if not c_first:
        C = _query_operator(q_ref[...], k_ref[...], _decays(mask_ref[...] > 0, gamma), precision)   # mask read again
    CM = dot(C, M)
    gamma_ref[...] = gamma                              # after C M: 165 registers (before it: 224)
    hi_ref, lo_ref, rows_ref = out_refs
    rows_ref[...] = beta                                # β head-major
    for rows, X in ((pl.ds(0, n), M), (pl.ds(n, n), CM)):
        hi_ref[rows, :], lo_ref[rows, :] = gdn_tree_split_mgpu.split_bf16(X)


def _tree_apply_kernel(gamma_ref, beta_ref, mc_ref, k_ref, q_ref, v_ref, s0_ref, o_ref, vc_ref, *, precision):
    """Split form, pass 2 (one program per request, value head and value tile): K S0 and Q S0 from the key
    head's own q/k, R = β(v − e^Γ K S0), then one product of 2N rows, [M; C M] R (docs/kernels.md has the
    layouts measured against it)."""
    n = gamma_ref.shape[0]
    s0 = s0_ref[...]                                                                   # [dk, bv] f32
    ks, qs = _dot(k_ref[...], s0, precision), _dot(q_ref[...], s0, precision)
    eg = jnp.exp(gamma_ref[...])
    R = beta_ref[...][:, None] * (v_ref[...].astype(F32) - eg[:, None] * ks)
    U, CU = lax.split(_dot(mc_ref[...], R, precision), (n, n), axis=0)
    vc_ref[...] = U
    o_ref[...] = (eg[:, None] * qs + CU).astype(o_ref.dtype)


def _tree_operators_triton(q, k, g, beta, mask, *, rounds, precision, form, operator_warps, interpret, chain,
                           mask_dtype=F32):
    """The split forms' Triton operator pass (`_tree_operator_kernel`): form "fp32" returns Γ, [M; C M] fp32;
    "pair" Γ, the [M; C M] bf16 pair and β head-major. mask_dtype: how the ancestor mask is read (int8 for the
    Mosaic GPU value pass's operator pass: a quarter of the bytes at the start of a wave, same results)."""
    B, N, HK, dk = q.shape
    HV = g.shape[2]
    r = HV // HK
    mats = 1 if form == "fp32" else 2
    mat_dtype = F32 if form == "fp32" else jnp.bfloat16
    shapes = [jax.ShapeDtypeStruct((B, HV, 2 * N, N), mat_dtype)] * mats
    specs = [pl.BlockSpec((None, None, 2 * N, N), lambda b, h: (b, h, 0, 0))] * mats
    if form == "pair":                                                              # β head-major
        shapes.append(jax.ShapeDtypeStruct((B, HV, N), F32))
        specs.append(pl.BlockSpec((None, None, N), lambda b, h: (b, h, 0)))
    return pl.pallas_call(
        functools.partial(_tree_operator_kernel, rounds=rounds, precision=precision, form=form, chain=chain),
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


def _tree_solve_split(S0, q, k, v, g, beta, mask, *, rounds, config: SolveConfig, num_warps, interpret):
    """Two launches: the node-wise operators once per (request, value head) — Γ and [M; C M], 2·N² words per head
    through HBM — then the value tiles, which hold no N × N chain: three products, K S0, Q S0, [M; C M] R.
    split_mgpu: the second launch is the Mosaic GPU kernel (gdn_tree_split_mgpu), fed the bf16 pair."""
    B, N, HK, dk = q.shape
    HV, dv = v.shape[2], v.shape[3]
    r = HV // HK
    precision = _f32_precision(config.precision, interpret)
    block_v = config.block_v
    if config.method == "split_mgpu":
        gamma, mc_hi, mc_lo, beta_hn = _tree_operators_triton(
            q, k, g, beta, mask, rounds=rounds, precision=precision, form="pair",
            operator_warps=config.operator_warps, interpret=interpret, chain=config.chain, mask_dtype=jnp.int8)
        o, vc = gdn_tree_split_mgpu.tree_apply_mgpu(gamma, beta_hn, mc_hi, mc_lo, k, q, v, S0.astype(F32),
                                                    block_v=block_v, out_dtype=config.out_dtype,
                                                    interpret=interpret)
        return o, gamma, vc
    gamma, MC = _tree_operators_triton(q, k, g, beta, mask, rounds=rounds, precision=precision, form="fp32",
                                       operator_warps=config.operator_warps, interpret=interpret, chain=config.chain)
    o, vc = pl.pallas_call(
        functools.partial(_tree_apply_kernel, precision=precision),
        out_shape=[jax.ShapeDtypeStruct((B, N, HV, dv), config.out_dtype),
                   jax.ShapeDtypeStruct((B, HV, N, dv), F32)],
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
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=config.num_stages),
        interpret=interpret, name="gdn_tree_apply",
    )(gamma, beta.astype(F32), MC, k, q, v, S0.astype(F32))
    return o, gamma, vc


# The N × N fp32 products at 128 nodes with fp32-accurate (3-pass or IEEE) dots need more shared memory than the
# H200 has: the embedded fp32 model's 128-node verify failed to launch there ("requested 262144, available:
# 232448"). One-pass tf32 (what a bf16/f16 model's verify uses) launches at 128 nodes (a launch probe, in git up
# to 1f1bd12).
FP32_ACCURATE_MAX_NODES = 64


def supported(N: int, dk: int, dv: int, block_v: int, precision: Precision = "tf32") -> bool:
    return (tile_dim_ok(N) and N <= 128 and tile_dim_ok(dk) and dk <= 256 and tile_dim_ok(block_v)
            and dv % block_v == 0 and (precision == "tf32" or N <= FP32_ACCURATE_MAX_NODES))


def tree_solve_pallas(S0, q, k, v, g, beta, mask, deferred=None, *, path_nodes: int,
                      config: SolveConfig = SolveConfig(), write_state: bool = False,
                      layer: int | jax.Array | None = None, interpret: bool = False):
    """Kernel entry. q, k [B,N,HK,dk] (HK | HV, key head of value head h is h // (HV/HK)); v [B,N,HV,dv];
    g, β [B,N,HV] fp32; S0 [B,HV,dk,dv] fp32; mask [B,N,N]. N ≤ 128 nodes; the one-launch forms read them into a
    node tile (`tile_nodes`: a power of two ≥ 16) whose padding is identity steps, on chip — no padded copies in
    memory; the split forms take N = its tile (the dispatcher pads for them). path_nodes: nodes on the longest path.
    config: the form and tiling (`SolveConfig`). Returns (o [B,N,HV,dv], Γ [B,HV,N], V' [B,HV,N,dv]).

    deferred: the state is S0 plus committed-but-unmerged path updates (`gdn.DeferredUpdates` in kernel
    layout: c [B,HV], c_i [B,HV,P], keys [B,P,HK,dk] (key heads), values [B,HV,P,dv], count [B]; P a power
    of two ≥ 16), merged on chip after the S0 tile is loaded (one-launch forms only). write_state: also return
    the merged state (fourth output, written over S0 — donate S0 to make it in place); the caller then empties the
    updates.

    layer (one-launch forms, no write_state): S0 is a stack [L, B, HV, dk, dv] of states and the solve reads layer
    `layer`'s tiles of it where they lie. The index is an operand, not static: every layer runs one kernel.
    """
    if layer is not None and isinstance(layer, int) and not (S0.ndim == 5 and 0 <= layer < S0.shape[0]):
        raise ValueError(f"layer {layer} of a state stack [L, B, HV, dk, dv], got S0 {S0.shape}")
    return _tree_solve(S0, q, k, v, g, beta, mask, deferred, path_nodes=path_nodes, config=config,
                       write_state=write_state, layer=layer, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("path_nodes", "config", "write_state", "interpret"))
def _tree_solve(S0, q, k, v, g, beta, mask, deferred, *, path_nodes: int, config: SolveConfig, write_state: bool,
                layer, interpret: bool):
    """`tree_solve_pallas` once its layer index is checked (here a traced operand)."""
    if not isinstance(config, SolveConfig):
        raise TypeError(f"config must be a SolveConfig, got {type(config).__name__}")
    method, block_v, precision = config.method, config.block_v, config.precision
    if layer is not None:
        if write_state or method in ("split", "split_mgpu"):
            raise ValueError("a layer of a state stack is read by the one-launch forms without write_state only")
        if S0.ndim != 5:
            raise ValueError(f"a layer of a state stack [L, B, HV, dk, dv], got S0 {S0.shape}")
    B, N, HK, dk = q.shape
    HV, dv = v.shape[2], v.shape[3]
    n_tile = tile_nodes(N)
    if not supported(n_tile, dk, dv, block_v, precision) or HV % HK:
        raise ValueError(f"unsupported shape N={N} dk={dk} dv={dv} block_v={block_v} HV={HV} HK={HK} "
                         f"precision={precision}")
    if write_state and deferred is None:
        raise ValueError("write_state needs deferred updates (without them the state is S0 itself)")
    if method == "squaring" and not series_ok(path_nodes, N):
        raise ValueError(f"method 'squaring' applies the series (I−L)(I+L²)… to the value tile, which loses its digits "
                         f"past {gdn.SERIES_BLOCK} nodes per path (path_nodes={path_nodes}): use 'inverse', 'split' or "
                         "'neumann'")
    r = HV // HK
    nv = dv // block_v
    num_warps = config.num_warps
    if num_warps is None:
        num_warps = 4 if block_v * dk <= 128 * 64 else 8     # keep the fp32 state tile in registers
    num_stages = config.num_stages
    out_dtype = config.out_dtype
    if method in ("split", "split_mgpu"):
        if N != n_tile:
            raise ValueError(f"method {method!r} takes a node count that is its own tile (a power of two ≥ 16; the "
                             f"dispatcher pads), got N={N}")
        if deferred is not None:
            raise ValueError(f"method {method!r} takes no deferred updates (use 'inverse', its one-pass form)")
        if method == "split_mgpu" and not gdn_tree_split_mgpu.supported(N, dk, dv, block_v, q.dtype):
            raise ValueError(f"method 'split_mgpu' needs N={gdn_tree_split_mgpu.NODES}, bf16 q/k and block_v in "
                             f"{gdn_tree_split_mgpu.BLOCK_VS}; got N={N} {q.dtype} block_v={block_v}")
        return _tree_solve_split(S0, q, k, v, g, beta, mask, rounds=num_rounds(path_nodes, N), config=config,
                                 num_warps=num_warps, interpret=interpret)
    kern = functools.partial(_tree_solve_kernel, rounds=num_rounds(path_nodes, N), method=method,
                             precision=_f32_precision(precision, interpret), deferred=deferred is not None,
                             write_state=write_state, nodes=N, stacked=layer is not None)
    T = n_tile                  # node blocks are the tile; rows past N are masked in the kernel (`_node_rows`)
    in_specs = [
        pl.BlockSpec((None, T, T), lambda b, h, t: (b, 0, 0)),                 # mask
        pl.BlockSpec((None, T, None), lambda b, h, t: (b, 0, h)),              # g
        pl.BlockSpec((None, T, None), lambda b, h, t: (b, 0, h)),              # beta
        pl.BlockSpec((None, T, None, dk), lambda b, h, t: (b, 0, h // r, 0)),  # q (key head)
        pl.BlockSpec((None, T, None, dk), lambda b, h, t: (b, 0, h // r, 0)),  # k (key head)
        pl.BlockSpec((None, T, None, block_v), lambda b, h, t: (b, 0, h, t)),  # v
        pl.BlockSpec((None, None, dk, block_v), lambda b, h, t: (b, h, 0, t)) if layer is None else       # S0
        pl.no_block_spec,                                                      # (the stack: the kernel indexes it)
    ]
    out_specs = [
        pl.BlockSpec((None, T, None, block_v), lambda b, h, t: (b, 0, h, t)),  # o
        pl.BlockSpec((None, None, T), lambda b, h, t: (b, h, 0)),              # Γ
        pl.BlockSpec((None, None, T, block_v), lambda b, h, t: (b, h, 0, t)),  # V'
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
    if layer is not None:                              # the layer's index first (no aliases: write_state is off)
        in_specs = [pl.BlockSpec((1,), lambda b, h, t: (0,))] + in_specs
        operands = [jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))] + operands
    return pl.pallas_call(
        kern, out_shape=out_shape, grid=(B, HV, nv), in_specs=in_specs, out_specs=out_specs,
        input_output_aliases=aliases,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name=f"gdn_tree_solve_{method}" + ("_deferred" if deferred is not None else ""),
    )(*operands)
