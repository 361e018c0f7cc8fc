"""All Gated DeltaNet math, as pure functions (the one home; see docs/design.md §3, docs/reference/target_model.md §5, §14).

Layout conventions (HF layout, kept everywhere):
  q, k : [B, N, HK, dk]   l2-normalised, q scaled, at their HK key heads (HK divides HV; value head j reads key
                          head ⌊j / (HV/HK)⌋, `value_heads`). Every function here expands them itself, where it
                          needs them per value head: no value-head copy travels between functions or to a kernel.
  v    : [B, N, HV, dv]
  g    : [B, N, HV]       log decay (<= 0), fp32
  beta : [B, N, HV]       in (0, 1), fp32
  S    : [B, HV, dk, dv]  recurrent state, fp32; output o = Sᵀ q
  mask : [B, N, N]        ancestor-or-self mask over nodes in topological order (row i: the nodes on
                          i's path from the committed state, i included). A chain is the lower triangle.

One token:  S ← e^g S;  S ← S + k βᵀ(v − Sᵀk);  o = Sᵀ q.
Many nodes (closed form): with path decay Γ = A g, pairwise decay D_ij = A_ij e^{Γ_i − Γ_j},
L = strict(A) ⊙ β kkᵀ ⊙ D and T = (I + L)⁻¹:
  U = T(β v), W = T(β k e^Γ), V' = U − W S₀
  o_i = e^{Γ_i} q_iᵀ S₀ + Σ_j (q_i·k_j) D_ij V'_j
  S_a = e^{Γ_a} S₀ + Σ_j D_aj k_j V'_jᵀ       (any node a, from the factors (Γ, k, V') alone)
Padding / invalid nodes use g = 0, β = 0: they are identity steps and contribute nothing.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST
InverseMethod = Literal["solve", "neumann", "squaring"]


def _ein(spec: str, *xs: jax.Array) -> jax.Array:
    return jnp.einsum(spec, *xs, precision=HIGHEST, preferred_element_type=F32)


# ------------------------------------------------------------------------------------------------
# Gates and q/k preparation
# ------------------------------------------------------------------------------------------------
@jax.named_scope("gdn_gates")
def gates(a: jax.Array, b: jax.Array, A_log: jax.Array, dt_bias: jax.Array) -> tuple[jax.Array, jax.Array]:
    """g = −exp(A_log)·softplus(a + dt_bias), β = sigmoid(b); fp32. a, b: [..., HV]."""
    g = -jnp.exp(A_log.astype(F32)) * jax.nn.softplus(a.astype(F32) + dt_bias.astype(F32))
    beta = jax.nn.sigmoid(b.astype(F32))
    return g, beta


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    x = x.astype(F32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


@jax.named_scope("gdn_gates")
def prepare_qk(q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """l2-normalise q/k over dk and scale q by dk^-1/2; they stay at their key heads. q, k: [..., HK, dk] fp32."""
    return l2norm(q) * (q.shape[-1] ** -0.5), l2norm(k)


def value_heads(x: jax.Array, num_value_heads: int) -> jax.Array:
    """Key-head tensor [..., HK, d] → [..., HV, d] (value head j reads key head ⌊j / (HV/HK)⌋, as HF's
    repeat_interleave). The one home of the grouped-value mapping; a no-op where HK = HV."""
    hk = x.shape[-2]
    if num_value_heads % hk:
        raise ValueError(f"{num_value_heads} value heads are not a multiple of {hk} key heads")
    return x if hk == num_value_heads else jnp.repeat(x, num_value_heads // hk, axis=-2)


@jax.named_scope("gdn_gates")
def mixer_inputs(conv_out: jax.Array, b: jax.Array, a: jax.Array, valid: jax.Array, A_log: jax.Array,
                 dt_bias: jax.Array, *, key_heads: int, key_dim: int
                 ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """A GDN layer's post-conv stream [B,T,conv_dim] ([q | k | v], head-major) and its gate inputs b, a [B,T,HV]
    → (q, k [B,T,HK,dk] fp32 normalised at their key heads, v [B,T,HV,dv], g, β [B,T,HV] fp32 with the invalid
    positions of valid [B,T] turned into identity steps): what every GDN path (decode, prefill, verify, training,
    the kernel benchmarks) hands the state math."""
    B, T, _ = conv_out.shape
    hv = a.shape[-1]
    kd = key_heads * key_dim
    q = conv_out[..., :kd].reshape(B, T, key_heads, key_dim)
    k = conv_out[..., kd:2 * kd].reshape(B, T, key_heads, key_dim)
    v = conv_out[..., 2 * kd:].reshape(B, T, hv, -1)
    q, k = prepare_qk(q, k)
    g, beta = gates(a, b, A_log, dt_bias)
    g, beta = invalidate(g, beta, valid)
    return q, k, v, g, beta


@jax.named_scope("gdn_gates")
def invalidate(g: jax.Array, beta: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Turn invalid positions (valid: [B, N]) into identity steps (g = 0, β = 0)."""
    keep = valid[..., None]
    return jnp.where(keep, g, 0.0), jnp.where(keep, beta, 0.0)


