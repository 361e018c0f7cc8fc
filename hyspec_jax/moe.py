"""Routed mixture-of-experts math: the router's top-k, and the chosen experts' SwiGLU in three execution forms.

Expert weights keep the transformers layout the checkpoints and the sharding rules use: gate_up [E, 2I, H]
(gate rows first), down [E, H, I]. Every form computes, for each token t and each of its k chosen experts e
with routing weight p:  y_te = down_e · (SiLU(gate_e x_t) ⊙ up_e x_t),  out_t = Σ_k p · y_te, with fp32
accumulation, the projections cast back to the activation dtype before the next op (as the dense form always
did), and the k-way combine accumulated in `accumulate` and rounded once. They differ only in how the work is
laid out, so they agree to rounding (tests/test_moe.py):

  "gather"   w[top_i]: a copy of only the T·k chosen experts' weights, then batched matrix-vector products.
             Reads T·k expert matrices (duplicates included) — the decode / few-row verify form.
  "grouped"  the T·k (token, expert) assignments sorted by expert, one grouped matmul per projection
             (`jax.lax.ragged_dot_general`, contracting the weights' last axis, so no transpose), unsorted
             and combined. Work proportional to T·k; what it reads depends on the backend's ragged-dot
             lowering: XLA's generic one (CPU, and GPU when no grouped-GEMM library path applies) expands
             it densely over all E groups, k× the dense form's work.
  "dense"    every token through every expert, weighted by a [T, E] combine matrix that is zero off the
             top-k. E/k × the routed work; kept because it is the fastest on CPU beyond a handful of rows,
             where ragged_dot is lowered densely (see above).

Expert parallel (experts sharded over the mesh's `model` axis, `hyspec_jax.sharding`): every form stays exact;
XLA partitions "gather" as a masked local gather plus an all-reduce of the gathered weights [T, k, 2I, H] (not
of the [T, H] outputs, as "dense" does), a communication cost a shard_map form would avoid.

`choose_form` is the static rule the model applies per call (on the token count); bench/moe_scale.py
measures each form against its HBM / compute floor at Qwen3-Next-80B-A3B geometry.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FORMS = ("gather", "grouped", "dense")


def route(logits: jax.Array, top_k: int, normalise: bool, accumulate=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, E] -> (top_p [T, k] in `accumulate`, top_i [T, k] int32): softmax over all experts,
    top-k (equal probabilities: the lower expert index first), optionally renormalised over the k."""
    probs = jax.nn.softmax(logits.astype(accumulate), axis=-1)
    top_p, top_i = jax.lax.top_k(probs, top_k)
    if normalise:
        top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    return top_p, top_i.astype(jnp.int32)


def choose_form(tokens: int, num_experts: int, top_k: int) -> str:
    """The form for a call of `tokens` rows (static: shapes are static under jit).

    "gather" while T·k ≤ E: it then reads at most as many expert matrices as exist (T·k, the minimum a
    routed form can read when the chosen experts are distinct), and XLA runs its matrix-vector products
    at the memory floor. Beyond that the gathered copy would exceed the whole expert tensor, so "routed":
    the grouped matmul on accelerators, the dense form on CPU (`routed_experts` picks per platform)."""
    return "gather" if tokens * top_k <= num_experts else "routed"


def _swiglu(gu: jax.Array) -> jax.Array:
    gate, up = jnp.split(gu, 2, axis=-1)
    return jax.nn.silu(gate) * up


def _combine(y: jax.Array, top_p: jax.Array, accumulate) -> jax.Array:
    """Σ_k p · y over a token's k experts: y [T, k, H], top_p [T, k] -> [T, H] (accumulated, rounded once)."""
    return jnp.einsum("tkh,tk->th", y, top_p.astype(y.dtype), preferred_element_type=accumulate).astype(y.dtype)


def experts_gather(x: jax.Array, w_gu: jax.Array, w_d: jax.Array, top_p: jax.Array, top_i: jax.Array,
                   accumulate=jnp.float32) -> jax.Array:
    """x [T, H] through its k chosen experts by gathering only their weights: [T, H]."""
    dt = x.dtype
    gu = jnp.einsum("th,tkoh->tko", x.astype(w_gu.dtype), w_gu[top_i], preferred_element_type=accumulate).astype(dt)
    y = jnp.einsum("tki,tkhi->tkh", _swiglu(gu), w_d[top_i], preferred_element_type=accumulate).astype(dt)
    return _combine(y, top_p, accumulate)


