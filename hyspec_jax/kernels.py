"""The library's one door to the kernels: the fail-closed policy of which implementation runs (docs/design.md §5).

Every kernel call of the models goes through here, each with a pure-JAX reference it must equal:
- `dense(x, w)`: the weight products; the native CPU kernel (`hyspec_jax.cpu_kernels`) where it is eligible,
  else XLA's dot;
- `tree_solve(...)`: the GDN tree solve with the contract of `hyspec_jax.gdn.masked_solve`, returning
  `(o, SolveFactors)`; the Pallas kernel (`pallas_kernels.gdn_tree_solve`, its form a `SolveConfig` from
  `solve_config`) on an NVIDIA GPU (compute capability ≥ 8.0) with a supported shape and dtype. Node counts that
  are not a power of two in [16, 128] are padded with identity nodes (g = 0, β = 0, mask row = self) and sliced
  back. The kernel path is a `jax.custom_vjp` whose backward is the reference's VJP;
- `gdn_decode_layer(...)`: a GDN layer's decoding step from its in-projection's output row, `gdn.decode_layer`
  (conv, gates, l2norm, state update, readout, window update, and the gated output norm); the one-launch Pallas
  kernel (`pallas_kernels.gdn_decode`) on an NVIDIA GPU where its shapes allow;
- `add_rms_norm(...)`: a residual add and the RMSNorm after it, `gdn.add_rms_norm`; one Pallas launch
  (`pallas_kernels.add_norm`) on an NVIDIA GPU where the width allows;
- `path_commit(...)`: the cross-layer factorized commit (gdn.node_state per layer);
- `tree_attention(...)`: the verify's attention over the committed prefix + the tree
  (`hyspec_jax.attention.attend_prefix_tree`; the split-S Pallas prefix kernel where S fits its blocks);
- `biased_topk(...)`: a greedy tree level's top-k children and log-sum-exp (`bench topk`);
- `tree_level(...)`: a whole greedy level of the beam tree — top-k children, their scores, the kept beam
  (`hyspec_jax.spec.select`).
impl "auto" takes a kernel only where it is supported and never one that might be wrong: anything else runs
the reference. "pallas" / "interpret" (Pallas interpret mode, the CPU tests) raise where they cannot be honoured.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp

from hyspec_jax import cpu_kernels, gdn
from hyspec_jax.attention import attend_prefix_tree
from hyspec_jax.pallas_kernels import add_norm, gdn_commit, gdn_tree_split_mgpu, gdn_tree_solve, tile_dim_ok, topk
from hyspec_jax.pallas_kernels import gdn_decode as gdn_decode_kernel
from hyspec_jax.pallas_kernels import tree_attention as tree_attention_kernel
from hyspec_jax.pallas_kernels.gdn_tree_solve import SolveConfig
from hyspec_jax.state import write_layer

F32 = jnp.float32
Impl = Literal["auto", "reference", "pallas", "interpret"]
_FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def dense(x: jax.Array, w: jax.Array, *, accumulate=F32) -> jax.Array:
    """x [..., in] · wᵀ for a weight in the HF [out, in] layout -> [..., out] with `accumulate` accumulation (fp32).
    A few float32 rows on a CPU (speculative verify / draft) run the native streaming kernel
    (`cpu_kernels.eligible` says when; it equals XLA's dot to fp32 rounding), everything else XLA's dot."""
    if cpu_kernels.eligible(x, w):
        return cpu_kernels.dense(x, w)
    return jnp.einsum("...i,oi->...o", x, w, preferred_element_type=accumulate)


def gpu_kernels_available() -> bool:
    """True on an NVIDIA GPU backend with compute capability ≥ 8.0 (Triton tensor-core dots)."""
    try:
        if jax.default_backend() != "gpu":
            return False
        dev = jax.devices()[0]
        cc = getattr(dev, "compute_capability", None)
        return cc is not None and float(cc) >= 8.0
    except Exception:   # noqa: BLE001 — any doubt means no kernel
        return False


def hopper_available() -> bool:
    """True on a compute capability 9.x GPU: wgmma, which the Mosaic GPU value pass (split_mgpu) is built on."""
    try:
        cc = getattr(jax.devices()[0], "compute_capability", None)
        return gpu_kernels_available() and cc is not None and int(float(cc)) == 9
    except Exception:   # noqa: BLE001 — any doubt means no kernel
        return False


def _use_kernel(impl: Impl, ok: bool, what: str, why: str = "") -> bool | None:
    """The fail-closed choice: None = take the reference; else the kernel's `interpret` flag. "auto" takes the
    kernel only on a supported shape on an NVIDIA GPU; "pallas" / "interpret" raise where they cannot be honoured."""
    if impl == "auto":
        return False if ok and gpu_kernels_available() else None
    if impl in ("pallas", "interpret"):
        if not ok:
            raise ValueError(f"{what} kernel does not support this input" + (f": {why}" if why else ""))
        if impl == "pallas" and not gpu_kernels_available():
            raise ValueError(f"{what} kernel needs an NVIDIA GPU backend")
        return impl == "interpret"
    raise ValueError(f"unknown impl {impl!r}")


def _padded_n(n: int) -> int | None:
    p = 16
    while p < n:
        p *= 2
    return p if p <= 128 else None


def _reference(S0, q, k, v, g, beta, mask, path_nodes, method="solve"):
    return gdn.masked_solve(S0, q, k, v, g, beta, mask, method=method, path_nodes=path_nodes)


def tree_solve_supported(S0, q, k, v, g, beta, mask, block_v: int = 64,
                         precision: str | None = None) -> tuple[bool, str]:
    """(ok, reason) for the kernel path on this shape/dtype (platform checked separately)."""
    try:
        B, N, HK, dk = q.shape
        if k.shape != q.shape:
            return False, "q and k shapes differ"
        if v.ndim != 4 or v.shape[:2] != (B, N):
            return False, "v shape"
        HV, dv = v.shape[2], v.shape[3]
        if HK <= 0 or HV % HK:
            return False, "HV not a multiple of HK"
        if S0.shape != (B, HV, dk, dv) or S0.dtype != F32:
            return False, "S0 must be fp32 [B,HV,dk,dv]"
        if g.shape != (B, N, HV) or beta.shape != (B, N, HV):
            return False, "g/beta shape"
        if mask.shape != (B, N, N):
            return False, "mask shape"
        if q.dtype != k.dtype or jnp.dtype(q.dtype) not in _FLOATS or jnp.dtype(v.dtype) not in _FLOATS:
            return False, "dtype"
        n_pad = _padded_n(N)
        if n_pad is None:
            return False, "N > 128"
        if not gdn_tree_solve.supported(n_pad, dk, dv, block_v):
            return False, "dk/dv/block_v"
        if not gdn_tree_solve.supported(n_pad, dk, dv, block_v, precision or _default_precision(q.dtype)):
            return False, f"{n_pad} nodes with fp32-accurate products exceed the GPU's shared memory"
        return True, ""
    except Exception as e:  # noqa: BLE001
        return False, f"shape check failed: {e}"


def _default_precision(dtype) -> str:
    return "tf32x3" if jnp.dtype(dtype) == jnp.dtype(F32) else "tf32"


# What the verify hands the tree-solve kernel for a model computing in a dtype: (dtype of q, k, v; product
# precision), chosen by measured error and time at the Qwen3.8-27B geometry on an H100
# (bench/results/kernels/gdn_layer_h100_padded.md; o's error against the fp32 reference):
# - a bf16 / fp16 model: the mixer's fp32 q, k, v with one-pass tf32 products: o error 3.4e-4, five times under the
#   rounding of o itself to bf16 (1.7e-3), which the verify does next. bf16 operands ran up to 21% faster (B 8,
#   N 32: 46.0 vs 58.3 µs) but erred 2.2e-3, more than that rounding.
# - an fp32 model: fp32 operands, 3-pass (fp32-accurate) products, so its greedy tokens equal plain decoding's (in
#   the split form: `FP32_ACCURATE_SPLIT`).
VERIFY_OPERANDS: dict = {jnp.dtype(F32): (jnp.dtype(F32), "tf32x3"),
                         jnp.dtype(jnp.bfloat16): (jnp.dtype(F32), "tf32"),
                         jnp.dtype(jnp.float16): (jnp.dtype(F32), "tf32")}


def verify_operands(compute_dtype) -> tuple[jnp.dtype, str]:
    """(q/k/v dtype, precision) of the tree-solve kernel for a model computing in `compute_dtype`
    (`VERIFY_OPERANDS`); a dtype without an entry keeps fp32 operands at fp32-accurate precision."""
    return VERIFY_OPERANDS.get(jnp.dtype(compute_dtype), (jnp.dtype(F32), "tf32x3"))


def kernel_operands(q, k, v, compute_dtype):
    """(q, k, v, precision) as the tree-solve kernel is handed them for a model computing in `compute_dtype`
    (`verify_operands`): q and k in the operand dtype; v only rounded to it when wider — v enters no product, the
    kernels widen it to fp32 as they read it, exactly, so a narrower v is passed as it is (no cast kernel)."""
    operand_dtype, precision = verify_operands(compute_dtype)
    if jnp.finfo(v.dtype).bits > jnp.finfo(operand_dtype).bits:
        v = v.astype(operand_dtype)
    return q.astype(operand_dtype), k.astype(operand_dtype), v, precision


def _pad_tree(n_pad, q, k, v, g, beta, mask):
    N = q.shape[1]
    if n_pad == N:
        return q, k, v, g, beta, mask
    extra = n_pad - N
    padn = lambda x: jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2))
    q, k, v, g, beta = map(padn, (q, k, v, g, beta))      # zeros: g = 0, β = 0 → identity steps
    m = jnp.pad(mask.astype(bool), [(0, 0), (0, extra), (0, extra)])
    m = m | jnp.eye(n_pad, dtype=bool)[None]              # padded rows: self only
    return q, k, v, g, beta, m


def _kernel_forward(S0, q, k, v, g, beta, mask, path_nodes, cfg, deferred=None):
    """The one-launch forms read a tree of any size into their node tile on chip; only the split forms, whose two
    passes hand N × N operators through memory, are given zero-padded copies (measured: at B 1, N 8 the pads and
    the slices back took 14 of 19.8 µs, the kernel 5.7 — bench/results/kernels/gdn_layer_h100_padded.md; without them
    9.1 µs — gdn_layer_h100_unpadded.md)."""
    config, interpret, layer = cfg
    N = q.shape[1]
    n_pad = _padded_n(N)
    if config.method not in ("split", "split_mgpu") or n_pad == N:
        o, gamma, vc = gdn_tree_solve.tree_solve_pallas(S0, q, k, v, g, beta, mask, deferred,
                                                        path_nodes=min(path_nodes, N), config=config,
                                                        layer=layer, interpret=interpret)
        return o, gdn.SolveFactors(gamma, k, vc)               # the keys as given: no copy
    qp, kp, vp, gp, bp, mp = _pad_tree(n_pad, q, k, v, g, beta, mask)
    o, gamma, vc = gdn_tree_solve.tree_solve_pallas(S0, qp, kp, vp, gp, bp, mp, deferred,
                                                    path_nodes=min(path_nodes, N), config=config,
                                                    interpret=interpret)
    return o[:, :N], gdn.SolveFactors(gamma[..., :N], k, vc[:, :, :N])


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _kernel_solve(S0, q, k, v, g, beta, mask, path_nodes, cfg):
    return _kernel_forward(S0, q, k, v, g, beta, mask, path_nodes, cfg)


def _kernel_solve_fwd(S0, q, k, v, g, beta, mask, path_nodes, cfg):
    return _kernel_forward(S0, q, k, v, g, beta, mask, path_nodes, cfg), (S0, q, k, v, g, beta, mask)


def _kernel_solve_bwd(path_nodes, cfg, res, ct):
    S0, q, k, v, g, beta, mask = res
    layer = cfg[2]
    f = lambda S0, q, k, v, g, beta: _reference(S0 if layer is None else S0[layer], q, k, v, g, beta, mask,  # noqa
                                                path_nodes)
    _, vjp = jax.vjp(f, S0, q, k, v, g, beta)
    return (*vjp(ct), None)


_kernel_solve.defvjp(_kernel_solve_fwd, _kernel_solve_bwd)


def _block_v(dv: int, block_v: int | None) -> int:
    """Value tile width: 64 (the H200 sweep's choice at B = 8) unless the head is narrower."""
    return block_v if block_v is not None else min(64, dv)


# "auto" kernel form, from the H200 device times of each form (27B geometry, profiler trace; docs/kernels.md): below
# 64 nodes the one-launch inverse form wins (B 8, N 16: 18.0 vs 20.3 µs split); from 64 nodes the split form does, at
# every batch measured (B 1: 16.7 vs 17.4; B 8: 51.3 vs 60.9; B 32: 196 vs 220 —
# bench/results/kernels/forms/kernels_split_forms_h200.md), and at 128 nodes by far, with whole-width value tiles
# (B 8: 401 µs split bv 128, 893 inverse, 710 squaring — bench/results/archive/kernels_h200_final.md). At 64 nodes on
# a Hopper GPU the split form with its Mosaic GPU value pass wins at every batch measured (B 1 / 8 / 16 / 32: 14.4 /
# 40.0 / 72.3 / 132.0 µs vs 16.6 / 52.3 / 102.7 / 195.8 for the Triton value pass —
# bench/results/archive/kernels_split_mgpu_h200.md; 12.5 / 35.0 / 65.0 / 118.5 µs with the fp16 operator chain,
# bench/results/kernels/kernels_h200_mgpu_table.md), where its shape limits allow (bf16 q/k, one-pass precision).
SPLIT_MIN_NODES, SPLIT_ALWAYS_NODES = 64, 128
# With fp32-accurate products (an fp32 model's verify) the split form wins at every size measured on an H100 at the
# 27B geometry (bench/results/kernels/gdn_layer_h100_padded.md, µs per layer, split vs one-launch inverse, 3-pass
# tf32): B 1 / 8 / 32 at N 8: 30.8 / 76.0 / 228.0 vs 29.5 / 118.9 / 423.6; B 1 / 8 at N 32: 55.6 / 201.1 vs
# 373.4 / 1,828.9. The one-launch form keeps the N × N chain live beside the state tile, and 3-pass products of it
# spill.
FP32_ACCURATE_SPLIT = ("tf32x3", "ieee")


def auto_method(nodes: int, dv: int, mgpu_ok: bool = False, precision: str = "tf32") -> tuple[str, int]:
    """(form, block_v) that `method="auto"` picks for trees of `nodes` (padded) nodes and value heads of width dv;
    mgpu_ok: the Mosaic GPU value pass can run here (Hopper GPU, bf16 q/k, tf32 precision, its shapes); precision:
    the kernel's products (fp32-accurate ones take the split form at every size: `FP32_ACCURATE_SPLIT`)."""
    if nodes >= SPLIT_ALWAYS_NODES:
        return "split", min(128, dv)
    if precision in FP32_ACCURATE_SPLIT:
        return "split", min(64, dv)
    if nodes == gdn_tree_split_mgpu.NODES and mgpu_ok:
        return "split_mgpu", 64
    if nodes >= SPLIT_MIN_NODES:
        return "split", min(64, dv)
    return "inverse", min(64, dv)


@functools.lru_cache(maxsize=None)
def solve_config(method: str, block_v: int, precision: str) -> SolveConfig:
    """The kernel config the dispatcher runs for a form, value tile width and precision: every other field at its
    measured default (`SolveConfig`; docs/kernels.md)."""
    return SolveConfig(method=method, block_v=block_v, precision=precision)


def _split_mgpu_refusal(q, v, block_v: int, precision: str | None, impl: Impl) -> str:
    """Why method "split_mgpu" cannot run on these inputs ("" when it can); the other checks are
    tree_solve_supported's."""
    if not gdn_tree_split_mgpu.supported(_padded_n(q.shape[1]), q.shape[-1], v.shape[-1], block_v, q.dtype):
        return (f"split_mgpu takes {gdn_tree_split_mgpu.NODES} (padded) nodes, bf16 q/k, "
                f"block_v in {gdn_tree_split_mgpu.BLOCK_VS}")
    if (precision or _default_precision(q.dtype)) != "tf32":
        return "split_mgpu's bf16-pair products are not fp32-accurate (precision must be tf32)"
    if impl != "interpret" and not hopper_available():
        return "split_mgpu needs a compute capability 9.x GPU (wgmma)"
    return ""


@jax.named_scope("gdn_state")
def tree_solve(S0, q, k, v, g, beta, mask, path_nodes: int | None = None, *, impl: Impl = "auto",
               method: str = "auto", block_v: int | None = None, precision: str | None = None,
               reference_method: str = "solve", deferred: gdn.DeferredUpdates | None = None,
               compute_dtype=None, layer: int | None = None):
    """Closed-form GDN tree solve with gdn.masked_solve's contract; returns (o fp32, SolveFactors).

    layer (an index; not static on the kernel path: one kernel for every layer): S0 is the model's stack [L, B, HV,
    dk, dv] of every GDN layer's committed state and the solve is layer `layer`'s; the one-launch kernels read that
    layer's tiles where they lie (no copy of the layer's state out of the stack), every other path takes
    `S0[layer]`.

    compute_dtype: the dtype the calling model computes in (the verify passes its activations' dtype). On the
    kernel path q, k, v are then handed over as `kernel_operands` gives them and its precision is the default; the reference path takes them as they are (fp32: the oracle). None: as given, precision by q's dtype.

    deferred: the state is S0 with these committed rows pending (`gdn.DeferredUpdates`, heads first, keys at
    value heads; the engine's `TargetState.pending` of one layer). The one-launch kernel forms merge them into the
    state tile they load (`tree_solve_pallas(deferred=...)`: the merged state is never written); everywhere else
    (reference, the split forms, a ring the kernel does not tile) they are folded first (`gdn.deferred_fold`).
    The merged kernel path is for serving: not differentiable.

    q, k: [B,N,HK,dk] at their key heads (the kernel indexes key head h // (HV/HK); expanded [B,N,HV,dk] also
    works, at HV/HK times the bytes). impl: "auto" (kernel iff GPU and supported),
    "reference", "pallas" (kernel or ValueError), "interpret" (kernel in Pallas interpret mode, CPU tests).
    method: the kernel's form, "neumann" | "squaring" | "inverse" | "split" | "split_mgpu" (gdn_tree_solve says what each
    does; bench/results/archive/kernels_h200.md has them timed), or "auto" (`auto_method`); reference_method for the
    reference path.
    precision (kernel): "tf32" (default for bf16/f16 inputs, ~3e-4 relative error), "tf32x3"
    (default for fp32 inputs, ~3e-7), "ieee".
    """
    N = q.shape[1]
    path_nodes = N if path_nodes is None else int(path_nodes)
    given = q, k, v                        # what the reference takes (the cast below is the kernel path's)
    if compute_dtype is not None and impl != "reference":
        q, k, v, operand_precision = kernel_operands(q, k, v, compute_dtype)
        precision = precision or operand_precision
    stack = S0
    if layer is not None:                  # the layer's state, for every path but the one-launch kernels'
        S0 = jax.ShapeDtypeStruct(stack.shape[1:], stack.dtype) if impl != "reference" else stack[layer]
    if deferred is not None and impl == "reference":
        S0, deferred = gdn.deferred_fold(S0, deferred), None
    if impl == "reference":
        return _reference(S0, q, k, v, g, beta, mask, path_nodes, reference_method)
    if method == "auto":
        n_pad = _padded_n(N)
        mgpu_ok = impl != "interpret" and not _split_mgpu_refusal(q, v, 64, precision, impl)
        method, auto_bv = auto_method(n_pad or N, v.shape[-1], mgpu_ok, precision or _default_precision(q.dtype))
        block_v = auto_bv if block_v is None else block_v
    block_v = _block_v(v.shape[-1], block_v)
    ok, why = tree_solve_supported(S0, q, k, v, g, beta, mask, block_v, precision)
    if method not in gdn_tree_solve.METHODS:
        ok, why = False, f"method {method!r}"
    elif method == "squaring" and not gdn_tree_solve.series_ok(min(path_nodes, N), _padded_n(N) or N):
        ok, why = False, f"method 'squaring' past {gdn.SERIES_BLOCK} nodes per path (its series loses its digits)"
    elif method == "split_mgpu" and ok and (refusal := _split_mgpu_refusal(q, v, block_v, precision, impl)):
        ok, why = False, refusal
    interpret = _use_kernel(impl, ok, "tree_solve", why)
    one_launch = interpret is not None and method not in ("split", "split_mgpu")
    if layer is not None:                  # one-launch kernels read the layer's tiles of the stack where they lie
        S0, layer = (stack, layer) if one_launch else (stack[layer], None)
    merge = deferred is not None and one_launch and tile_dim_ok(deferred.row_decay.shape[-1])
    if deferred is not None and not merge:
        S0 = S0[layer] if layer is not None else S0
        S0, deferred, layer = gdn.deferred_fold(S0, deferred), None, None
    if interpret is None:
        return _reference(S0, *given, g, beta, mask, path_nodes, reference_method)
    config = solve_config(method, block_v, precision or _default_precision(q.dtype))
    if merge:
        return _kernel_forward(S0, q, k, v, g, beta, mask, path_nodes, (config, interpret, layer),
                               _kernel_deferred(deferred, q.shape[2]))
    return _kernel_solve(S0, q, k, v, g, beta, mask, path_nodes, (config, interpret, layer))


def _kernel_deferred(pend: gdn.DeferredUpdates, key_heads: int) -> tuple:
    """`gdn.DeferredUpdates` of one layer in `tree_solve_pallas`' layout: keys [B,P,HK,dk] at the key heads the
    kernel is given (the rows' keys are the same within a value-head group)."""
    r = pend.keys.shape[1] // key_heads
    return (pend.log_decay, pend.row_decay, jnp.moveaxis(pend.keys[:, ::r], 1, 2), pend.values, pend.count)


# The decode kernel's tiling (`gdn_decode_tiling`), from the H100 sweep at the 27B geometry
# (bench/results/kernels/gdn_layer_h100_padded.md, the kernel before it read the in-projection's output and took the
# norm): 2 warps throughout; 32-wide value tiles (B 8: 23.1 µs, 26.1 on one warp, 24.7 at 64 wide) until the programs
# alone fill the GPU several times over, then 64-wide (B 32: 80.3 vs 84.7 µs). At B 1 every tiling took 6.8-7.6 µs.
# With the gated norm in the kernel a program holds its whole value head (block_v = dv): 4 warps for its dk × dv fp32
# state tile, a starting point not measured on a GPU yet.
DECODE_WARPS, DECODE_WIDE_PROGRAMS, DECODE_NORM_WARPS = 2, 4096, 4


def gdn_decode_tiling(batch: int, value_heads: int, value_dim: int, norm: bool = False) -> tuple[int, int]:
    """(block_v, num_warps) of the decode kernel for `batch` slots of `value_heads` heads of width value_dim; norm:
    the kernel applies the gated output norm, which needs the whole value head in one program."""
    if norm:
        return value_dim, DECODE_NORM_WARPS
    narrow = min(32, value_dim)
    wide = batch * value_heads * value_dim // narrow >= DECODE_WIDE_PROGRAMS
    return (min(64, value_dim) if wide else narrow), DECODE_WARPS


@jax.named_scope("gdn_state")
def gdn_decode_layer(proj, window, conv_weight, A_log, dt_bias, S, valid, *, key_heads: int, key_dim: int,
                     norm: gdn.OutputNorm | None = None, layer: int | None = None, impl: Impl = "auto",
                     tiling: tuple[int, int] | None = None) -> gdn.DecodeStep:
    """`gdn.decode_layer` (proj [B, HK·G] the in-projection's output row as it is, window [B, K−1, C] in conv order,
    conv_weight [C, K], A_log, dt_bias [HV], S [B, HV, dk, dv] fp32, valid [B]; norm: the gated output norm, then o
    is the layer's normed output in proj's dtype) by the one-launch Pallas kernel where supported, else the
    reference. tiling: (block_v, num_warps), default `gdn_decode_tiling`; the kernel applies the norm where
    block_v = dv, else XLA applies it after the kernel. Forward only on the kernel path.

    layer (an index, not static: every layer runs one kernel): S is the model's stack [L, B, HV, dk, dv] of every
    GDN layer's state, window the stack [L, B, K−1, C] of their windows, and the returned state is the state stack
    with layer `layer` stepped — in place on the kernel path (no slice of either stack before the step, no write-
    back after it); the reference writes the layer's new state back into the stack. The returned window is the
    layer's new one [B, K−1, C]."""
    heads = dict(key_heads=key_heads, key_dim=key_dim)

    def reference():
        if layer is None:
            return gdn.decode_layer(proj, window, conv_weight, A_log, dt_bias, S, valid, **heads, norm=norm)
        step = gdn.decode_layer(proj, window[layer], conv_weight, A_log, dt_bias, S[layer], valid, **heads, norm=norm)
        return step._replace(state=write_layer(S, layer, step.state))

    if impl == "reference":
        return reference()
    try:
        B, P = proj.shape
        HV, dk, dv = S.shape[-3:]
        C = conv_weight.shape[0]
        block_v, num_warps = tiling or gdn_decode_tiling(B, HV, dv, norm is not None)
        fused_norm = norm is not None and block_v == dv
        ok = (gdn_decode_kernel.supported(key_heads, key_dim, HV, dv, block_v) and dk == key_dim
              and S.dtype == F32 and C == 2 * key_heads * key_dim + HV * dv
              and P == key_heads * sum(gdn.in_proj_widths(key_heads, HV, key_dim, dv).values())
              and (window.shape[-3], window.shape[-1]) == (B, C) and conv_weight.shape == (C, window.shape[-2] + 1)
              and valid.shape == (B,) and S.ndim == (4 if layer is None else 5) and S.shape[-4] == B
              and window.ndim == S.ndim - 1 and (layer is None or window.shape[0] == S.shape[0])
              and (norm is None or norm.weight.shape == (dv,)))
    except Exception:  # noqa: BLE001
        ok = False
    interpret = _use_kernel(impl, ok, "GDN decode step")
    if interpret is None:
        return reference()
    step = gdn_decode_kernel.decode_layer_pallas(proj, window, conv_weight, A_log, dt_bias, S, valid,
                                                 norm.weight if fused_norm else None, **heads,
                                                 eps=norm.eps if fused_norm else None, layer=layer, block_v=block_v,
                                                 num_warps=num_warps, interpret=interpret)
    if norm is not None and not fused_norm:      # a value tile narrower than the head: the norm after the kernel
        step = gdn.normed_readout(step, proj.dtype, gdn.split_in_proj(proj, **heads, value_heads=HV, value_dim=dv).z,
                                  norm)
    return step


# Warps of an add + RMSNorm program (one row): a starting point, not measured on a GPU yet.
ADD_NORM_WARPS = 4


@jax.named_scope("norm")
def add_rms_norm(x: jax.Array, y: jax.Array, weight: jax.Array, eps: float, *, zero_centred: bool,
                 impl: Impl = "auto") -> tuple[jax.Array, jax.Array]:
    """`gdn.add_rms_norm` (x, y [..., H] of one dtype, weight [H]) → (s = x + y, h = rms_norm(s)): the residual add
    and the norm after it in one Pallas launch (`pallas_kernels.add_norm`, the leading axes as its rows) where
    supported, else the reference. Forward only on the kernel path (serving)."""
    def reference():
        return gdn.add_rms_norm(x, y, weight, eps, zero_centred=zero_centred)

    if impl == "reference":
        return reference()
    try:
        H = x.shape[-1]
        ok = (x.shape == y.shape and x.dtype == y.dtype and x.ndim >= 1 and weight.shape == (H,)
              and jnp.dtype(x.dtype) in _FLOATS and add_norm.supported(H))
    except Exception:  # noqa: BLE001
        ok = False
    interpret = _use_kernel(impl, ok, "add + RMSNorm")
    if interpret is None:
        return reference()
    rows = x.reshape(-1, H)
    s, h = add_norm.add_rms_norm_pallas(rows, y.reshape(-1, H), weight, eps=eps, zero_centred=zero_centred,
                                        num_warps=ADD_NORM_WARPS, interpret=interpret)
    return s.reshape(x.shape), h.reshape(x.shape)


@jax.named_scope("gdn_state")
def path_commit(S0, log_decay, keys, corrected, mask, node, *, impl: Impl = "auto", block_v: int | None = None,
                precision: str = "tf32x3"):
    """State of each request's accepted node for every GDN layer: S0 [Lg,B,HV,dk,dv] fp32,
    log_decay [Lg,B,HV,N], keys [Lg,B,N,HK,dk] (input layout), corrected [Lg,B,HV,N,dv], mask [B,N,N],
    node [B] (−1 keeps S0). Not differentiable through the kernel path (serving only)."""
    if impl == "reference":
        return gdn_commit.path_commit_reference(S0, log_decay, keys, corrected, mask, node)
    try:
        Lg, B, HV, dk, dv = S0.shape
        N, HK = keys.shape[2], keys.shape[3]
        block_v = _block_v(dv, block_v)
        n_pad = _padded_n(N)
        ok = (S0.dtype == F32 and log_decay.shape == (Lg, B, HV, N) and keys.shape == (Lg, B, N, HK, dk)
              and corrected.shape == (Lg, B, HV, N, dv) and mask.shape == (B, N, N) and node.shape == (B,)
              and HV % HK == 0 and jnp.dtype(keys.dtype) in _FLOATS and n_pad is not None
              and gdn_commit.supported(n_pad, dk, dv, block_v))
    except Exception:  # noqa: BLE001
        ok = False
    interpret = _use_kernel(impl, ok, "path_commit")
    if interpret is None:
        return gdn_commit.path_commit_reference(S0, log_decay, keys, corrected, mask, node)
    if n_pad != N:   # extra nodes no accepted node descends from: zero factors, off every mask row
        extra = n_pad - N
        log_decay = jnp.pad(log_decay, [(0, 0)] * 3 + [(0, extra)])
        keys = jnp.pad(keys, [(0, 0), (0, 0), (0, extra), (0, 0), (0, 0)])
        corrected = jnp.pad(corrected, [(0, 0)] * 3 + [(0, extra), (0, 0)])
        mask = jnp.pad(mask.astype(bool), [(0, 0), (0, extra), (0, extra)]) | jnp.eye(n_pad, dtype=bool)[None]
    return gdn_commit.path_commit_pallas(S0, log_decay, keys, corrected, mask, node, block_v=block_v,
                                         precision=precision, interpret=interpret)


# Tree attention tilings from the H200 sweep (bench/results/attention/attention_tilings_h200.md, Qwen3.8-27B geometry,
# N = 64): 32 keys a block and 3 pipeline stages throughout; 128 query rows and 8 warps once the row tiles alone
# nearly fill the GPU (B 8 and 32: 250 vs 288 µs, 707 vs 1130 µs), 64 rows and 4 warps below (B 1: 83 µs, the
# 128-row tile 106 µs).
ATTENTION_WIDE_TILES = 64


def attention_tiling(batch: int, rows: int, kv_heads: int) -> tuple[int, int, int, int]:
    """(query rows, keys per block, warps, pipeline stages) of the tree-attention kernel for `batch` requests
    of `rows` query rows (tree nodes × query heads per KV head) on each of `kv_heads` KV heads."""
    if batch * kv_heads * -(-rows // 128) >= ATTENTION_WIDE_TILES:
        return 128, 32, 8, 3
    return 64, 32, 4, 3


@jax.named_scope("attention")
def tree_attention(q, keys, values, prefix_mask, tree_keys, tree_values, tree_mask, *, impl: Impl = "auto",
                   tiling: tuple[int, int, int, int] | None = None):
    """`attention.attend_prefix_tree` (q [B,T,NH,hd]; keys/values [B,S,KVH,hd]; prefix_mask [B,S]; tree_keys/values
    [B,N,KVH,hd]; tree_mask [B,T,N]) by the split-S Pallas prefix kernel + XLA combine where supported (GPU,
    head_dim a power of two ≤ 256, S a power-of-two multiple of block_s per split), else the reference.
    tiling: (query rows, keys per block, warps, stages), default `attention_tiling`. Forward only on the
    kernel path (serving)."""
    if impl == "reference":
        return attend_prefix_tree(q, keys, values, prefix_mask, tree_keys, tree_values, tree_mask)
    try:
        B, T, NH, hd = q.shape
        S, KVH = keys.shape[1], keys.shape[2]
        block_rows, block_s, num_warps, num_stages = tiling or attention_tiling(B, T * NH // KVH, KVH)
        while block_s > 16 and S % block_s:          # short caches: a smaller key block
            block_s //= 2
        splits = tree_attention_kernel.default_splits(B, T * NH // KVH, S, KVH, block_rows, block_s)
        ok = (NH % KVH == 0 and values.shape == keys.shape and prefix_mask.shape == (B, S)
              and tree_keys.shape[2:] == (KVH, hd) and tree_mask.shape == (B, T, tree_keys.shape[1])
              and tree_attention_kernel.supported(S, hd, block_s=block_s, splits=splits, block_rows=block_rows))
    except Exception:  # noqa: BLE001
        ok = False
    interpret = _use_kernel(impl, ok, "tree attention")
    if interpret is None:
        return attend_prefix_tree(q, keys, values, prefix_mask, tree_keys, tree_values, tree_mask)
    return tree_attention_kernel.prefix_tree_attention(q, keys, values, prefix_mask, tree_keys, tree_values, tree_mask,
                                                       block_s=block_s, splits=splits, block_rows=block_rows,
                                                       num_warps=num_warps, num_stages=num_stages,
                                                       interpret=interpret)


# Tree-level top-k tiling from the H200 sweep (`hyspec bench topk`, bench/results/kernels/topk_h200.md): a row of 8,192 logits
# split over 8 programs of 4 warps and merged by a second launch takes ~5 µs of GPU time; one program a row
# (one launch) 10 µs with 8 warps, 12 µs with 4; XLA's TopK and the fusions around it 41 µs in 4-5 launches.
TOPK_CHUNKS, TOPK_WARPS = 8, 4


@jax.named_scope("sampling")
def biased_topk(base: jax.Array, bias: jax.Array | None, k: int, *, impl: Impl = "auto"):
    """Top-k and log-sum-exp of every beam row of a tree level: logits base [B, V] + bias [B, W, V] (None: W = 1)
    → (values [B, W, k] f32, indices [B, W, k] int32, lse [B, W] f32), as `topk.biased_topk_reference`.
    Not differentiable through the kernel path (the tree build never is)."""
    if impl == "reference":
        return topk.biased_topk_reference(base, bias, k)
    try:
        B, V = base.shape
        ok = topk.supported(V, k) and (bias is None or (bias.ndim == 3 and bias.shape[0] == B
                                                        and bias.shape[2] == V))
    except Exception:  # noqa: BLE001
        ok = False
    interpret = _use_kernel(impl, ok, "tree-level top-k")
    if interpret is None:
        return topk.biased_topk_reference(base, bias, k)
    chunks, warps = topk_tiling(base.shape[1])
    return topk.biased_topk_pallas(base, bias, k=k, chunks=chunks, num_warps=warps, interpret=interpret)


def topk_tiling(V: int) -> tuple[int, int | None]:
    """(vocabulary chunks, warps a top-k program) for rows of V logits: TOPK_CHUNKS programs of TOPK_WARPS warps
    where each chunk keeps ≥ 512 logits, else one program a row on Triton's default warps."""
    return (TOPK_CHUNKS, TOPK_WARPS) if V // TOPK_CHUNKS >= 512 else (1, None)


def tree_level(logits: jax.Array, row: int, bias: jax.Array | None, logrho: jax.Array, logscore: jax.Array, *,
               k: int, width: int, impl: Impl = "auto"):
    """One greedy level of the beam tree: the top k children of each beam node under logits[:, row] + bias, scored,
    and the best `width` kept → (token, parent, score, rho) [B, width], as `topk.tree_level_reference` (logits
    [B, L, V], bias [B, W, V] or None, logrho / logscore [B, W]; a node is valid where its score is > −inf). The
    kernel: two launches a level, where XLA runs nine."""
    if impl == "reference":
        return topk.tree_level_reference(logits, row, bias, logrho, logscore, k=k, width=width)
    try:
        ok = topk.level_supported(logits.shape, row, None if bias is None else bias.shape, logscore.shape[1], k,
                                  width)
    except Exception:  # noqa: BLE001
        ok = False
    interpret = _use_kernel(impl, ok, "tree level")
    if interpret is None:
        return topk.tree_level_reference(logits, row, bias, logrho, logscore, k=k, width=width)
    chunks, warps = topk_tiling(logits.shape[2])
    return topk.tree_level_pallas(logits, bias, logrho, logscore, row=row, k=k, width=width, chunks=chunks,
                                  num_warps=warps, interpret=interpret)