# ------------------------------------------------------------------------------------------------
# The in-projection's output: its parts, grouped by key head
# ------------------------------------------------------------------------------------------------
def in_proj_widths(key_heads: int, value_heads: int, key_dim: int, value_dim: int) -> dict[str, int]:
    """Entries of each part in one key-head group of a GDN layer's fused in-projection, in order:
    [q (dk) | k (dk) | v (r·dv) | z (r·dv) | b (r) | a (r)], r = HV/HK value heads a key head."""
    if value_heads % key_heads:
        raise ValueError(f"{value_heads} value heads are not a multiple of {key_heads} key heads")
    r = value_heads // key_heads
    return {"q": key_dim, "k": key_dim, "v": r * value_dim, "z": r * value_dim, "b": r, "a": r}


def in_proj_offsets(widths: dict[str, int]) -> dict[str, int]:
    """Where each part of `in_proj_widths` starts inside its key head's group."""
    out, start = {}, 0
    for name, w in widths.items():
        out[name], start = start, start + w
    return out


def key_head_groups(x, widths: dict[str, int], heads: int, axis: int = -1) -> dict:
    """The parts of an axis grouped by key head — `heads` groups, each the concatenation of `widths` (name ->
    entries, in order): {name: x with that axis as [heads, width]}. The rows of a GDN layer's fused in-projection
    (axis 0) and its output (axis -1). Views for numpy arrays."""
    axis %= x.ndim
    groups = x.reshape(*x.shape[:axis], heads, -1, *x.shape[axis + 1:])
    assert sum(widths.values()) == groups.shape[axis + 1], (widths, x.shape)
    starts = in_proj_offsets(widths)
    at = lambda s: groups[(slice(None),) * (axis + 1) + (s,)]     # noqa: E731
    return {name: at(slice(starts[name], starts[name] + w)) for name, w in widths.items()}


class InProjParts(NamedTuple):
    """A GDN layer's in-projection output [..., HK·G] split (`split_in_proj`)."""
    x: jax.Array   # [..., conv_dim] the conv's raw input [q_all | k_all | v_all] (head-major, the conv's order)
    z: jax.Array   # [..., HV, dv] the output gate
    b: jax.Array   # [..., HV] β logits
    a: jax.Array   # [..., HV] decay inputs


def split_in_proj(proj: jax.Array, *, key_heads: int, key_dim: int, value_heads: int,
                  value_dim: int) -> InProjParts:
    """The fused in-projection's output [..., HK·G] (groups as `in_proj_widths`) → its parts in the layouts the
    math takes (`InProjParts`); the conv's raw input regrouped from key-head groups into [q | k | v]."""
    lead = proj.shape[:-1]
    p = key_head_groups(proj, in_proj_widths(key_heads, value_heads, key_dim, value_dim), key_heads)
    x = jnp.concatenate([p[n].reshape(*lead, -1) for n in ("q", "k", "v")], -1)
    return InProjParts(x, p["z"].reshape(*lead, value_heads, value_dim), p["b"].reshape(*lead, value_heads),
                       p["a"].reshape(*lead, value_heads))


# ------------------------------------------------------------------------------------------------
# RMSNorm: the decoder layers' norms and the GDN output norm
# ------------------------------------------------------------------------------------------------
def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, zero_centred: bool) -> jax.Array:
    """x/rms(x) (in fp32) times a per-channel scale, in the two forms checkpoints store (`layers.RMSNorm`):
    zero_centred: · (1 + w) in fp32, then cast to x's dtype; else cast to x's dtype first, then · w (the two orders
    round differently in bf16). Plain elementwise jnp over the last axis: the kernels call it on their tiles.
    = `rms_apply(x, rms_inverse(x, eps), weight, ...)`, the two halves a kernel holding a row in chunks calls."""
    return rms_apply(x, rms_inverse(x, eps), weight, zero_centred=zero_centred)