# ragged_dot_general: lhs [A, K] ragged over A, rhs [E, N, K] grouped over E, contracting lhs K with rhs K
# (the weights' last axis — their [out, in] layout, so nothing is transposed)
_RAGGED_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=(0,), rhs_group_dimensions=(0,))


def sort_by_expert(top_i: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The T·k assignments ordered by expert: (order [A] — position of each sorted assignment in the flat
    [T·k] list, token = order // k; inverse [A] — where each flat assignment landed; group_sizes [E] int32)."""
    flat = top_i.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)       # stable: a fixed order for ties
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, inverse, group_sizes


def experts_grouped(x: jax.Array, w_gu: jax.Array, w_d: jax.Array, top_p: jax.Array, top_i: jax.Array,
                    accumulate=jnp.float32) -> jax.Array:
    """x [T, H] through its k chosen experts as grouped matmuls over the expert-sorted assignments: [T, H]."""
    T, k = top_i.shape
    dt = x.dtype
    order, inverse, sizes = sort_by_expert(top_i, w_gu.shape[0])
    xs = x[order // k]                                                            # [A, H], grouped by expert
    dot = lambda a, w: jax.lax.ragged_dot_general(a.astype(w.dtype), w, sizes, _RAGGED_DIMS,
                                                  preferred_element_type=accumulate).astype(dt)
    ys = dot(_swiglu(dot(xs, w_gu)), w_d)                                         # [A, H]
    return _combine(ys[inverse].reshape(T, k, -1), top_p, accumulate)


def experts_dense(x: jax.Array, w_gu: jax.Array, w_d: jax.Array, top_p: jax.Array, top_i: jax.Array,
                  accumulate=jnp.float32) -> jax.Array:
    """x [T, H] through every expert, the outputs weighted by the routing weights (zero off the top-k): [T, H]."""
    T, dt = top_i.shape[0], x.dtype
    gu = jnp.einsum("th,eoh->teo", x.astype(w_gu.dtype), w_gu, preferred_element_type=accumulate).astype(dt)
    y = jnp.einsum("tei,ehi->teh", _swiglu(gu), w_d, preferred_element_type=accumulate).astype(dt)
    combine = jnp.zeros((T, w_gu.shape[0]), y.dtype).at[jnp.arange(T)[:, None], top_i].set(top_p.astype(y.dtype))
    return jnp.einsum("teh,te->th", y, combine, preferred_element_type=accumulate).astype(y.dtype)


def routed_experts(x: jax.Array, w_gu: jax.Array, w_d: jax.Array, top_p: jax.Array, top_i: jax.Array,
                   accumulate=jnp.float32) -> jax.Array:
    """Many rows: the grouped matmul on accelerators, the dense form on CPU, where XLA lowers ragged_dot by
    expanding it over all E groups (k× the dense form's work). Chosen when the program is lowered."""
    args = (x, w_gu, w_d, top_p, top_i)
    return jax.lax.platform_dependent(*args, cpu=lambda *a: experts_dense(*a, accumulate),
                                      default=lambda *a: experts_grouped(*a, accumulate))


_FORM_FNS = {"gather": experts_gather, "grouped": experts_grouped, "dense": experts_dense,
             "routed": routed_experts}


def experts(x: jax.Array, w_gu: jax.Array, w_d: jax.Array, top_p: jax.Array, top_i: jax.Array, *,
            form: str | None = None, accumulate=jnp.float32) -> jax.Array:
    """x [T, H] through the routed experts (top_p / top_i [T, k] from `route`): [T, H] in x's dtype.
    form: one of FORMS (or "routed"), default `choose_form` on T."""
    form = form or choose_form(x.shape[0], w_gu.shape[0], top_i.shape[1])
    if form not in _FORM_FNS:
        raise ValueError(f"unknown MoE form {form!r}; expected one of {', '.join(_FORM_FNS)}")
    return _FORM_FNS[form](x, w_gu, w_d, top_p, top_i, accumulate)