def rms_inverse(x: jax.Array, eps: float) -> jax.Array:
    """1/rms(x) over the last axis in fp32, [..., 1]: rsqrt(mean(x²) + eps)."""
    xf = x.astype(F32)
    return inverse_rms(jnp.mean(xf * xf, axis=-1, keepdims=True), eps)


def inverse_rms(mean_square: jax.Array, eps: float) -> jax.Array:
    """1/rms from the fp32 mean of the squares (a kernel that sums a row in chunks computes that mean itself)."""
    return jax.lax.rsqrt(mean_square + eps)


def rms_apply(x: jax.Array, inv: jax.Array, weight: jax.Array, *, zero_centred: bool) -> jax.Array:
    """`rms_norm` given its fp32 1/rms(x) `inv` (broadcast against x: [..., 1], or a scalar for one row): x · inv in
    fp32, then the per-channel scale in the form `rms_norm` says. Elementwise, so a kernel may apply it per chunk."""
    y = x.astype(F32) * inv
    if zero_centred:
        return (y * (1.0 + weight.astype(F32))).astype(x.dtype)
    return weight * y.astype(x.dtype)


def add_rms_norm(x: jax.Array, y: jax.Array, weight: jax.Array, eps: float, *, zero_centred: bool
                 ) -> tuple[jax.Array, jax.Array]:
    """A residual add and the RMSNorm after it: (s = x + y in their dtype, as the decoder layer adds it,
    `rms_norm(s, ...)`). The math of the fused kernel (`pallas_kernels.add_norm`)."""
    s = x + y
    return s, rms_norm(s, weight, eps, zero_centred=zero_centred)


def gated_rms_norm(o: jax.Array, z: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """A GDN layer's output norm over each value head (the last axis): the plain (· w) `rms_norm` of o, then
    · SiLU(z) in fp32, cast to o's dtype."""
    y = rms_norm(o, weight, eps, zero_centred=False)
    return (y.astype(F32) * jax.nn.silu(z.astype(F32))).astype(o.dtype)


class OutputNorm(NamedTuple):
    """A GDN layer's gated output norm (`gated_rms_norm`): weight [dv], eps (a Python float: static)."""
    weight: jax.Array
    eps: float


# ------------------------------------------------------------------------------------------------
# One token, and the serial recurrence (the oracle every closed form must equal)
# ------------------------------------------------------------------------------------------------
@jax.named_scope("gdn_state")
def step(S: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array
         ) -> tuple[jax.Array, jax.Array]:
    """One token. S [B,HV,dk,dv]; q,k [B,HK,dk]; v [B,HV,dv]; g,beta [B,HV]. Returns (o [B,HV,dv], S')."""
    HV = v.shape[-2]
    q, k = value_heads(q, HV).astype(F32), value_heads(k, HV).astype(F32)
    S = S * jnp.exp(g)[..., None, None]
    m = _ein("bhkv,bhk->bhv", S, k)
    delta = beta[..., None] * (v.astype(F32) - m)
    S = S + k[..., :, None] * delta[..., None, :]
    return _ein("bhkv,bhk->bhv", S, q), S


class DecodeStep(NamedTuple):
    """One token per slot through a GDN layer (`decode_step`, `decode_layer`)."""
    o: jax.Array        # [B, HV, dv] fp32 readout (`decode_layer` with a norm: the normed output, proj's dtype)
    state: jax.Array    # [B, HV, dk, dv] fp32
    window: jax.Array   # [B, K−1, C] the conv window after the token (the raw inputs, their dtype)


def decode_step(x: jax.Array, window: jax.Array, weight: jax.Array, a: jax.Array, b: jax.Array, A_log: jax.Array,
                dt_bias: jax.Array, S: jax.Array, valid: jax.Array, *, key_heads: int, key_dim: int) -> DecodeStep:
    """A GDN layer's decoding step after its in-projection: the conv over the window and the new raw inputs
    x [B, C] (zeroed where not valid), the gates from a, b [B, HV], the q/k l2norm, the state update and the readout;
    slots where valid [B] is False take an identity step and keep their window. As the multi-token paths compose it;
    `decode_layer` adds the in-projection's split before it and the output norm after it."""
    conv_out = causal_conv(x[:, None], window, weight)
    q, k, v, g, beta = mixer_inputs(conv_out, b[:, None], a[:, None], valid[:, None], A_log, dt_bias,
                                    key_heads=key_heads, key_dim=key_dim)
    o, S = step(S, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
    return DecodeStep(o, S, conv_window_after(x[:, None], window, valid.astype(jnp.int32)))


def decode_layer(proj: jax.Array, window: jax.Array, conv_weight: jax.Array, A_log: jax.Array, dt_bias: jax.Array,
                 S: jax.Array, valid: jax.Array, *, key_heads: int, key_dim: int,
                 norm: OutputNorm | None = None) -> DecodeStep:
    """A GDN layer's decoding step from its in-projection's output row proj [B, HK·G] (`in_proj_widths`' groups):
    its parts split (`split_in_proj`), the raw conv input zeroed where valid [B] is False (as HF zeroes padding
    before the conv), then `decode_step`; with `norm`, the readout through the gated output norm: o is then
    `gated_rms_norm(o.astype(proj.dtype), z, ...)` in proj's dtype (what the layer's out-projection takes). The
    math of the decode kernel (`pallas_kernels.gdn_decode`)."""
    HV, dv = S.shape[-3], S.shape[-1]
    parts = split_in_proj(proj, key_heads=key_heads, key_dim=key_dim, value_heads=HV, value_dim=dv)
    x = jnp.where(valid[:, None], parts.x, 0)
    step = decode_step(x, window, conv_weight, parts.a, parts.b, A_log, dt_bias, S, valid, key_heads=key_heads,
                       key_dim=key_dim)
    return step if norm is None else normed_readout(step, proj.dtype, parts.z, norm)


def normed_readout(step: DecodeStep, dtype, z: jax.Array, norm: OutputNorm) -> DecodeStep:
    """`decode_layer`'s readout through the gated output norm: o cast to dtype (the in-projection row's), then
    `gated_rms_norm` with the output gate z [B, HV, dv]."""
    with jax.named_scope("norm"):              # as the module's (`layers.GatedRMSNorm`), for the profiles' parts
        return step._replace(o=gated_rms_norm(step.o.astype(dtype), z, norm.weight, norm.eps))


def serial_recurrence(S: jax.Array, q, k, v, g, beta) -> tuple[jax.Array, jax.Array]:
    """Token-by-token over N (a chain). Returns (o [B,N,HV,dv], S_final)."""
    def body(S, xs):
        o, S = step(S, *xs)
        return S, o
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    S, o = jax.lax.scan(body, S, xs)
    return jnp.moveaxis(o, 0, 1), S


# ------------------------------------------------------------------------------------------------
# Closed form over an ancestor mask
# ------------------------------------------------------------------------------------------------
class SolveFactors(NamedTuple):
    """What is needed to form the state of any node later (Bole's factorized commit). Γ and V' heads-first; the
    keys as the solve was given them (key heads, their dtype): never copied per value head."""
    log_decay: jax.Array  # Γ  [B, HV, N]
    keys: jax.Array       # k  [B, N, HK, dk]
    corrected: jax.Array  # V' [B, HV, N, dv]


def unit_lower_inverse(L: jax.Array, method: InverseMethod = "solve", path_nodes: int | None = None) -> jax.Array:
    """(I + L)⁻¹ for strictly-lower L [..., N, N] whose nonzeros follow ancestor chains of depth ≤ path_nodes.

    neumann: Σ_{n=0}^{d} (−L)ⁿ by Horner, d products (its iterates stay bounded: accurate at any depth).
    squaring: (I−L)(I+L²)(I+L⁴)…, ⌈log₂(d+1)⌉ factors (exact because L^{d+1} = 0); past SERIES_BLOCK nodes per
    path on diagonal blocks joined by doublings (`block_inverse`: the series alone loses its digits there).
    solve: triangular solve (any depth).
    """
    n = L.shape[-1]
    eye = jnp.eye(n, dtype=L.dtype)
    if method == "solve":
        return jax.lax.linalg.triangular_solve(eye + L, jnp.broadcast_to(eye, L.shape), left_side=True,
                                               lower=True, unit_diagonal=True)
    d = n - 1 if path_nodes is None else max(0, min(path_nodes, n) - 1)  # d edges on the longest path
    if d == 0:
        return jnp.broadcast_to(eye, L.shape)
    if method == "neumann":
        T = eye - L
        for _ in range(d - 1):
            T = eye - _ein("...ij,...jk->...ik", L, T)
        return T
    if method == "squaring" and d >= SERIES_BLOCK:
        rows, cols = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0), jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
        return block_inverse(L, rows, cols, d, lambda a, b: _ein("...ij,...jk->...ik", a, b))
    if method == "squaring":
        T, P = eye - L, L
        for _ in range(num_squarings(d) - 1):
            P = _ein("...ij,...jk->...ik", P, P)
            T = _ein("...ij,...jk->...ik", T, eye + P)
        return T
    raise ValueError(f"unknown inverse method {method!r}")


SERIES_BLOCK = 8     # nodes per diagonal block where the kernels' power series stays accurate (see block_inverse)


def num_squarings(d: int) -> int:
    """Factors (I−L)(I+L²)…: ⌈log₂(d+1)⌉ in all, for d edges on the longest path (L^{d+1} = 0)."""
    return 0 if d == 0 else math.ceil(math.log2(d + 1))


def block_inverse(L, rows, cols, d: int, dot, block: int = SERIES_BLOCK):
    """(I + L)⁻¹ as the kernels form it, for strictly lower-triangular L [N, N] (nodes in topological order) with d
    edges on its longest path; rows, cols: int32 index tiles in the kernel's layout; `dot` its N × N product.

    d < block: `squaring_factors` alone. Deeper, the series is not used across blocks: it sums terms as large as
    C(d, d/2)·max|L|^{d/2} into entries of size ~1, so with keys alike along a path and decays near 1 a chain of
    16 loses all of fp16's (and tf32's) digits, one of 64 all of fp32's. Instead the factors invert the diagonal
    blocks of `block` nodes (no path inside one is longer), and log₂(N / block) doublings M ← M − M C M join
    neighbouring blocks into ones twice as large ([A 0; C B]⁻¹ = [A⁻¹ 0; −B⁻¹CA⁻¹ B⁻¹], C: the entries of L
    between the two): every term of a doubling is an entry of the inverse or of L, nothing cancels. Same product
    count as the series at d = 63 for N = 64 (10)."""
    eye = (rows == cols).astype(L.dtype)
    n = L.shape[-1]
    if d < block:                                           # d ≤ N − 1: also every N ≤ block
        return squaring_factors(L, eye, num_squarings(d), dot)
    shift = block.bit_length() - 1
    block_of = lambda x, s: jnp.right_shift(x, s)            # noqa: E731 — index of x's 2^s-node block
    M = squaring_factors(jnp.where(block_of(rows, shift) == block_of(cols, shift), L, 0.0), eye,
                         num_squarings(block - 1), dot)
    while (1 << shift) < n:
        pair = block_of(rows, shift + 1) == block_of(cols, shift + 1)
        C = jnp.where(pair & (block_of(rows, shift) != block_of(cols, shift)), L, 0.0)   # joins the pair's blocks
        M = M - dot(dot(M, C), M)
        shift += 1
    return M


def squaring_factors(L, eye, squarings: int, dot):
    """(I + L)⁻¹ = (I−L)(I+L²)(I+L⁴)… for nilpotent L as the kernels form it: M ← M + L^{2^i} M, so each factor is
    one product of its own and a square; `dot` is the kernel's N × N product (a tensor-core form of the caller's
    choosing) and `eye` its identity in the kernel's layout. `unit_lower_inverse` keeps the factors as products
    T (I + P), an independent order for the reference the kernels are checked against."""
    if squarings == 0:
        return eye
    M, P = eye - L, L
    for _ in range(squarings - 1):
        P = dot(P, P)
        M = M + dot(P, M)
    return M


def squaring_factors_with_query(L, C, eye, squarings: int, dot):
    """M = (I + L)⁻¹ and C M together (`squaring_factors`' factors, applied from the right): M ← M + M P and
    C M ← C M + (C M) P share each square P. The factors are polynomials in L, so they commute and the order is
    free. After L: ⌈log₂(d+1)⌉ levels of dependent products, where `squaring_factors` then C M take one more; at
    the cost of more products (C L, and (C M) P beside each M P)."""
    if squarings == 0:
        return eye, C
    M, CM, P = eye - L, C - dot(C, L), L
    for _ in range(squarings - 1):
        P = dot(P, P)
        M, CM = M + dot(M, P), CM + dot(CM, P)
    return M, CM


def _heads_first(q, k, v, g, beta):
    """q/k expanded to v's heads, then every input heads-first in fp32."""
    q, k = value_heads(q, v.shape[2]), value_heads(k, v.shape[2])
    return (jnp.moveaxis(q, 2, 1).astype(F32), jnp.moveaxis(k, 2, 1).astype(F32),
            jnp.moveaxis(v, 2, 1).astype(F32), jnp.moveaxis(g, 2, 1).astype(F32),
            jnp.moveaxis(beta, 2, 1).astype(F32))


@jax.named_scope("gdn_state")
def masked_solve(S0: jax.Array, q, k, v, g, beta, mask: jax.Array, *, method: InverseMethod = "solve",
                 path_nodes: int | None = None) -> tuple[jax.Array, SolveFactors]:
    """Closed-form GDN over N nodes related by an ancestor-or-self `mask` [B,N,N], from state S0.

    Never writes S0. Returns per-node outputs o [B,N,HV,dv] and the factors to form any node's state.
    `path_nodes` (nodes on the longest root-to-leaf path) bounds the Neumann / squaring rounds.
    """
    keys = k
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    A = mask.astype(F32)[:, None]                                  # [B,1,N,N]
    log_decay = tree_log_decay(mask, g)                            # Γ [B,H,N]
    D = path_decay(A, log_decay, log_decay)                        # [B,H,N,N]
    eye = jnp.eye(A.shape[-1], dtype=F32)
    L = (A - eye) * beta[..., :, None] * _ein("bhid,bhjd->bhij", k, k) * D
    T = unit_lower_inverse(L, method, path_nodes)
    U = _ein("bhij,bhjv->bhiv", T, beta[..., None] * v)
    W = _ein("bhij,bhjd->bhid", T, beta[..., None] * k * jnp.exp(log_decay)[..., None])
    corrected = U - _ein("bhid,bhdv->bhiv", W, S0)
    o = (jnp.exp(log_decay)[..., None] * _ein("bhid,bhdv->bhiv", q, S0)
         + _ein("bhij,bhjv->bhiv", _ein("bhid,bhjd->bhij", q, k) * D, corrected))
    return jnp.moveaxis(o, 1, 2), SolveFactors(log_decay, keys, corrected)


def tree_log_decay(mask: jax.Array, g: jax.Array) -> jax.Array:
    """Γ = A g: each node's summed log decay from its root through itself; mask [B,N,N] ancestor-or-self,
    g [B,H,N] (heads first) → [B,H,N]."""
    return _ein("bij,bhj->bhi", mask.astype(F32), g.astype(F32))


def masked_exp(on: jax.Array, exponent: jax.Array) -> jax.Array:
    """exp(exponent) where `on`, 0 elsewhere; masked before the exp so an unused exponent never overflows. Plain
    elementwise jnp: the kernels call it on their own tiles (any lowering, any register layout)."""
    return jnp.where(on, jnp.exp(jnp.where(on, exponent, 0.0)), 0.0)


def path_decay(A_rows: jax.Array, log_decay_rows: jax.Array, log_decay_cols: jax.Array) -> jax.Array:
    """D = A ⊙ exp(Γ_row − Γ_col), masked before the exp so the exponent is ≤ 0 wherever it is used.

    A_rows [B,1|H,M,N] (0/1), Γ rows [B,H,M], Γ cols [B,H,N] -> [B,H,M,N].
    """
    return masked_exp(A_rows > 0, log_decay_rows[..., :, None] - log_decay_cols[..., None, :])


@jax.named_scope("gdn_state")
def node_state(S0: jax.Array, factors: SolveFactors, mask: jax.Array, node: jax.Array) -> jax.Array:
    """State after node `node` [B] (int; −1 = the committed state itself): e^{Γ_a} S0 + Σ_j D_aj k_j V'_jᵀ.

    This is Bole's factorized commit: no per-node states are ever formed.
    """
    idx = jnp.maximum(node, 0)
    row = jnp.take_along_axis(mask.astype(F32), idx[:, None, None], axis=1)[:, None]    # [B,1,1,N]
    gamma_a = jnp.take_along_axis(factors.log_decay, idx[:, None, None], axis=2)       # [B,H,1]
    D = path_decay(row, gamma_a, factors.log_decay)[..., 0, :]                          # [B,H,N]
    keys = value_heads(factors.keys, S0.shape[1]).astype(F32)                            # [B,N,HV,dk]
    S = (jnp.exp(gamma_a)[..., None] * S0
         + _ein("bhj,bjhd,bhjv->bhdv", D, keys, factors.corrected))
    return jnp.where((node >= 0)[:, None, None, None], S, S0)


# ------------------------------------------------------------------------------------------------
# Deferred commit: the state as a base plus a low-rank tail of committed, not yet merged, path updates
# ------------------------------------------------------------------------------------------------
class DeferredUpdates(NamedTuple):
    """S = e^{c} S_base + Σ_{i<count} e^{c − c_i} k_i v_iᵀ  (heads-first, keys expanded to value heads).

    Committing a path then writes only its ≤ d+1 rows (k_j, V'_j, c_i = c + Γ_j) and c ← c + Γ_a; the full
    state is merged (`deferred_fold`) by whoever reads S_base next — the next verify, which reads it anyway —
    or when the P rows run out. Row weights e^{c − c_i} ≤ 1: decays only shrink old rows.
    """
    log_decay: jax.Array   # c    [B, HV] total log decay applied since S_base
    row_decay: jax.Array   # c_i  [B, HV, P] c + Γ_j when row i was appended
    keys: jax.Array        # k_i  [B, HV, P, dk]
    values: jax.Array      # v_i  [B, HV, P, dv] (the path's V' rows, unscaled)
    count: jax.Array       # [B] int32 rows in use


def deferred_empty(batch: int, heads: int, rows: int, dk: int, dv: int) -> DeferredUpdates:
    z = lambda *s: jnp.zeros(s, F32)  # noqa: E731
    return DeferredUpdates(z(batch, heads), z(batch, heads, rows), z(batch, heads, rows, dk),
                           z(batch, heads, rows, dv), jnp.zeros((batch,), jnp.int32))


def deferred_row_weights(pend: DeferredUpdates) -> jax.Array:
    """e^{c − c_i} for rows in use, 0 beyond `count`: [B, HV, P]."""
    used = jnp.arange(pend.row_decay.shape[-1])[None, None, :] < pend.count[:, None, None]
    return masked_exp(used, pend.log_decay[..., None] - pend.row_decay)


@jax.named_scope("gdn_state")
def deferred_fold(S_base: jax.Array, pend: DeferredUpdates) -> jax.Array:
    """The state the updates stand for: e^{c} S_base + Σ_i w_i k_i v_iᵀ  [B, HV, dk, dv]."""
    w = deferred_row_weights(pend)
    return (jnp.exp(pend.log_decay)[..., None, None] * S_base.astype(F32)
            + _ein("bhp,bhpd,bhpv->bhdv", w, pend.keys, pend.values))


@jax.named_scope("gdn_state")
def deferred_append(pend: DeferredUpdates, factors: SolveFactors, path: jax.Array,
                    length: jax.Array) -> DeferredUpdates:
    """Commit the root-to-node path of a tree solved from `deferred_fold(S_base, pend)`.

    path [B, d] the path's nodes in order (−1 past `length` [B]; length 0 = nothing accepted), as
    `tree.path_to` returns them. Equal, once folded, to `node_state(deferred_fold(...), factors, mask, node)`
    with node = the path's last entry:
    e^{Γ_a}(e^{c} S_base + Σ_i w_i k_i v_iᵀ) + Σ_j e^{Γ_a − Γ_j} k_j V'_jᵀ. The caller keeps count + d ≤ P
    (merge first otherwise); rows past P are dropped.
    """
    B, H, P = pend.row_decay.shape
    d = path.shape[1]
    on = jnp.arange(d)[None] < length[:, None]                                        # [B, d]
    src = jnp.maximum(path, 0)
    dst = jnp.where(on, pend.count[:, None] + jnp.arange(d)[None], P)               # P → dropped
    gather = lambda x: jnp.take_along_axis(x, src[:, None, :, None], axis=2)  # noqa: E731  [B,H,d,·]
    keys = jnp.moveaxis(value_heads(factors.keys, H), 2, 1).astype(F32)               # [B,H,N,dk]
    gam = jnp.take_along_axis(factors.log_decay, src[:, None, :], axis=2)            # Γ_j  [B,H,d]
    b, h = jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None]
    put = lambda x, rows: x.at[b, h, dst[:, None, :]].set(rows, mode="drop")  # noqa: E731
    last = jnp.take_along_axis(gam, jnp.maximum(length - 1, 0)[:, None, None], axis=2)[..., 0]   # Γ_a [B,H]
    accepted = (length > 0)[:, None]
    return DeferredUpdates(
        log_decay=pend.log_decay + jnp.where(accepted, last, 0.0),
        row_decay=put(pend.row_decay, pend.log_decay[..., None] + gam),
        keys=put(pend.keys, gather(keys)),
        values=put(pend.values, gather(factors.corrected)),
        count=jnp.minimum(pend.count + length, P).astype(jnp.int32))


def chain_mask(batch: int, n: int) -> jax.Array:
    return jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (batch, n, n))


@jax.named_scope("gdn_state")
def chunked_prefill(S0: jax.Array, q, k, v, g, beta, *, chunk_size: int = 64,
                    method: InverseMethod = "solve") -> tuple[jax.Array, jax.Array]:
    """A chain of any length T as a scan over chunks of the masked solve. Returns (o [B,T,HV,dv], S_T)."""
    B, T = q.shape[:2]
    C = min(chunk_size, T)
    pad = (-T) % C
    if pad:  # identity steps
        padw = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        q, k, v, g, beta = map(padw, (q, k, v, g, beta))
    n_chunks = (T + pad) // C
    to_chunks = lambda x: jnp.moveaxis(x.reshape(B, n_chunks, C, *x.shape[2:]), 1, 0)
    mask = chain_mask(B, C)
    last = jnp.full((B,), C - 1, jnp.int32)

    def body(S, xs):
        o, fac = masked_solve(S, *xs, mask, method=method, path_nodes=C)
        return node_state(S, fac, mask, last), o

    S, o = jax.lax.scan(body, S0.astype(F32), tuple(map(to_chunks, (q, k, v, g, beta))))
    o = jnp.moveaxis(o, 0, 1).reshape(B, n_chunks * C, *o.shape[3:])[:, :T]
    return o, S


# ------------------------------------------------------------------------------------------------
# Causal depthwise conv over the q/k/v stream (raw window of the last K−1 inputs is the conv state)
# ------------------------------------------------------------------------------------------------
@jax.named_scope("gdn_conv")
def causal_conv(x: jax.Array, window: jax.Array, weight: jax.Array) -> jax.Array:
    """x [B,T,C] new raw inputs, window [B,K−1,C] previous raw inputs, weight [C,K] (tap K−1 = current).

    Returns SiLU(conv) [B,T,C] in fp32.
    """
    K = weight.shape[-1]
    xs = jnp.concatenate([window.astype(x.dtype), x], axis=1).astype(F32)
    T = x.shape[1]
    out = sum(xs[:, j:j + T] * weight[:, j].astype(F32) for j in range(K))
    return jax.nn.silu(out)


@jax.named_scope("gdn_conv")
def conv_window_after(x: jax.Array, window: jax.Array, num_valid: jax.Array) -> jax.Array:
    """The last K−1 raw inputs after appending the first num_valid [B] tokens of x [B,T,C] to window."""
    Km1 = window.shape[1]
    xs = jnp.concatenate([window.astype(x.dtype), x], axis=1)
    return jax.vmap(lambda s, n: jax.lax.dynamic_slice_in_dim(s, n, Km1, axis=0))(xs, num_valid)


@jax.named_scope("gdn_conv")
def gathered_conv(x: jax.Array, window: jax.Array, weight: jax.Array, taps: jax.Array) -> jax.Array:
    """Conv where each node's K inputs are given by an index table (trees: the node and its ancestors).

    x [B,N,C], window [B,K−1,C]; taps [B,N,K] indexes into concat(window, x) (K−1 + N rows), tap K−1 = self.
    Summed tap by tap as `causal_conv` sums them (each a row gather times its weight column): XLA fuses that into one
    pass over the rows, where a [B,N,K,C] gather contracted by an einsum over K was written out and read back (the
    27B verify's conv: 3.9 of 43 ms at B 8, N 32 on an H100, bench/results/scale/profile_scale_h100_fused.md).
    """
    xs = jnp.concatenate([window.astype(x.dtype), x], axis=1)
    w = weight.astype(F32)
    rows = lambda j: jnp.take_along_axis(xs, taps[..., j, None], axis=1).astype(F32)    # noqa: E731  [B,N,C]
    return jax.nn.silu(sum(rows(j) * w[:, j] for j in range(weight.shape[-1])))
